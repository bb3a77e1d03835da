"""spark-dilation: move Spark datasets peer to peer over Magic Wormhole Dilation."""

__version__ = "0.1.0"
