"""Which PySpark this run tests: a supported one, and the one the run asked for.

``make test-oldest`` sets ``SPARK_DILATION_EXPECT_PYSPARK=4.0`` for its smoke
run in a second venv; this test fails if that run imported another PySpark
(a resolver that upgraded it would otherwise pass silently on the newest).
"""

from __future__ import annotations

import os

from spark_dilation.spark.register import check_pyspark


def test_running_pyspark_is_supported_and_expected() -> None:
    import pyspark

    version = pyspark.__version__
    print(f"PySpark {version} from {os.path.dirname(pyspark.__file__)}")
    check_pyspark(version)
    expected = os.environ.get("SPARK_DILATION_EXPECT_PYSPARK")
    if expected:
        assert version.startswith(expected + "."), (
            f"this run was to test PySpark {expected}.x but imported PySpark {version}"
        )
