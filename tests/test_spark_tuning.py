"""``spark_dilation.tune(spark)``: sets Spark's Arrow batch byte cap, never over a user's."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

import spark_dilation
from spark_dilation.spark.tuning import NO_BYTE_CAP, SETTINGS

BYTES = "spark.sql.execution.arrow.maxBytesPerBatch"
RECORDS = "spark.sql.execution.arrow.maxRecordsPerBatch"


@pytest.fixture
def session(spark: Any) -> Iterator[Any]:
    """The shared session with neither setting, and as it was afterwards."""
    saved = {key: spark.conf.get(key, None) for key in (*SETTINGS, RECORDS)}
    for key in saved:
        spark.conf.unset(key)
    try:
        yield spark
    finally:
        for key, value in saved.items():
            if value is None:
                spark.conf.unset(key)
            else:
                spark.conf.set(key, value)


def test_tune_sets_what_the_session_lacks_and_says_so(session: Any) -> None:
    assert spark_dilation.tune(session) == {BYTES: NO_BYTE_CAP}
    assert session.conf.get(BYTES) == "2147483647"
    # Spark's own reading of it: the per-row size check is skipped only at Int.MaxValue.
    jconf = session._jvm.org.apache.spark.sql.internal.SQLConf.get()
    assert jconf.arrowMaxBytesPerBatch() == 2**31 - 1
    assert session.conf.get(RECORDS, None) is None  # the batch rows stay Spark's
    assert spark_dilation.tune(session) == {}  # again: nothing left to set


def test_tune_keeps_the_users_own_value(session: Any) -> None:
    session.conf.set(BYTES, "32m")
    assert spark_dilation.tune(session) == {}
    assert session.conf.get(BYTES) == "32m"
