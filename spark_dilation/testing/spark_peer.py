"""One side of a Spark-to-Spark dataset transfer, as its own Spark application.

A transfer between two Spark applications needs two processes; tests, the
demo and the benchmark start this module twice with ``subprocess``::

    python -m spark_dilation.testing.spark_peer send    --code C --mailbox URL --rows N ...
    python -m spark_dilation.testing.spark_peer receive --code C --mailbox URL --out DIR ...

``send`` generates a deterministic dataset of every common Spark type (or
the benchmark's three columns with ``--shape bench``), optionally writes it
to ``--expected DIR`` as Parquet, and writes it with
``format("dilation")``. ``receive`` loads it, runs ``show()`` then
``count()``, and writes it to ``--out DIR`` as Parquet. With ``--digest``
each side also computes an order-independent digest of every row (see
:func:`digest`), so two processes can compare content without moving it
again. Each side prints one JSON line to stdout with what it did
(``{"side": ..., "rows": ..., ...}``).
"""

from __future__ import annotations

import argparse
import json
import os
import stat
import sys
import time
from typing import Any

RICH_COLUMNS = (
    "id",
    "CAST(id % 2147483647 AS INT) AS i",
    "CASE WHEN id % 11 = 0 THEN NULL ELSE id * 1.5 END AS d",
    "CAST(id / 7 AS DECIMAL(18, 4)) AS dec",
    "CASE WHEN id % 13 = 0 THEN NULL ELSE concat('s-', CAST(id AS STRING)) END AS s",
    "CAST(concat('b', CAST(id % 100 AS STRING)) AS BINARY) AS bin",
    "id % 3 = 0 AS flag",
    "date_add(DATE'2020-01-01', CAST(id % 1000 AS INT)) AS dt",
    "timestamp_micros(1600000000000000 + id * 1000) AS ts",
    "named_struct('a', id, 'b', CASE WHEN id % 5 = 0 THEN NULL ELSE CAST(id AS STRING) END) AS st",
    "CASE WHEN id % 17 = 0 THEN NULL ELSE array(id, id + 1) END AS arr",
    "map('k', id, 'j', id * 2) AS m",
)
BENCH_COLUMNS = (
    "id",
    "CAST(id AS DOUBLE) * 0.5 AS x",
    "substr(sha2(CAST(id AS STRING), 256), 1, 16) AS s",
)
# The slow-link benchmark's data: x random, as users' measurements are (the
# entropy, about 16 of 36 raw bytes a row, decides what compression can do).
LINK_COLUMNS = (
    "id",
    "rand(42) AS x",
    "substr(sha2(CAST(id AS STRING), 256), 1, 16) AS s",
)
SHAPES = {"rich": RICH_COLUMNS, "bench": BENCH_COLUMNS, "link": LINK_COLUMNS}


def _await_forwarded_report(timeout: float = 15.0) -> None:
    """Wait until the transfer report reached our stderr (when it is a file).

    ``commit()`` logs the report in a Python worker; the JVM copies that
    worker's stderr to ours on a thread of its own, which may not have run
    when ``save()`` returns. Stopping the application then would lose it.
    """
    from spark_dilation.spark.dataset import REPORT_PREFIX

    try:
        if not stat.S_ISREG(os.fstat(2).st_mode):
            return
    except OSError:
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open("/proc/self/fd/2", errors="replace") as ours:  # a fresh offset
            if REPORT_PREFIX in ours.read():
                return
        time.sleep(0.1)


def session(
    master: str, name: str, extra: dict[str, str] | None = None, remote: str | None = None
) -> Any:
    """A classic session on ``master``, or a Spark Connect one with ``remote``.

    ``remote="local[2]"`` starts a local Spark Connect server (a child JVM)
    and returns a thin client: no ``SparkContext``; the data source is
    registered with the explicit :func:`spark_dilation.register` line.
    """
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)  # the Connect server inherits it
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    from pyspark.sql import SparkSession

    if remote is not None:
        builder = SparkSession.builder.remote(remote).appName(name)
        for key, value in {"spark.sql.session.timeZone": "UTC", **(extra or {})}.items():
            builder = builder.config(key, value)
        spark = builder.getOrCreate()
        import spark_dilation

        spark_dilation.register(spark)
        return spark

    builder = (
        SparkSession.builder.master(master)
        .appName(name)
        .config("spark.ui.enabled", "false")
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.sql.shuffle.partitions", "4")
    )
    for key, value in (extra or {}).items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("WARN")
    return spark


def generate(spark: Any, rows: int, partitions: int, shape: str) -> Any:
    columns = SHAPES[shape]
    return spark.range(0, rows, numPartitions=partitions).selectExpr(*columns)


def digest(df: Any) -> list[str]:
    """Row count and two sums of 64-bit row hashes: equal for equal rows in any order.

    Each row hashes every column and its null flag (``xxhash64`` skips nulls,
    so the flag tells ``(NULL, 1)`` from ``(1, NULL)``); maps hash as their
    sorted entries (Spark refuses to hash maps). The sums are decimals, so
    they cannot overflow.
    """
    from pyspark.sql import functions as F
    from pyspark.sql.types import MapType

    columns = []
    for f in df.schema.fields:
        c = F.col(f"`{f.name}`")
        columns += [F.array_sort(F.map_entries(c)) if isinstance(f.dataType, MapType) else c]
        columns += [F.isnull(c)]
    h1 = F.xxhash64(*columns).cast("decimal(38,0)")
    h2 = F.xxhash64(F.lit("spark-dilation"), *columns).cast("decimal(38,0)")
    row = df.agg(F.count(F.lit(1)), F.sum(h1), F.sum(h2)).first()
    return [str(v) for v in row]


def wait_for_executors(spark: Any, count: int, timeout: float = 120.0) -> None:
    """Block until ``count`` executors (not counting the driver) have registered."""
    deadline = time.monotonic() + timeout
    while True:
        # The block managers of the executors and of the driver.
        registered = spark.sparkContext._jsc.sc().getExecutorMemoryStatus().size() - 1
        if registered >= count:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"only {registered} of {count} executors registered in {timeout} s")
        time.sleep(0.2)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("side", choices=["send", "receive"])
    p.add_argument("--code", required=True)
    p.add_argument("--mailbox", required=True)
    p.add_argument("--relay")
    p.add_argument("--master", default="local[2]")
    p.add_argument("--remote", help="a Spark Connect session instead, e.g. local[2] or sc://host")
    p.add_argument(
        "--probe-option",
        metavar="KEY=VALUE",
        help="first run a load with this (bad) option and report its error as probe_error",
    )
    p.add_argument("--rows", type=int, default=1000)
    p.add_argument("--partitions", type=int, default=4)
    p.add_argument("--shape", choices=sorted(SHAPES), default="rich")
    p.add_argument("--expected", help="send: also write the data here as Parquet")
    p.add_argument("--out", help="receive: write what arrived here as Parquet")
    p.add_argument("--no-show", action="store_true", help="receive: skip show() before count()")
    p.add_argument("--digest", action="store_true", help="both: digest every row (see digest())")
    p.add_argument("--option", action="append", default=[], help="KEY=VALUE for format(dilation)")
    p.add_argument("--conf", action="append", default=[], help="KEY=VALUE for the SparkSession")
    p.add_argument(
        "--executors", type=int, default=0,
        help="wait (up to 120 s) until this many executors have registered, so a "
        "local-cluster's tasks run on all of them",
    )  # fmt: skip
    p.add_argument(
        "--register", action="store_true",
        help="register the source first (spark_dilation.register): the session's one-time "
        "data source lookup then happens before t0, as for a sink registered by hand",
    )  # fmt: skip
    p.add_argument(
        "--tune", action="store_true",
        help="spark_dilation.tune(spark) after the session starts (the recommended settings)",
    )  # fmt: skip
    args = p.parse_args(argv)

    options = dict(o.split("=", 1) for o in args.option)
    options.update(code=args.code, mailbox=args.mailbox)
    if args.relay:
        options["relay"] = args.relay
    conf = dict(c.split("=", 1) for c in args.conf)
    spark = session(args.master, f"spark-dilation-{args.side}", conf, remote=args.remote)
    if args.executors:
        wait_for_executors(spark, args.executors)
    if args.register:
        from spark_dilation import register

        register(spark)
    result: dict[str, Any] = {"side": args.side, "session": type(spark).__module__}
    if args.tune:
        from spark_dilation import tune

        result["tuned"] = tune(spark)
    started = time.monotonic()
    if args.probe_option:
        key, value = args.probe_option.split("=", 1)
        try:
            spark.read.format("dilation").options(**{**options, key: value}).load().count()
            result["probe_error"] = None
        except Exception as e:
            result["probe_error"] = f"{type(e).__name__}: {e}"[:2000]
    try:
        if args.side == "send":
            df = generate(spark, args.rows, args.partitions, args.shape)
            result["schema"] = df.schema.json()
            if args.expected:
                df.write.mode("overwrite").parquet(args.expected)
            if args.digest:
                result["digest"] = digest(df)
            started = time.monotonic()
            result["t0"] = time.time()
            df.write.format("dilation").options(**options).mode("append").save()
            result["t1"] = time.time()
            if not (args.remote or "").startswith("sc://"):  # a remote server logs it in its log
                _await_forwarded_report()
            result["rows"] = args.rows
        else:
            result["t0"] = time.time()
            df = spark.read.format("dilation").options(**options).load()
            result["t_loaded"] = time.time()  # the session is agreed (schema() returned)
            result["schema"] = df.schema.json()
            if not args.no_show:
                df.show(3, truncate=40)
            result["count"] = df.count()
            result["t1"] = time.time()
            if args.digest:
                result["digest"] = digest(df)
            if args.out:
                df.write.mode("overwrite").parquet(args.out)
            result["rows"] = result["count"]
    except Exception as e:  # one line for the caller; the traceback went to stderr
        result["error"] = f"{type(e).__name__}: {e}"[:4000]
        print(json.dumps(result), flush=True)
        return 1
    finally:
        result["seconds"] = round(time.monotonic() - started, 3)
    print(json.dumps(result), flush=True)
    spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
