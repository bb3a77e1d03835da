"""``tune(spark)``: the Spark settings that make a dilation write cheaper.

Spark hands a Python data source writer its rows as Arrow batches, and it
caps each batch's bytes (``spark.sql.execution.arrow.maxBytesPerBatch``,
SPARK-51316; 64 MB by default in Spark 4.3). To do that it measures the
batch after every row it adds: on the slow-link benchmark's 10M rows that cost the
sending JVM 5 to 6 of its 28 CPU-s, on cores the transfer needs
(``docs/transfer.md``, "On a slow link"). Spark skips the check when the
cap is ``2147483647``; batches stay at ``maxRecordsPerBatch`` rows (10,000
by default), so no batch gets near Arrow's 2 GB limit unless a row is
200 KB. (Batches of 100,000 rows saved the sender a little more but did
not shorten the benchmark, so ``maxRecordsPerBatch`` is left alone.)

A data source cannot set this itself: Spark reads it from the session
when the write job starts, and a data source's code runs in Python workers
that have no session. So this is one explicit line, and it only sets what
the session has not set: a user's own value always wins.
"""

from __future__ import annotations

from typing import Any

# The cap value Spark treats as "no cap" (BatchedPythonArrowInput compares
# against Int.MaxValue and then skips the per-row size check).
NO_BYTE_CAP = str(2**31 - 1)

SETTINGS: dict[str, str] = {"spark.sql.execution.arrow.maxBytesPerBatch": NO_BYTE_CAP}


def tune(spark: Any) -> dict[str, str]:
    """Set :data:`SETTINGS` on ``spark`` where the session has no value; return what it set.

    Works on classic and Spark Connect sessions (``tests/test_spark_connect.py``).
    Session-wide, like any ``spark.conf.set``: pandas UDFs and ``mapInArrow``
    lose the byte cap too. Calling it again sets nothing.
    """
    changed = {}
    for key, value in SETTINGS.items():
        if spark.conf.get(key, None) is None:
            spark.conf.set(key, value)
            changed[key] = value
    return changed
