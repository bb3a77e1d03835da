"""Makes ``spark.read.format("dilation")`` work with no ``spark.dataSource.register`` call.

When a session first needs a Python data source, Spark runs
``pyspark.sql.worker.lookup_data_sources`` in a Python worker: it imports every
top-level module whose name starts with ``pyspark_`` (``pkgutil.iter_modules``
over the worker's ``sys.path``) and registers each ``DefaultSource`` subclass of
``DataSource`` under its ``name()``. Keep this module to the import below.
"""

from spark_dilation.spark.datasource import DilationDataSource as DefaultSource

__all__ = ["DefaultSource"]
