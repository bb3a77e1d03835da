"""Spark to Spark between two standalone clusters whose every machine is its own namespace.

Cluster A writes, cluster B reads; each worker has its own address, ``TMPDIR``
and ``SPARK_LOCAL_DIRS`` (:mod:`spark_dilation.testing.netcluster`), no
namespace has a default route, and the clusters meet through the relay only
(or, in the last test, directly). Default options throughout.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from spark_dilation.testing.netcluster import Cluster, Machine, NetClusters
from spark_dilation.testing.stepped_reader import SteppedReader
from spark_dilation.testing.waiting import wait_until

ROWS = 200_000
# Two Spark applications per test on a 2-core machine: more than the suite's default.
# One xdist worker runs every test on the shared namespace clusters (one set of
# clusters per run; their tests go first, being the longest unit).
pytestmark = [
    pytest.mark.timeout(900),
    pytest.mark.xdist_group("net_clusters"),
    pytest.mark.multimachine,
]
PY = sys.executable


def _tail(path: Path, n: int = 60) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-n:]) if path.exists() else ""


def _json_line(log: Path, key: str) -> dict[str, Any] | None:
    for line in reversed(log.read_text(errors="replace").splitlines()):
        if line.startswith("{") and f'"{key}"' in line:
            return json.loads(line)
    return None


def _report(log: Path) -> dict[str, Any]:
    from spark_dilation.spark.dataset import REPORT_PREFIX

    lines = [ln for ln in log.read_text(errors="replace").splitlines() if REPORT_PREFIX in ln]
    assert lines, f"no transfer report in {log}:\n{_tail(log)}"
    return json.loads(lines[-1].split(REPORT_PREFIX, 1)[1])


_drivers: list[Any] = []
"""The driver processes the running test started (killed at its end if still running)."""


@pytest.fixture(autouse=True)
def _no_driver_outlives_its_test(request: pytest.FixtureRequest) -> Any:
    """A test that fails mid-transfer leaves its applications holding the clusters' task
    slots: kill them, so the next test starts on idle clusters. Their lane hosts then
    remove their staging, logs included: keep those logs first."""
    yield
    if any(proc.poll() is None for proc in _drivers) and "net_clusters" in request.fixturenames:
        _keep_staging_logs(request.getfixturevalue("net_clusters"), request.node.name)
    while _drivers:
        proc = _drivers.pop()
        with contextlib.suppress(ProcessLookupError):
            _kill_application(proc)


def _keep_staging_logs(nc: NetClusters, test: str) -> None:
    """Copy every machine's transfer logs (lane hosts, registry, sender hosts) to the log dir."""
    for m in nc.machines:
        root = m.tmp / "spark-dilation"
        for path in root.rglob("*.log") if root.exists() else ():
            target = nc.log_dir / f"{test}-staging" / m.name / path.relative_to(root)
            target.parent.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(OSError):  # a host may remove it meanwhile
                shutil.copyfile(path, target)


def _driver(nc: NetClusters, cluster: Cluster, argv: list[str], log: Path) -> Any:
    proc = nc.run_driver(cluster, argv, log)
    _drivers.append(proc)
    return proc


def Reader(nc: NetClusters, code: str, name: str) -> SteppedReader:
    """The stepped reader application on cluster B."""
    return SteppedReader(
        lambda argv, log: _driver(nc, nc.b, argv, log),
        nc.log_dir / name,
        nc.log_dir / f"{name}-reader.log",
        code=code, mailbox=nc.mailbox_url, relay=nc.relay_url, master=nc.b.master_url,
    )  # fmt: skip


def _send(nc: NetClusters, code: str, name: str, *extra: str) -> tuple[Any, Path]:
    log = nc.log_dir / f"{name}-writer.log"
    proc = _driver(
        nc,
        nc.a,
        [
            PY, "-m", "spark_dilation.testing.spark_peer", "send", "--code", code,
            "--mailbox", nc.mailbox_url, "--relay", nc.relay_url, "--master", nc.a.master_url,
            "--rows", str(ROWS), "--partitions", "4", "--digest", *extra,
        ],
        log,
    )  # fmt: skip
    return proc, log


def _holders(cluster: Cluster) -> dict[int, set[str]]:
    """Lane -> the machines of ``cluster`` that hold a complete staged copy."""
    out: dict[int, set[str]] = {}
    for m in cluster.workers:
        for manifest in (m.tmp / "spark-dilation").glob("*/lane-*/manifest.json"):
            out.setdefault(int(manifest.parent.name[5:]), set()).add(m.name)
    return out


def _receive_report(cluster: Cluster, timeout: float = 30) -> dict[str, Any]:
    """The receive report the lane registry logged on the reader's driver machine."""
    from spark_dilation.transfer.receive.registryhost import RECEIVE_REPORT_PREFIX

    def report() -> dict[str, Any] | None:
        for log in (cluster.driver.tmp / "spark-dilation").glob("registry-*/host.log"):
            for line in log.read_text(errors="replace").splitlines():
                if RECEIVE_REPORT_PREFIX in line:
                    return json.loads(line.split(RECEIVE_REPORT_PREFIX, 1)[1])
        return None

    wait_until("the registry's receive report in its log", report, timeout, interval=0.2)
    found = report()
    assert found is not None
    return found


def _kill_jvms(cluster: Cluster, machine: Machine) -> None:
    """The machine's Worker and executor JVMs die (their Python workers follow); its lane
    hosts, in sessions of their own, live on with their staged copies."""
    for pid in machine.pids():
        try:
            comm = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            continue
        if comm == "java":
            os.kill(pid, signal.SIGKILL)
    cluster._worker_jvms.pop(machine.name, None)


def _helpers(cluster: Cluster, *modules: str) -> list[str]:
    """Our helper processes (by module) running on the cluster's machines."""
    found = []
    for m in cluster.machines:
        for pid in m.pids():
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if "spark_dilation.transfer." in cmd and any(f".{name} " in cmd for name in modules):
                found.append(f"{m.name}:{pid}")
    return found


def _lane_hosts(cluster: Cluster) -> list[str]:
    return _helpers(cluster, "lanehost", "registryhost")


def _helper_logs(cluster: Cluster, n: int = 40) -> str:
    """The tails of the helper logs still on the cluster's machines (for a failure)."""
    out = []
    for m in cluster.machines:
        for log in sorted((m.tmp / "spark-dilation").glob("**/*.log")):
            out.append(f"--- {m.name}: {log}\n{_tail(log, n)}")
    return "\n".join(out) or "(no helper logs left)"


def _ended(proc: Any, timeout: float, nc: NetClusters) -> int:
    """``proc``'s exit code; if it runs on after ``timeout``, fail with the helpers' logs."""
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        logs = f"{_helper_logs(nc.a)}\n{_helper_logs(nc.b)}"
        what = " ".join(map(str, proc.args))[-200:]
        raise AssertionError(f"still running after {timeout} s: ...{what}\n{logs}") from None


def _wait_for_sender_host_exit(nc: NetClusters, limit: float = 30) -> None:
    """Once its application has ended, the sender host tells the lanes and leaves; it
    does not wait for the dead application's tasks (that took 30 s more)."""
    wait_until(
        "the sender host to exit",
        lambda: not _helpers(nc.a, "senderhost"),
        limit,
        interval=0.2,
        details=lambda: _helper_logs(nc.a),
    )


def _in_flight(cluster: Cluster) -> bool:
    """A partition is mid-stream on one of the cluster's machines (its header arrived)."""
    return any(
        list((m.tmp / "spark-dilation").glob("*/lane-*/.p*.partial")) for m in cluster.machines
    )


def _staged_files(cluster: Cluster) -> list[str]:
    return [
        str(p)
        for m in cluster.machines
        for p in (m.tmp / "spark-dilation").rglob("*")
        if p.is_file() and m.pids()
    ]


def _kill_application(proc: Any) -> None:
    """SIGKILL a driver and its JVM (its process group), as a crash or kill -9 would."""
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(30)


def test_every_action_exact_while_lanes_move_between_machines(net_clusters: NetClusters) -> None:
    nc = net_clusters
    nc.relay_only()
    writer, writer_log = _send(nc, "7-multi-machine", "moves")
    reader = Reader(nc, "7-multi-machine", "moves")
    loaded = reader.loaded()
    assert "error" not in loaded, loaded

    # 1. show(): lane 0 first (Spark's limit), on whichever executor gets it.
    shown = reader.step("show")
    assert shown.get("shown") == 5, f"{shown}\n{_tail(reader.log)}"
    # 2. The full content digest: every lane; the writer can now finish.
    got = reader.step("digest")
    assert writer.wait(300) == 0, _tail(writer_log)
    sent = _json_line(writer_log, "side")
    assert sent is not None and "error" not in sent, _tail(writer_log)
    assert got.get("digest") == sent["digest"], f"{got} vs {sent}"
    report = _report(writer_log)
    assert report["rows"] == ROWS and report["path"] == "relay", report
    # At most one connection per (sending machine, lane): a0 (the sender host), a1, a2;
    # the lanes counted the same connections (the registry's receive report).
    assert 1 <= report["connections"] <= 3 * 2, report
    received = _receive_report(nc.b)
    assert received["connections"] == report["connections"], (received, report)
    assert received["path"] == "relay", received
    first = _holders(nc.b)
    assert set(first) == {0, 1}, first

    # 3. Every machine that received a lane loses its Worker and executor;
    #    two new machines join. count() must run every lane on a machine
    #    that never received it: it copies the lane from its lane host.
    old = [m for m in nc.b.workers if m.name in set().union(*first.values())]
    for m in old:
        _kill_jvms(nc.b, m)
    new = [nc.b.add_worker(), nc.b.add_worker()]
    counted = reader.step("count")
    assert counted.get("count") == ROWS, f"{counted}\n{_tail(reader.log)}"
    moved = _holders(nc.b)
    for lane in (0, 1):
        assert moved[lane] & {m.name for m in new}, f"lane {lane} never ran elsewhere: {moved}"
    copied = [
        p
        for m in new
        for p in (m.tmp / "spark-dilation").glob("*/lane-*/host.log")
        if "copied" in p.read_text()
    ]
    assert copied, "no lane host logged a copy"

    # 4. A filter count on the same DataFrame.
    filtered = reader.step("filter_count")
    assert filtered.get("count") == ROWS // 2, filtered

    # 5. A machine that held copies is lost (disk and processes): the others hold them.
    lost = old[0]
    lost.kill_all()
    roundtrip = reader.step("parquet", path=str(nc.run_dir / "roundtrip.parquet"))
    assert roundtrip.get("digest") == sent["digest"], roundtrip

    # 6. Every copy of lane 0 lost after it was read: the next action fails
    #    promptly with the cannot-heal error (not after idle_timeout).
    holders = _holders(nc.b)[0]
    for m in nc.b.workers:
        if m.name in holders and m.pids():
            m.kill_all()
            nc.b._worker_jvms.pop(m.name, None)
    if not [m for m in nc.b.workers if m.name in nc.b._worker_jvms]:
        nc.b.add_worker()
    started = time.monotonic()
    failed = reader.step("count", timeout=300)
    elapsed = time.monotonic() - started
    assert "cannot heal" in failed.get("error", ""), failed
    assert elapsed < 120, f"the cannot-heal error took {elapsed:.0f} s"

    # 7. The application ends: every lane host and the registry leave, with their staging.
    assert reader.step("stop")["action"] == "stop"
    reader.proc.wait(120)
    wait_until("the lane hosts to exit", lambda: not _lane_hosts(nc.b), 30, interval=0.2)
    alive = [m for m in nc.b.machines if m.pids() or m is nc.b.driver]
    left = [
        str(p)
        for m in alive
        if m.name not in holders and m is not lost
        for p in (m.tmp / "spark-dilation").rglob("*")
        if p.is_file()
    ]
    assert not left, left


@pytest.fixture
def direct_paths(net_clusters: NetClusters) -> Any:
    net_clusters.direct()
    yield net_clusters
    net_clusters.relay_only()


def test_direct_path_between_clusters_without_default_routes(direct_paths: NetClusters) -> None:
    """Direct routes between the clusters (no default route anywhere): the path is direct.
    The reader asks for 4 lanes on its 2 task slots: the 2 lanes no slot runs are
    received on its driver's machine and the read tasks copy them; the rows are exact."""
    nc = direct_paths
    writer, writer_log = _send(nc, "8-multi-machine-direct", "direct")
    log = nc.log_dir / "direct-reader.log"
    reader = _driver(
        nc,
        nc.b,
        [
            PY, "-m", "spark_dilation.testing.spark_peer", "receive", "--code",
            "8-multi-machine-direct", "--mailbox", nc.mailbox_url, "--relay", nc.relay_url,
            "--master", nc.b.master_url, "--no-show", "--digest", "--option", "lanes=4",
        ],
        log,
    )  # fmt: skip
    assert _ended(writer, 400, nc) == 0, _tail(writer_log)
    assert _ended(reader, 400, nc) == 0, _tail(log)
    sent, got = _json_line(writer_log, "side"), _json_line(log, "side")
    assert sent and got and got["digest"] == sent["digest"], (sent, got)
    report = _report(writer_log)
    assert report["path"] == "direct", report


def test_writer_application_killed_mid_transfer(net_clusters: NetClusters) -> None:
    """The writer's driver dies mid-transfer: the sender host on its machine sees it and
    aborts the transfer, so the reader's running action fails within seconds with that
    cause; no helper process or staged file is left on either cluster."""
    nc = net_clusters
    writer, _ = _send(nc, "9-writer-killed", "wkill", "--option", "test_fail=sender-pause:600")
    reader = Reader(nc, "9-writer-killed", "wkill")
    assert "error" not in reader.loaded()
    reader.start("count")
    wait_until("lanes receiving", lambda: len(_helpers(nc.b, "lanehost")) >= 2, 240)
    wait_until("the sender host", lambda: _helpers(nc.a, "senderhost"), 60)
    wait_until("a partition mid-stream (paused after its header)", lambda: _in_flight(nc.b), 120)
    _kill_application(writer)
    killed = time.monotonic()
    failed = reader.result(120)
    took = time.monotonic() - killed
    assert "writing application ended" in failed.get("error", ""), failed
    assert took < 60, f"the reader's action failed {took:.0f} s after the writer died"
    _wait_for_sender_host_exit(nc)
    assert reader.step("stop")["action"] == "stop"
    reader.proc.wait(120)
    wait_until("the lane hosts to exit", lambda: not _lane_hosts(nc.b), 30)
    assert not _staged_files(nc.b), _staged_files(nc.b)
    assert not [p for p in _staged_files(nc.a) if "send-" in p], _staged_files(nc.a)


def test_reader_application_killed_mid_transfer(net_clusters: NetClusters) -> None:
    """The reader's driver dies mid-transfer: its lane hosts tell the senders, remove their
    staging and exit within seconds; the writer fails with that cause."""
    nc = net_clusters
    writer, writer_log = _send(
        nc, "10-reader-killed", "rkill", "--option", "test_fail=sender-pause:10",
        "--option", "reconnect_timeout=20", "--option", "lane_start_timeout=90",
        "--conf", "spark.task.maxFailures=1",
    )  # fmt: skip
    reader = Reader(nc, "10-reader-killed", "rkill")
    assert "error" not in reader.loaded()
    reader.start("count")
    wait_until("lanes receiving", lambda: len(_helpers(nc.b, "lanehost")) >= 2, 240)
    # Not an event: the senders' 10 s pause (kept short, the tasks sleep through it) can be
    # over before a poll sees its partial file on a loaded machine.
    time.sleep(3)
    _kill_application(reader.proc)
    took = wait_until("the reader's lane hosts to exit", lambda: not _lane_hosts(nc.b), 30)
    assert took < 15, f"lane hosts outlived the reading application by {took:.0f} s"
    assert not _staged_files(nc.b), _staged_files(nc.b)
    started = time.monotonic()
    assert writer.wait(300) != 0, _tail(writer_log)
    took = time.monotonic() - started
    sent = _json_line(writer_log, "side")
    # The lane hosts told the senders why (not a lost connection after reconnect_timeout).
    assert sent is not None and "the reading application ended" in sent.get("error", ""), _tail(
        writer_log
    )
    # Its abort() tries the gone lanes for at most ABORT_TIMEOUT (10 s), not 30.
    assert took < 60, f"the writer failed {took:.0f} s after the reader died"
    _wait_for_sender_host_exit(nc, limit=60)  # its abort finds no lane


def test_worker_killed_mid_transfer(net_clusters: NetClusters) -> None:
    """A reader machine is lost while its lane receives (a partition in flight, none
    confirmed yet: first attempts pause 20 s after their header, ample for the kill
    that follows): the lane is received anew (by Spark's rerun of its task on another
    executor, or by the registry on the driver's machine if no task claims it within
    30 s), the senders' pools find that new incarnation in the lane's lobby seconds
    after their connections went down (not after reconnect_timeout, 120 s) and send
    again the partitions in flight: the rows are exact. (Had the lost lane confirmed a
    partition, both sides would fail with "cannot heal": tests/test_spark_transfer.py.)"""
    nc = net_clusters
    writer, writer_log = _send(
        nc, "11-worker-lost", "wlost", "--option", "test_fail=sender-pause:20",
    )  # fmt: skip
    reader = Reader(nc, "11-worker-lost", "wlost")
    assert "error" not in reader.loaded()
    reader.start("digest")

    def receiving() -> Machine | None:
        for m in nc.b.workers:
            if m.pids() and list((m.tmp / "spark-dilation").glob("*/lane-*/.p*.partial")):
                return m
        return None

    wait_until("a partition in flight on a worker", lambda: receiving() is not None, 240)
    victim = receiving()
    assert victim is not None
    victim.kill_all()
    nc.b._worker_jvms.pop(victim.name, None)
    nc.b.add_worker()
    got = reader.result(600)
    assert writer.wait(300) == 0, _tail(writer_log)
    sent = _json_line(writer_log, "side")
    assert sent is not None and got.get("digest") == sent["digest"], (got, sent)
    assert reader.step("stop")["action"] == "stop"
    reader.proc.wait(120)
    wait_until("the lane hosts to exit", lambda: not _lane_hosts(nc.b), 30)


def test_stream_between_clusters_survives_a_reader_kill(net_clusters: NetClusters) -> None:
    """Structured Streaming from cluster A to cluster B (relay only): the sink's commit
    runs on A's driver machine, the source's run on B's, tasks on the workers. The
    receiving application is SIGKILLed mid-stream and started again with the same
    arguments (no new code): every row arrives once, by the content digest."""
    nc = net_clusters
    nc.relay_only()
    folder = nc.log_dir / "stream"
    folder.mkdir(exist_ok=True)
    peer = [PY, "-m", "spark_dilation.testing.stream_peer"]
    common = ["--code", "12-stream-clusters", "--mailbox", nc.mailbox_url, "--relay", nc.relay_url]
    rows, src = 100_000, folder / "src"

    def app(cluster: Cluster, side: str, *args: str) -> Any:
        return _driver(
            nc,
            cluster,
            [*peer, side, "--master", cluster.master_url, *args],
            folder / f"{side}.log",
        )

    pairing = folder / "r-pairing"
    receive_args = [
        *common, "--out", str(folder / "out"), "--checkpoint", str(folder / "r-ck"),
        "--pairing", str(pairing), "--rows", str(rows),
    ]  # fmt: skip
    receiver = app(nc.b, "receive", *receive_args)
    # The sender generates its input on cluster A's workers first (no application of its own).
    sender = app(
        nc.a, "send", *common, "--source", str(src), "--rows", str(rows), "--files", "12",
        "--checkpoint", str(folder / "s-ck"), "--pairing", str(folder / "s-pairing"),
    )  # fmt: skip

    def staged() -> int:
        with contextlib.suppress(OSError, ValueError):
            return json.loads((pairing / "ledger.json").read_text())["next_seq"]
        return 0

    def ended() -> str | None:
        gone = [p for p in (sender, receiver) if p.poll() is not None]
        return "an application ended" if gone else None

    wait_until("4 micro-batches staged on cluster B", lambda: staged() >= 4, 300, stop_if=ended)
    _kill_application(receiver)
    receiver = app(nc.b, "receive", *receive_args)
    assert sender.wait(600) == 0, _tail(folder / "send.log")
    assert receiver.wait(600) == 0, _tail(folder / "receive.log")
    got = _json_line(folder / "receive.log", "side")
    assert got is not None and "error" not in got, _tail(folder / "receive.log")
    assert got["rows"] == got["distinct_ids"] == rows, got
    sent = _json_line(folder / "send.log", "side")
    assert sent is not None and sent["expected"]["rows"] == rows, _tail(folder / "send.log")
    assert got["digest"] == sent["expected"]["digest"]
    wait_until("the stream host to exit", lambda: not _helpers(nc.a, "streamhost"), 30)
