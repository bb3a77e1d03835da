"""Shared fixtures: the real wormhole servers and one SparkSession per test process."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator

import pytest

pytest_plugins = ["spark_dilation.testing.fixtures"]

# With no relay given, a transfer also dials the public transit relay (the
# default). Tests run offline: those that want a relay pass their own
# (the relay_url fixture); the rest, and every process they start (CLI, Spark
# workers), get none. tests/test_cli_habits.py unsets it to test the default.
os.environ.setdefault("SPARK_DILATION_RELAY", "none")


@pytest.fixture(scope="session")
def spark() -> Iterator:
    """One local[2] SparkSession for the whole run (a cold start takes seconds)."""
    saved = {k: os.environ.get(k) for k in ("PYSPARK_PYTHON", "SPARK_LOCAL_IP")}
    # Workers must run this venv's Python (with spark_dilation installed), and
    # loopback keeps Spark off whatever network the machine has.
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"
    from pyspark.sql import SparkSession

    session = (
        SparkSession.builder.master("local[2]")
        .appName("spark-dilation-tests")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.ui.enabled", "false")
        .config("spark.sql.session.timeZone", "UTC")
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("WARN")
    try:
        yield session
    finally:
        session.stop()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@pytest.fixture
def sides(monkeypatch: pytest.MonkeyPatch) -> Callable[..., None]:
    """``sides(x, y, ...)``: the next Dilation managers get these sides, in order
    (then random ones). The larger side is the Leader."""
    import spark_dilation.dilation.l1 as l1

    def set_sides(*values: str) -> None:
        it: Iterator[str] = iter(values)
        original = l1.make_side
        monkeypatch.setattr(l1, "make_side", lambda: next(it, None) or original())

    return set_sides


@pytest.fixture(scope="session")
def net_clusters(tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    """Two standalone Spark clusters of namespace machines, shared by the multi-machine tests.

    Fails (never skips) where namespaces cannot be made: CI runs as root on Linux.
    """
    from spark_dilation.testing.netcluster import netns_available, start_net_clusters

    ok, reason = netns_available()
    if not ok:
        pytest.fail(f"multi-machine tests need network namespaces: {reason}")
    clusters = start_net_clusters(tmp_path_factory.mktemp("netcluster"))
    try:
        yield clusters
    finally:
        clusters.close()
