"""Shared fixtures: the real wormhole servers and one SparkSession per test process."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from spark_dilation.testing import jvm_archive

pytest_plugins = [
    "spark_dilation.testing.fixtures",
    "spark_dilation.testing.leftovers",
    "spark_dilation.testing.live_failures",
    "spark_dilation.testing.cputime",
    "spark_dilation.testing.xdist_groups",
]

# With no relay given, a transfer also dials the public transit relay (the
# default). Tests run offline: those that want a relay pass their own
# (the relay_url fixture); the rest, and every process they start (CLI, Spark
# workers), get none. tests/test_cli_habits.py unsets it to test the default.
os.environ["SPARK_DILATION_RELAY"] = "none"
# A developer's own settings (a default mailbox, a streams home, a default file
# system, fault points) do not reach the tests: each test sets what it needs.
for _setting in (
    "SPARK_DILATION_MAILBOX",
    "SPARK_DILATION_HOME",
    "SPARK_DILATION_DEFAULT_FS",
    "SPARK_DILATION_FAULTS",
    "SPARK_DILATION_FAULT_GROUP",
):
    os.environ.pop(_setting, None)

# Every JVM of the run (Spark drivers, executors, Connect servers) is short-lived
# and small: jvm_archive.BASE cuts its start-up CPU, and the class-data archive
# `make test` builds (jvm_archive) about halves it again; that CPU is what a 2-core
# machine running the suite on several workers runs out of. Each JVM notes
# "Picked up JAVA_TOOL_OPTIONS" on its stderr.
if "JAVA_TOOL_OPTIONS" not in os.environ:  # set once, by the controller
    _archive_dir = os.environ.get(jvm_archive.ENV)
    _archive = jvm_archive.archive_path(Path(_archive_dir)) if _archive_dir else None
    os.environ["JAVA_TOOL_OPTIONS"] = f"{jvm_archive.BASE} {jvm_archive.java_options(_archive)}"

# `make check` runs the tests marked neither way: no Spark, no server processes,
# no processes of their own. A test is "integration" if it uses one of these
# fixtures, lives in one of these modules (all of their tests start CLIs,
# servers, Spark applications, namespace machines or the reference peer), or is
# marked so itself (a module of mostly pure tests marks the ones that start processes).
INTEGRATION_FIXTURES = frozenset(
    {"spark", "net_clusters", "wormhole_servers", "mailbox_url", "relay_url", "fresh_servers"}
)
INTEGRATION_MODULES = frozenset(
    {
        "test_cancel",
        "test_cli",
        "test_cli_progress_reconnect",
        "test_demo",
        "test_dilation_interop",
        "test_dilation_redial",
        "test_flaky_mailbox",
        "test_multimachine",
        "test_netcluster",
        "test_notebook_api",
        "test_notebooks",
        "test_sender_host",
        "test_spark_faults",
        "test_spark_stream",
        "test_spark_transfer",
        "test_spark_tuning",
        "test_transit_interop",
    }
)


_archive_build: Any = None


def pytest_configure(config: pytest.Config) -> None:
    """The controller builds the JVM archive while the first tests run (if missing)."""
    global _archive_build
    folder = os.environ.get(jvm_archive.ENV)
    if folder and not hasattr(config, "workerinput"):
        _archive_build = jvm_archive.start_build(Path(folder))


def pytest_unconfigure(config: pytest.Config) -> None:
    if _archive_build is not None and _archive_build.poll() is None:
        # A run shorter than the build: it and its JVM go (no half archive is kept).
        os.killpg(_archive_build.pid, signal.SIGKILL)
        _archive_build.wait()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        module = item.module.__name__.rsplit(".", 1)[-1] if item.module else ""
        if module in INTEGRATION_MODULES or INTEGRATION_FIXTURES & set(item.fixturenames):
            item.add_marker(pytest.mark.integration)


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
        _stop_with_jvm(session)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _stop_with_jvm(session: Any) -> None:
    """Stop the session and its JVM: the JVM outlives ``stop()`` until this process
    exits, which would be after the leftover check of a run without xdist."""
    from pyspark import SparkContext

    gateway = SparkContext._gateway
    session.stop()
    if gateway is None:
        return
    proc = getattr(gateway, "proc", None)
    gateway.shutdown()
    SparkContext._gateway = None
    SparkContext._jvm = None
    if proc is not None:
        proc.stdin.close()  # the JVM exits at EOF on its stdin
        proc.wait(timeout=60)


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
        clusters.close()  # raises if anything of the run is left (NetClusters.leftovers)
    # What tests/test_netcluster.py checks of a start, checked of the end: the logs a
    # failure needs were kept before the run folder went.
    assert (clusters.log_dir / "executors" / "a1").is_dir(), "executor logs were not collected"
