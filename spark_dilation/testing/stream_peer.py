"""One side of a Spark-to-Spark stream, as its own Spark application (tests, benchmarks).

::

    python -m spark_dilation.testing.stream_peer generate --rows N --files K --out SRC
    python -m spark_dilation.testing.stream_peer send --code C --mailbox URL --source SRC \\
        --checkpoint CK --pairing DIR [--relay URL]
    python -m spark_dilation.testing.stream_peer receive --code C --mailbox URL --out OUT \\
        --checkpoint CK --pairing DIR --rows N [--relay URL]

``generate`` writes N rows of every common Spark type (event time, nested
columns; :data:`~.spark_peer.RICH_COLUMNS`) as K Parquet files. ``send``
streams them, a file per micro-batch, into ``writeStream.format("dilation")``
with Trigger.AvailableNow, and ends when every file is sent (staged on the
receiving side). ``receive`` streams ``readStream.format("dilation")`` into
Parquet files (Spark's file sink, exactly once by its own log) until OUT holds
N rows. Either may be killed and run again with the same arguments: each
resumes from its checkpoint and pairing, with no new code. Each prints one
JSON line: ``{"side": ..., "rows": ..., "digest": [...]}``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from .spark_peer import RICH_COLUMNS, digest, session


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("side", choices=["generate", "send", "receive"])
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
    spark = session(a.master, f"stream-{a.side}")
    try:
        result = {"generate": generate, "send": send, "receive": receive}[a.side](spark, a)
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
) -> Any:
    """Stream the Parquet files in ``source`` into ``writeStream.format("dilation")``
    with Trigger.AvailableNow; the ended query (raises on a timeout or its error).
    ``schema``: the files' Spark schema if known (else read from them)."""
    if schema is None:
        schema = spark.read.parquet(source).schema
    stream = spark.readStream.schema(schema).option("maxFilesPerTrigger", max_files)
    query = (
        stream.parquet(source)
        .writeStream.format("dilation")
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


def send(spark: Any, a: argparse.Namespace) -> dict[str, Any]:
    query = send_files(spark, a.source, _options(a), a.checkpoint, max_files=1, timeout=a.timeout)
    return {
        "side": "send",
        "batches": int(query.lastProgress["batchId"]) + 1 if query.lastProgress else 0,
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
