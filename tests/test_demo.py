"""`spark-dilation demo` is what `make demo` runs: it must keep working."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

CLI = Path(sys.executable).parent / "spark-dilation"


def run_demo(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(CLI), "demo", *args], capture_output=True, text=True, timeout=300, check=False
    )


def test_demo_without_spark_exchanges_a_text():
    result = run_demo("--no-spark")
    assert result.returncode == 0, result.stderr
    assert "'hello from spark-dilation'" in result.stdout
    assert "demo: OK" in result.stdout


def test_demo_sends_a_parquet_file_into_spark():
    result = run_demo()
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Spark loaded 100000 rows from the code alone; content verified." in result.stdout
    assert "Traceback" not in result.stderr
