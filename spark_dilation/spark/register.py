"""``register(spark)``: the one explicit line that makes ``format("dilation")`` work.

Spark finds the data source by itself through the ``pyspark_dilation`` module
(see that shim) when spark-dilation is installed before the session starts.
Where it is installed into a running notebook (``%pip install`` on Databricks,
a Jupyter kernel whose session already exists) or the session is a Spark
Connect client (``sc://...``, Databricks serverless and shared clusters),
call :func:`register` once per session.
"""

from __future__ import annotations

import logging
from typing import Any

from ..errors import DilationError

log = logging.getLogger(__name__)

MIN_PYSPARK = (4, 0)


class SparkVersionError(DilationError, RuntimeError):
    """This PySpark has no Python data source API."""


def _version(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split(".")[:2]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def check_pyspark(version: str | None = None) -> None:
    """Raise :class:`SparkVersionError` unless PySpark has the Python data source API.

    PySpark is an extra (``spark-dilation[spark]``), not a base dependency, so
    that a cluster keeps its own PySpark: every Spark feature checks it here.
    """
    if version is None:
        try:
            import pyspark
        except ImportError:
            raise SparkVersionError(
                "spark-dilation's Spark features need PySpark 4.0 or later, which is not "
                "installed here: pip install 'spark-dilation[spark]' (the CLI and "
                "spark_dilation.receive(None, code) work without it)"
            ) from None
        version = pyspark.__version__
    if _version(version) < MIN_PYSPARK:
        raise SparkVersionError(
            f"spark-dilation needs PySpark 4.0 or later (the Python data source API); "
            f"this is PySpark {version}. Upgrade with: pip install 'pyspark>=4.0' "
            "(on Databricks: a runtime with Spark 4, or serverless)"
        )


def register(spark: Any) -> str:
    """Register the ``dilation`` data source on ``spark``; returns its name.

    Works on a classic ``SparkSession`` and on a Spark Connect session (the
    registration travels to the server). Idempotent: registering again
    replaces the registration with the same class (PySpark 4.0 keeps the one
    Spark found through the shim). Nothing here touches
    ``SparkContext``.
    """
    check_pyspark()
    from .datasource import DilationDataSource

    data_sources = getattr(spark, "dataSource", None)
    if data_sources is None:
        raise SparkVersionError(
            f"this Spark session ({type(spark).__module__}.{type(spark).__name__}) has no "
            "dataSource registry: spark-dilation needs a PySpark 4 session"
        )
    from pyspark.errors import PySparkException

    try:
        data_sources.register(DilationDataSource)
    except PySparkException as exc:
        # PySpark 4.0 refuses to replace a data source Spark found by itself,
        # which is ours (the pyspark_dilation shim): registered already.
        if exc.getCondition() != "DATA_SOURCE_ALREADY_EXISTS":
            raise
        log.info("the dilation data source was registered already: %s", exc.getCondition())
    return DilationDataSource.name()
