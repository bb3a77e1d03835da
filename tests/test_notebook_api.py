"""spark_dilation.send / receive, the notebook API, against the real servers."""

from __future__ import annotations

import re
import threading

import pyarrow as pa
import pytest

import spark_dilation
from spark_dilation.errors import TransferCancelledError, WrongCodeError

WAIT = 240  # generous: the tests fail on a hang, not on a slow machine


def sample(rows: int = 5_000) -> pa.Table:
    return pa.table(
        {
            "id": pa.array(range(rows), pa.int64()),
            "name": pa.array([f"row {i}" if i % 7 else None for i in range(rows)], pa.string()),
            "score": pa.array([i / 3 for i in range(rows)], pa.float64()),
        }
    )


def rows_of(table: pa.Table) -> list[dict]:
    return sorted(table.to_pylist(), key=lambda r: r["id"])


def test_a_table_reaches_a_python_receiver_exactly(mailbox_url, relay_url):
    table = sample()
    handle = spark_dilation.send(table, mailbox=mailbox_url, relay=relay_url)
    assert re.fullmatch(r"\d+-\w+-\w+", handle.code)
    assert handle.progress.state == "waiting for the receiver"
    assert handle.progress.total_rows == table.num_rows
    assert handle.code in handle._repr_html_()

    got = spark_dilation.receive(None, handle.code, mailbox=mailbox_url, relay=relay_url)
    report = handle.wait(WAIT)

    assert handle.done
    assert got.schema == table.schema
    assert got.equals(table) or rows_of(got) == rows_of(table)
    assert report.rows == table.num_rows
    done = handle.progress
    assert (done.state, done.rows, done.fraction) == ("done", table.num_rows, 1.0)
    assert "<progress" in handle._repr_html_()


def test_a_table_reaches_a_spark_receiver_with_its_content(spark, mailbox_url, relay_url):
    table = sample(3_000)
    handle = spark_dilation.send(table, mailbox=mailbox_url, relay=relay_url)
    df = spark_dilation.receive(spark, handle.code, mailbox=mailbox_url, relay=relay_url)
    got = df.toArrow()
    handle.wait(WAIT)
    assert df.columns == ["id", "name", "score"]
    assert rows_of(got) == rows_of(table)


def test_a_spark_dataframe_reaches_a_python_receiver_exactly(spark, mailbox_url, relay_url):
    df = spark.range(0, 4_000, numPartitions=3).selectExpr(
        "id", "CASE WHEN id % 5 = 0 THEN NULL ELSE concat('n', id) END AS name", "id / 4 AS q"
    )
    expected = df.toArrow()
    # No code given: one is made up here, since the Spark writer needs it up front.
    handle = spark_dilation.send(df, mailbox=mailbox_url, relay=relay_url)
    assert re.fullmatch(r"\d{4,6}-\w+-\w+", handle.code)
    assert handle.kind == "spark"

    got = spark_dilation.receive(None, handle.code, mailbox=mailbox_url, relay=relay_url)
    assert handle.wait(WAIT) is None  # the report is in the Spark driver's log
    assert handle.progress.state == "done" and handle.progress.rows is None
    assert got.schema.names == expected.schema.names
    assert rows_of(got) == rows_of(expected)


def test_cancelling_a_send_nobody_received_ends_it_with_a_clear_error(mailbox_url):
    handle = spark_dilation.send(sample(10), mailbox=mailbox_url)
    assert not handle.done
    handle.cancel()
    with pytest.raises(TransferCancelledError, match=f"code {handle.code} was cancelled"):
        handle.wait(WAIT)
    assert handle.done and handle.progress.state == "cancelled"
    handle.cancel()  # again: nothing happens


def test_wait_reraises_a_wrong_code_readably(mailbox_url, relay_url):
    handle = spark_dilation.send(sample(10), mailbox=mailbox_url, relay=relay_url)
    nameplate = handle.code.split("-", 1)[0]
    wrong = f"{nameplate}-aardvark-adroitness"
    assert wrong != handle.code
    receiver_error: list[BaseException] = []

    def receive() -> None:
        try:
            spark_dilation.receive(None, wrong, mailbox=mailbox_url, relay=relay_url)
        except BaseException as e:
            receiver_error.append(e)

    t = threading.Thread(target=receive)
    t.start()
    with pytest.raises(WrongCodeError, match="the code was mistyped"):
        handle.wait(WAIT)
    t.join(WAIT)
    assert isinstance(receiver_error[0], WrongCodeError)
    assert handle.progress.state == "failed"


def test_cancelling_a_spark_send_nobody_received_ends_it(spark, mailbox_url):
    # The writer waits for its receiver inside Spark's planning, out of
    # interruptTag's reach: cancel refuses the offer over the send's own code.
    handle = spark_dilation.send(spark.range(10), mailbox=mailbox_url)
    handle.cancel()
    with pytest.raises(TransferCancelledError, match=f"code {handle.code} was cancelled") as e:
        handle.wait(WAIT)
    assert "the sender cancelled the send" in str(e.value.__cause__)
    assert handle.progress.state == "cancelled"
