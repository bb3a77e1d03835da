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

Importing this package loads nothing; each name loads its module on first
use. ``pyspark_dilation`` (which Spark imports in every session to discover
data sources) loads the data source module, which needs pyspark and pyarrow
only; the wormhole and Twisted are loaded when a transfer starts.
"""

from __future__ import annotations

from ..lazy import exports

# Loaded on first use (PEP 562): Spark's task and planner workers import
# spark_dilation.spark.dataset, which runs this file first, and need none of these.
_EXPORTS = {
    "DilationDataSource": ".datasource",
    "NotSupportedYetError": ".datasource",
    "read_wormhole_file": ".datasource",
    "OptionError": ".options",
    "receive_file": ".receive",
    "SparkVersionError": ".register",
    "register": ".register",
    "SUPPORTED_FORMATS": ".staged",
    "StagedDataError": ".staged",
    "UnsupportedFormatError": ".staged",
    # The file transfer code pulls in Twisted.
    "ReceivedFile": "..transit.filetransfer",
}

__all__ = sorted(_EXPORTS)


def _check(module: str) -> None:
    if module == ".datasource":
        # One line naming what is missing, not an ImportError from inside pyspark.
        from .register import check_pyspark

        check_pyspark()


__getattr__ = exports(__name__, _EXPORTS, before=_check)
