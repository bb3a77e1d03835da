"""spark-dilation: move Spark datasets peer to peer over Magic Wormhole Dilation.

``spark_dilation.register(spark)`` registers the ``dilation`` data source on a
classic or Spark Connect session (see :mod:`spark_dilation.spark.register`);
``spark_dilation.tune(spark)`` sets the Spark settings that make a dilation
write cheaper, where the session has none (:mod:`spark_dilation.spark.tuning`).
``spark_dilation.send(df_or_table)`` and ``spark_dilation.receive(spark_or_none,
code)`` are the notebook API, and ``stream(df)``, ``receive_stream(spark, code)`` and
``revoke_stream(pairing)`` its streams (see :mod:`spark_dilation.notebook`).
Importing this package loads nothing heavy; Spark is loaded on first use.
"""

from typing import Any

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "receive",
    "receive_stream",
    "register",
    "revoke_stream",
    "send",
    "stream",
    "tune",
]


def __getattr__(name: str) -> Any:
    if name == "register":
        from .spark.register import register

        return register
    if name == "tune":
        from .spark.tuning import tune

        return tune
    if name in ("send", "receive", "stream", "receive_stream", "revoke_stream"):
        from . import notebook

        return getattr(notebook, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
