"""`spark-dilation demo` is what `make demo` runs: it must keep working."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

CLI = Path(sys.executable).parent / "spark-dilation"


def run_demo(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(CLI), "demo", *args], capture_output=True, text=True, timeout=600, check=False
    )


def test_demo_without_spark_exchanges_a_text_and_a_file():
    result = run_demo("--no-spark")
    assert result.returncode == 0, result.stderr
    assert "'hello from spark-dilation'" in result.stdout
    assert re.search(
        r"\[2/3\] file sales\.parquet \([\d,]+ bytes\) .* SHA-256 verified", result.stdout
    )
    assert "demo: OK" in result.stdout


def test_demo_moves_a_dataset_between_two_spark_applications():
    # Fewer rows than `make demo` (hidden --rows) keep the suite quick.
    result = run_demo("--rows", "20000")
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    out = result.stdout
    assert "[3/3] Spark -> Spark: 20,000 rows" in out, out
    summary = re.search(
        r"rows (?P<rows>[\d,]+) \| bytes (?P<bytes>[\d,]+) \([\d.,]+ MB\) \| [\d.]+ s \| "
        r"[\d,]+ rows/s\n\s+path (?P<path>direct|relay|direct\+relay) \| "
        r"connections (?P<conns>\d+) \| reconnects (?P<reconnects>\d+) \| "
        r"4 partitions over 2 lanes",
        out,
    )
    assert summary, out
    assert summary["rows"] == "20,000"
    assert int(summary["bytes"].replace(",", "")) > 20_000
    # One sending Python worker per concurrent task, each with a connection per lane it used.
    assert 1 <= int(summary["conns"]) <= 8
    assert summary["reconnects"] == "0"
    assert "content verified: count, schema and row digest equal on both sides" in out
    assert re.search(r"demo: OK \(\d+ s\)", out), out
    # Spark's chatter went to the log files, not the terminal.
    assert "WARN" not in result.stderr and "Traceback" not in result.stderr, result.stderr[-3000:]


def test_the_row_digest_sees_every_difference_but_not_the_order(spark):
    from spark_dilation.testing.spark_peer import digest, generate

    df = generate(spark, 2_000, 4, "rich")
    same = digest(df)
    assert same == digest(df.orderBy("id", ascending=False).repartition(3))
    assert same[0] == "2000"
    # One value changed, one row missing, a NULL moved between columns of one type.
    assert digest(df.selectExpr("*", "id = 7 AS seven").selectExpr(
        "id", "CASE WHEN seven THEN i + 1 ELSE i END AS i",
        *[c for c in df.columns if c not in ("id", "i")],
    )) != same  # fmt: skip
    assert digest(df.where("id != 7")) != same
    pair = spark.createDataFrame([(None, 1), (2, 3)], "a INT, b INT")
    swapped = spark.createDataFrame([(1, None), (2, 3)], "a INT, b INT")
    assert digest(pair) != digest(swapped)
