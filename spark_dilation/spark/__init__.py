"""Spark integration: ``spark.read.format("dilation")`` and notebook helpers.

Public API:

- :class:`DilationDataSource` -- the PySpark data source named ``"dilation"``;
  Spark auto-registers it through the top-level ``pyspark_dilation`` module.
- :func:`register` -- ``register(spark)``: the explicit registration for
  sessions that cannot rely on that (Spark Connect, ``%pip install`` into a
  running notebook).
- :func:`read_wormhole_file` -- ``read_wormhole_file(spark, code, **options)``,
  the ``format("dilation")`` call for a file sent with ``wormhole send``.
- :func:`receive_file` -- receive the file to local disk (blocking) and use
  Spark's own readers, or this data source with ``option("staged_path", ...)``.
- :class:`ReceivedFile` -- what :func:`receive_file` returns.

Importing this package loads pyspark and pyarrow only (Spark imports it in
every session to discover data sources); the wormhole and Twisted are loaded
when a transfer starts.
"""

from __future__ import annotations

from typing import Any

from .datasource import DilationDataSource, NotSupportedYetError, read_wormhole_file
from .options import OptionError
from .receive import receive_file
from .register import SparkVersionError, register
from .staged import SUPPORTED_FORMATS, StagedDataError, UnsupportedFormatError

__all__ = [
    "SUPPORTED_FORMATS",
    "DilationDataSource",
    "NotSupportedYetError",
    "OptionError",
    "ReceivedFile",
    "SparkVersionError",
    "StagedDataError",
    "UnsupportedFormatError",
    "read_wormhole_file",
    "receive_file",
    "register",
]


def __getattr__(name: str) -> Any:
    # ReceivedFile lives with the transfer code, which pulls in Twisted; load
    # it only when someone asks for it.
    if name == "ReceivedFile":
        from ..transit.filetransfer import ReceivedFile

        return ReceivedFile
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
