"""One side of a Spark-to-Spark stream, as its own Spark application (tests, benchmarks).

::

    python -m spark_dilation.testing.stream_peer generate --rows N --files K --out SRC
    python -m spark_dilation.testing.stream_peer send --code C --mailbox URL --source SRC \\
        --checkpoint CK --pairing DIR [--relay URL] [--rows N --files K]
    python -m spark_dilation.testing.stream_peer receive --code C --mailbox URL --out OUT \\
        --checkpoint CK --pairing DIR --rows N [--relay URL]
    python -m spark_dilation.testing.stream_peer send-changed --source SRC --checkpoint CK \\
        --pairing DIR
    python -m spark_dilation.testing.stream_peer guide-send --code C --mailbox URL \\
        --rows N --files K --checkpoint ROOT --pairing DIR
    python -m spark_dilation.testing.stream_peer guide-receive --code C --mailbox URL \\
        --out OUT --checkpoint ROOT --pairing DIR --rows N --first-rows N1

``generate`` writes N rows of every common Spark type (event time, nested
columns; :data:`~.spark_peer.RICH_COLUMNS`) as K Parquet files. ``send``
(with ``--rows``, after it generated SRC in its own session unless SRC exists:
no application of its own for the input) streams them, a file per micro-batch,
into ``writeStream.format("dilation")``
with Trigger.AvailableNow, and ends when every file is sent (staged on the
receiving side). ``receive`` streams ``readStream.format("dilation")`` into
Parquet files (Spark's file sink, exactly once by its own log) until OUT holds
N rows. Either may be killed and run again with the same arguments: each
resumes from its checkpoint and pairing, with no new code. ``send-changed``
starts two sending queries on an existing pairing whose columns differ from
the paired ones (one renamed, one added) and reports how each ended.
``guide-send`` and ``guide-receive`` use the sink and the source as Spark's
Structured Streaming guide shows them (:func:`guide_send`, :func:`guide_receive`).
Each prints one JSON line: ``{"side": ..., "rows": ..., "digest": [...]}``.

The application makes its process group the one fault points kill
(:mod:`spark_dilation.spark.faults`): with ``SPARK_DILATION_FAULTS`` set, a
test stops it dead at a chosen step of Spark's batch phases.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from ..spark.faults import GROUP_ENV
from .spark_peer import RICH_COLUMNS, digest, session


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "side",
        choices=["generate", "send", "receive", "send-changed", "guide-send", "guide-receive"],
    )
    p.add_argument("--first-rows", type=int, default=0, help="guide-receive: rows of part 1")
    p.add_argument(
        "--sync",
        help="guide-*: a folder where the receiving side says its first query stopped; the "
        "sending side adds its second half of files only then",
    )
    p.add_argument("--code", default="")
    p.add_argument("--mailbox", default="")
    p.add_argument("--relay")
    p.add_argument("--rows", type=int, default=0)
    p.add_argument("--files", type=int, default=8)
    p.add_argument("--source")
    p.add_argument("--out")
    p.add_argument("--checkpoint")
    p.add_argument("--pairing")
    p.add_argument("--master", default="local[2]")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--max-rows", type=int, help="receive: option maxRecordsPerTrigger")
    p.add_argument(
        "--available-now", action="store_true", help="receive: Trigger.AvailableNow, then end"
    )
    p.add_argument("--trigger-seconds", type=float, default=0.2, help="receive: trigger interval")
    p.add_argument(
        "--stop-when-staged",
        type=int,
        help="receive: stop once the stream's ledger staged this many sent batches and a "
        "trigger's progress showed a lag (whatever was read by then)",
    )
    a = p.parse_args(argv)
    os.environ.setdefault(GROUP_ENV, str(os.getpgrp()))  # before the JVM: its workers inherit it
    spark = session(a.master, f"stream-{a.side}")
    sides = {
        "generate": generate,
        "send": send,
        "receive": receive,
        "send-changed": send_changed,
        "guide-send": guide_send,
        "guide-receive": guide_receive,
    }
    try:
        result = sides[a.side](spark, a)
    except Exception as e:  # one line for the test to read; Spark's own log has the rest
        result = {"side": a.side, "error": f"{type(e).__name__}: {e}"}
    print(json.dumps(result), flush=True)
    spark.stop()
    return 0 if "error" not in result else 1


def generate(spark: Any, a: argparse.Namespace) -> dict[str, Any]:
    df = spark.range(0, a.rows, numPartitions=a.files).selectExpr(*RICH_COLUMNS)
    df.write.mode("overwrite").parquet(a.out)
    return {"side": "generate", "rows": a.rows, "digest": digest(spark.read.parquet(a.out))}


def _options(a: argparse.Namespace) -> dict[str, str]:
    opts = {"code": a.code, "mailbox": a.mailbox, "pairing_dir": a.pairing}
    if a.relay:
        opts["relay"] = a.relay
    return opts


def send_files(
    spark: Any,
    source: str,
    options: dict[str, str],
    checkpoint: str,
    *,
    max_files: int,
    timeout: float,
    schema: Any = None,
    change: Any = None,
) -> Any:
    """Stream the Parquet files in ``source`` into ``writeStream.format("dilation")``
    with Trigger.AvailableNow; the ended query (raises on a timeout or its error).
    ``schema``: the files' Spark schema if known (else read from them); ``change``: a
    function of the streaming DataFrame applied before it is written."""
    if schema is None:
        schema = spark.read.parquet(source).schema
    stream = spark.readStream.schema(schema).option("maxFilesPerTrigger", max_files)
    frame = stream.parquet(source)
    if change is not None:
        frame = change(frame)
    query = (
        frame.writeStream.format("dilation")
        .options(**options)
        .option("checkpointLocation", checkpoint)
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination(timeout)
    if query.isActive:
        query.stop()
        raise TimeoutError(f"the sending query did not finish within {timeout:g} s")
    if query.exception() is not None:
        raise RuntimeError(str(query.exception()))
    return query


def _source(spark: Any, a: argparse.Namespace) -> dict[str, Any]:
    """With ``--rows``: SRC generated unless a run before made it (whole: written beside,
    then renamed); what ``generate`` reports of it. Else nothing."""
    if not a.rows:
        return {}
    made = f"{a.source}.json"
    if not os.path.exists(made):
        partial = f"{a.source}.partial"
        expected = generate(spark, argparse.Namespace(rows=a.rows, files=a.files, out=partial))
        os.rename(partial, a.source)
        with open(f"{made}.partial", "w") as f:
            json.dump(expected, f)
        os.rename(f"{made}.partial", made)
    with open(made) as f:
        return {"expected": json.load(f)}


def send(spark: Any, a: argparse.Namespace) -> dict[str, Any]:
    source = _source(spark, a)
    query = send_files(spark, a.source, _options(a), a.checkpoint, max_files=1, timeout=a.timeout)
    return {
        "side": "send",
        "batches": int(query.lastProgress["batchId"]) + 1 if query.lastProgress else 0,
        **source,
    }


def send_changed(spark: Any, a: argparse.Namespace) -> dict[str, Any]:
    """Two sending queries on the stream's pairing with other columns: each must fail."""
    from pyspark.sql import functions as F

    changes = {
        "renamed": lambda df: df.withColumnRenamed("s", "text"),
        "added": lambda df: df.withColumn("extra", F.lit(1)),
    }
    errors = {}
    for name, change in changes.items():
        try:
            send_files(
                spark,
                a.source,
                _options(a),
                f"{a.checkpoint}-{name}",
                max_files=1,
                timeout=a.timeout,
                change=change,
            )
            errors[name] = ""
        except Exception as e:
            errors[name] = str(e)
    return {"side": "send-changed", "errors": errors}


def _failure(start: Any) -> str:
    """How a query that should not run ended: its error at start or while it ran."""
    try:
        query = start()
        query.awaitTermination(120)
        error = query.exception()
        if query.isActive:
            query.stop()
        return "" if error is None else str(error)
    except Exception as e:
        return str(e)


def guide_send(spark: Any, a: argparse.Namespace) -> dict[str, Any]:
    """The sink as the guide uses a sink: output modes, a named query whose checkpoint
    comes from ``spark.sql.streaming.checkpointLocation``, Trigger.Once, then the same
    query stopped and started again with a processing-time trigger on new files.

    It writes ``--rows`` rows as ``--files`` Parquet files first (their digest is in
    its result); half of them are streamed first, the rest after the restart."""
    import shutil

    made = f"{a.checkpoint}-generated"
    expected = generate(spark, argparse.Namespace(rows=a.rows, files=a.files, out=made))
    files = sorted(f for f in os.listdir(made) if f.endswith(".parquet"))
    schema = spark.read.parquet(made).schema
    src = f"{a.checkpoint}-input"
    os.makedirs(src, exist_ok=True)
    half = len(files) // 2
    for name in files[:half]:
        shutil.copy(os.path.join(made, name), src)
    events = spark.readStream.schema(schema).option("maxFilesPerTrigger", 1).parquet(src)
    result: dict[str, Any] = {"side": "guide-send", "digest": expected["digest"]}

    def sink(df: Any, mode: str = "append") -> Any:
        return df.writeStream.format("dilation").options(**_options(a)).outputMode(mode)

    counts = events.groupBy("flag").count()
    ck = f"{a.checkpoint}-modes"
    result["complete"] = _failure(
        lambda: sink(counts, "complete").option("checkpointLocation", ck + "c").start()
    )
    result["update"] = _failure(
        lambda: sink(counts, "update").option("checkpointLocation", ck + "u").start()
    )
    spark.conf.set("spark.sql.streaming.checkpointLocation", a.checkpoint)
    query = sink(events).queryName("orders_out").trigger(once=True).start()
    if not query.awaitTermination(a.timeout):
        raise TimeoutError(f"Trigger.Once did not end within {a.timeout:g} s")
    if query.exception() is not None:
        raise RuntimeError(str(query.exception()))
    result["once_batches"] = len(query.recentProgress)
    _wait_file(os.path.join(a.sync, "first-stopped"), a.timeout)  # rows sent after, not before
    for name in files[half:]:
        shutil.copy(os.path.join(made, name), src)
    query = sink(events).queryName("orders_out").trigger(processingTime="1 second").start()
    query.processAllAvailable()
    query.stop()
    if query.exception() is not None:
        raise RuntimeError(str(query.exception()))
    result["batches"] = max(p["batchId"] for p in query.recentProgress) + 1
    return result


def _wait_file(path: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout:g} s")
        time.sleep(0.2)


def guide_receive(spark: Any, a: argparse.Namespace) -> dict[str, Any]:
    """The source as the guide reads a source: a named query whose checkpoint comes from
    ``spark.sql.streaming.checkpointLocation``, ``foreachBatch`` downstream (each batch
    written once by its batch id), stopped and started again; Trigger.Once; a
    continuous trigger (refused)."""
    spark.conf.set("spark.sql.streaming.checkpointLocation", a.checkpoint)
    seen: list[int] = []

    def write_batch(batch: Any, batch_id: int) -> None:
        # The guide's idempotent foreachBatch: a batch run again overwrites itself.
        batch.write.mode("overwrite").parquet(os.path.join(a.out, f"batch={batch_id}"))
        seen.append(batch_id)

    def start(**trigger: Any) -> Any:
        stream = spark.readStream.format("dilation").options(**_options(a)).load()
        writer = stream.writeStream.queryName("orders_in").foreachBatch(write_batch)
        return writer.trigger(**(trigger or {"processingTime": "500 milliseconds"})).start()

    def until(query: Any, rows: int) -> int:
        deadline, got = time.monotonic() + a.timeout, 0
        while time.monotonic() < deadline:
            if query.exception() is not None:
                raise RuntimeError(str(query.exception()))
            if seen:
                got = spark.read.parquet(a.out).count()
                if got >= rows:
                    query.stop()
                    return got
            time.sleep(1.0)
        query.stop()
        raise TimeoutError(f"{got} of {rows} rows after {a.timeout:g} s")

    first = until(start(), a.first_rows)
    with open(os.path.join(a.sync, "first-stopped"), "w"):
        pass  # the sending side adds the rest now: the restarted query reads them
    restarted_from = len(seen)
    until(start(), a.rows)  # the same query again: from its checkpoint, no code needed
    before = len(seen)
    once = start(once=True)
    if not once.awaitTermination(a.timeout):
        raise TimeoutError(f"Trigger.Once did not end within {a.timeout:g} s")
    stream = spark.readStream.format("dilation").options(**_options(a)).load()
    continuous = _failure(
        lambda: stream.writeStream.format("noop").trigger(continuous="1 second").start()
    )
    out = spark.read.parquet(a.out)
    return {
        "side": "guide-receive",
        "first_rows": first,
        "batch_ids": seen,
        "restarted_from": restarted_from,
        "once_batches": len(seen) - before,
        "once_error": str(once.exception() or ""),
        "continuous": continuous,
        "rows": out.count(),
        "distinct_ids": out.select("id").distinct().count(),
        "digest": digest(out.drop("batch")),
    }


def receive(spark: Any, a: argparse.Namespace) -> dict[str, Any]:
    reader = spark.readStream.format("dilation").options(**_options(a))
    if a.max_rows:
        reader = reader.option("maxRecordsPerTrigger", a.max_rows)
    stream = reader.load()
    every = f"{int(a.trigger_seconds * 1000)} milliseconds"
    trigger = {"availableNow": True} if a.available_now else {"processingTime": every}
    query = (
        stream.writeStream.format("parquet")
        .option("path", a.out)
        .option("checkpointLocation", a.checkpoint)
        .trigger(**trigger)
        .start()
    )
    if a.available_now:  # it reads what is staged now, then ends by itself
        if not query.awaitTermination(a.timeout):
            raise TimeoutError(f"Trigger.AvailableNow did not end within {a.timeout:g} s")
        if query.exception() is not None:
            raise RuntimeError(str(query.exception()))
    else:
        _until_enough(spark, query, a)
    largest = max((p["numInputRows"] for p in query.recentProgress), default=0)
    lag = max((_lag(p) for p in query.recentProgress), default=0)
    query.stop()
    out = spark.read.parquet(a.out)
    return {
        "side": "receive",
        "largest_batch": largest,
        "largest_lag": lag,
        "rows": out.count(),
        "distinct_ids": out.select("id").distinct().count(),
        "digest": digest(out),
    }


def _until_enough(spark: Any, query: Any, a: argparse.Namespace) -> None:
    """Until OUT holds ``--rows`` rows, or (``--stop-when-staged``) the ledger staged that
    many sent batches and something was read."""
    deadline = time.monotonic() + a.timeout
    rows = 0
    while time.monotonic() < deadline:
        if query.exception() is not None:
            raise RuntimeError(str(query.exception()))
        read = any(p["numInputRows"] for p in query.recentProgress)
        if a.stop_when_staged is not None:  # cheap looks only: stop as soon as it holds
            behind = any(_lag(p) > 0 for p in query.recentProgress)  # a trigger showed lag
            if read and behind and _staged(a.pairing) >= a.stop_when_staged:
                return
            time.sleep(0.2)
            continue
        if read:
            rows = spark.read.parquet(a.out).count()
            if rows >= a.rows:
                return
        time.sleep(1.0)
    query.stop()
    raise TimeoutError(f"the receiving query had {rows} of {a.rows} rows after {a.timeout:g} s")


def _lag(progress: dict[str, Any]) -> int:
    """Staged sent batches not yet read, as a trigger's progress shows them."""
    source = progress["sources"][0]

    def seq(offset: Any) -> int:
        if isinstance(offset, str):  # JSON on 4.2+; PySpark 4.0 shows other text
            try:
                offset = json.loads(offset)
            except ValueError:
                return 0
        return int(offset["seq"]) if isinstance(offset, dict) and "seq" in offset else 0

    if source.get("latestOffset") is None or source.get("endOffset") is None:
        return 0
    return seq(source["latestOffset"]) - seq(source["endOffset"])


def _staged(pairing: str) -> int:
    """Sent batches the receiving side staged so far (its ledger, written whole)."""
    try:
        with open(os.path.join(pairing, "ledger.json")) as f:
            return int(json.load(f)["next_seq"])
    except (OSError, ValueError, KeyError):
        return 0


if __name__ == "__main__":
    sys.exit(main())
