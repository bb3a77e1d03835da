"""Makes ``spark.read.format("dilation")`` work with no ``spark.dataSource.register`` call.

When a session first needs a Python data source, Spark runs
``pyspark.sql.worker.lookup_data_sources`` in a Python worker: it imports every
top-level module whose name starts with ``pyspark_`` (``pkgutil.iter_modules``
over the worker's ``sys.path``) and registers each ``DefaultSource`` subclass of
``DataSource`` under its ``name()``. Keep this module to the check and the import below.
"""

from spark_dilation.spark.register import check_pyspark

check_pyspark()  # PySpark is an extra: one line if it is missing or older than 4.0

from spark_dilation.spark.datasource import DilationDataSource as DefaultSource  # noqa: E402

__all__ = ["DefaultSource"]
