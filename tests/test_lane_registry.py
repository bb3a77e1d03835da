"""The lane registry and copies of staged lanes, with real processes and servers, without Spark.

Each "machine" is a staging directory of its own (what separate executors
have); the registry runs in its own process, owned by a stand-in for the
driver JVM (a ``sleep``), exactly as ``load()`` starts it. Sender: the
Python API over the real mailbox and relay.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from spark_dilation.testing.waiting import wait_until
from spark_dilation.transfer import TransferOptions, send_dataset
from spark_dilation.transfer.meet.session import receive_session
from spark_dilation.transfer.receive.lane import CannotHealError
from spark_dilation.transfer.receive.laneread import read_lane, start_lanes
from spark_dilation.transfer.receive.registryhost import start_registry_host
from spark_dilation.transfer.receive.staging import LaneStaging
from spark_dilation.transfer.rules.registry import (
    DONE,
    FAILED,
    HOSTED_CLAIM_WAIT,
    NONE,
    RECEIVER_GONE_WAIT,
    RECEIVING,
    HostInfo,
    LaneRegistry,
)


def host(name: str) -> HostInfo:
    return HostInfo(name, f"machine-{name}", ("10.0.0.1",), 1)


def test_registry_rules() -> None:
    reg = LaneRegistry(2)
    assert reg.claim(0, host("a"), complete=False) == {"do": "receive", "epoch": 0}
    assert reg.claim(0, host("a"), complete=False) == {"do": "receive", "epoch": 0}  # again
    assert reg.epochs() == {0: 0}
    following = reg.claim(0, host("b"), complete=False)  # b follows the receiver
    assert following["do"] == "fetch" and following["sources"][0]["host_id"] == "a"
    reg.gone("a")  # the receiver died before the lane was done: a new claim receives
    assert reg.lanes[0].state == NONE
    # A new host takes the lane over: the next epoch, which the directory publishes.
    assert reg.claim(0, host("b"), complete=False) == {"do": "receive", "epoch": 1}
    assert reg.epochs() == {0: 1}
    assert reg.lanes[0].state == RECEIVING
    reg.done(0, host("b"))
    answer = reg.claim(0, host("c"), complete=False)
    assert answer["do"] == "fetch" and [s["host_id"] for s in answer["sources"]] == ["b"]
    reg.done(0, host("c"))  # c copied it: two replicas
    reg.gone("b")
    assert reg.lanes[0].state == DONE
    reg.gone("c")
    assert reg.lanes[0].state == FAILED
    error = reg.claim(0, host("d"), complete=False)["error"]
    assert error["type"] == "CannotHealError"
    assert "machine-b, machine-c" in error["message"]
    # A complete copy announced by a host (a restarted host on a machine that kept it).
    assert reg.claim(1, host("e"), complete=True) == {"do": "serve"}
    assert reg.claim(1, host("f"), complete=False)["do"] == "fetch"
    # The lane's own verdict is final for everyone.
    reg2 = LaneRegistry(1)
    reg2.claim(0, host("a"), complete=False)
    reg2.failed(0, host("a"), {"type": "TransferAbortedError", "module": "m", "message": "x"})
    assert reg2.claim(0, host("b"), complete=False)["do"] == "error"


def test_cannot_heal_names_how_each_copy_went() -> None:
    """A copy deleted under its lane host (which says so before it leaves) is not blamed
    on a lost machine; copies that went both ways are each named."""
    reg = LaneRegistry(2)
    for lane in (0, 1):
        reg.claim(lane, host("a"), complete=False)
        reg.done(lane, host("a"))
    reg.claim(1, host("b"), complete=False)
    reg.done(1, host("b"))  # lane 1: a second copy on machine-b
    reg.deleted(0, host("a"))
    reg.deleted(1, host("a"))
    reg.gone("a")
    message = reg.claim(0, host("c"), complete=False)["error"]["message"]
    assert "on machine-a: its staged copy was deleted under its lane host" in message, message
    assert "machine lost" not in message, message
    assert reg.lanes[1].state == DONE  # machine-b still holds lane 1
    reg.gone("b")  # machine-b lost
    message = reg.claim(1, host("c"), complete=False)["error"]["message"]
    assert "on machine-a: its staged copy was deleted" in message, message
    assert "on machine-b: its lane host ended: machine lost or process killed" in message


def test_a_lanes_own_failure_wins_over_the_abort_in_either_order() -> None:
    """A lane that cannot stage declares it before telling the senders; the abort it sets
    off fails every lane, and every lane's error is the declared cause however the two
    reach the registry (the abort's lane host may report first)."""
    full = {"type": "StagingError", "module": "m", "message": "lane 1 ...: No space left"}
    abort = {"type": "TransferAbortedError", "module": "m", "message": "the sender aborted"}
    for order in ("cause first", "abort first"):
        reg = LaneRegistry(3)
        for lane in range(3):
            reg.claim(lane, host(f"h{lane}"), complete=False)
        if order == "cause first":
            assert reg.own_failure(1, host("h1"), full) == full
            reg.failed(0, host("h0"), abort)
        else:
            reg.failed(0, host("h0"), abort)
            assert reg.own_failure(1, host("h1"), full) == full
        assert [reg.lanes[lane].error for lane in range(3)] == [full] * 3, order
        assert reg.ended() == {lane: (0, full["message"]) for lane in range(3)}, order
        assert reg.claim(2, host("h9"), complete=False) == {"do": "error", "error": full}
    # A later lane's own failure does not replace the first.
    reg = LaneRegistry(2)
    reg.own_failure(0, host("a"), full)
    other = {**full, "message": "lane 0 ... Permission denied"}
    assert reg.own_failure(1, host("b"), other) == full


def test_registry_hosts_a_lane_nobody_claims_and_again_when_its_receiver_goes() -> None:
    """The registry receives a lane no read task claimed within the grace period; when
    that receiver (or any lane's receiver) goes before the lane is done and no task
    claims it again within the grace period, the registry hosts it again: the sender
    never waits for a slot that a lane blocked on the manifest holds."""
    reg = LaneRegistry(3)
    assert reg.unclaimed(now=0.0, grace=5.0) == []  # the action has not started
    reg.claim(0, host("a"), complete=False, now=10.0)
    assert reg.unclaimed(now=14.0, grace=5.0) == []
    assert reg.unclaimed(now=15.0, grace=5.0) == [1, 2]
    reg.hosting(1, now=15.0)
    reg.hosting(2, now=15.0)
    reg.claim(1, host("driver"), complete=False, now=15.5)
    reg.claim(2, host("driver"), complete=False, now=15.5)
    assert reg.unclaimed(now=16.0, grace=5.0) == []
    reg.gone("driver", now=20.0)  # the driver's receiver died mid-lane
    assert [reg.lanes[lane].state for lane in (1, 2)] == [NONE, NONE]
    later = 20.0 + RECEIVER_GONE_WAIT
    assert reg.unclaimed(now=later - 1, grace=5.0) == []  # a rerun task may claim it first
    assert reg.claim(2, host("b"), complete=False, now=later - 0.5) == {"do": "receive", "epoch": 1}
    assert reg.unclaimed(now=later, grace=5.0) == [1]
    reg.gone("a", now=later)  # lane 0's receiver (a read task's machine) is lost
    assert reg.unclaimed(now=later + RECEIVER_GONE_WAIT, grace=5.0) == [0, 1]
    # A host the registry started that dies before it claims: another after a while.
    now = later + RECEIVER_GONE_WAIT
    reg.hosting(0, now=now)
    assert reg.unclaimed(now=now + 1, grace=5.0) == [1]
    assert reg.unclaimed(now=now + HOSTED_CLAIM_WAIT, grace=5.0) == [0, 1]


def test_registry_fails_a_lane_it_cannot_host() -> None:
    reg = LaneRegistry(2)
    reg.claim(0, host("a"), complete=False, now=0.0)
    step = RECEIVER_GONE_WAIT + 10
    for attempt in range(1, 4):
        assert reg.unclaimed(now=step * attempt, grace=5.0) == [1]
        reg.hosting(1, now=step * attempt)
        assert reg.unclaimed(now=step * attempt + 1, grace=5.0) == []
        reg.hosting_failed(1, "its receiver process exited with code 1", now=step * attempt + 2)
    assert reg.lanes[1].state == FAILED
    assert reg.unclaimed(now=10 * step, grace=5.0) == []
    error = reg.claim(1, host("b"), complete=False, now=10 * step)["error"]
    assert "did not start (3 tries): its receiver process exited with code 1" in error["message"]
    # What the reading end publishes: the lane ended for good, never hosted (epoch 0), so
    # its senders fail with this error instead of waiting for a host (directory.py).
    ((lane, (epoch, why)),) = reg.ended().items()
    assert (lane, epoch) == (1, 0) and why == error["message"]
    # A read task that claimed the lane while the registry tried keeps it.
    reg2 = LaneRegistry(2)
    reg2.claim(0, host("a"), complete=False, now=0.0)
    reg2.hosting(1, now=5.0)
    assert reg2.claim(1, host("b"), complete=False, now=6.0) == {"do": "receive", "epoch": 0}
    for _ in range(3):
        reg2.hosting_failed(1, "x", now=7.0)
    assert reg2.lanes[1].state == RECEIVING


def table(rows: int) -> pa.Table:
    return pa.table(
        {"id": pa.array(range(rows), pa.int64()), "s": [f"row-{i:07d}" for i in range(rows)]}
    )


def send_in_thread(data: pa.Table, code: str, **opts: Any) -> tuple[threading.Thread, dict]:
    """The Python API's sender in a thread; its dict gets ``report`` or ``error``."""
    sent: dict[str, Any] = {}

    def send() -> None:
        try:
            sent["report"] = send_dataset(data, code=code, **opts)
        except BaseException as e:  # reported by the test's assertion
            sent["error"] = e

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    return sender, sent


def on_machine(spec: Any, root: Path) -> Any:
    return replace(spec, options=spec.options.with_(staging_dir=str(root)))


def read_all(spec: Any, lane: int) -> list[int]:
    ids: list[int] = []
    for batch in read_lane(spec, lane):
        ids.extend(batch.column(0).to_pylist())
    return ids


def host_pid(spec: Any, lane: int) -> int:
    staging = LaneStaging(spec.options.staging_root, spec.transfer_id, lane)
    return int((staging.dir / "host.pid").read_text())


def wait_gone(pid: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        # Reap it if it is our child (a zombie still answers kill 0).
        try:
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                return
        except ChildProcessError:
            pass
        time.sleep(0.05)
    raise AssertionError(f"process {pid} still runs after {timeout} s")


def test_any_machine_reads_any_lane_until_every_copy_is_gone(
    mailbox_url: str, relay_url: str, tmp_path: Path
) -> None:
    data = table(40_000)
    code = "80207-registry-copies"
    opts = {"mailbox": mailbox_url, "relay": relay_url, "peer_timeout": 60}
    sender, sent = send_in_thread(data, code, **opts)
    owner = subprocess.Popen(["sleep", "600"])  # the driver JVM's stand-in
    try:
        spec = receive_session(code, TransferOptions(lanes=2, **opts))
        spec = start_registry_host(spec, owner=owner.pid)
        machine = {name: on_machine(spec, tmp_path / name) for name in "abcd"}

        # First action: machine a receives both lanes from the sender (all lanes at once).
        start_lanes(machine["a"])
        first = sorted(read_all(machine["a"], 0) + read_all(machine["a"], 1))
        sender.join(60)
        assert "error" not in sent, sent.get("error")
        assert first == list(range(40_000))

        # A later action runs lane 0 on machine b: it copies a's lane, exactly.
        lane0 = sorted(read_all(machine["a"], 0))
        assert sorted(read_all(machine["b"], 0)) == lane0
        copied = LaneStaging(machine["b"].options.staging_root, spec.transfer_id, 0)
        assert copied.manifest() is not None

        # Machine a is lost (its host killed, its disk gone): c copies b's copy.
        os.kill(host_pid(machine["a"], 0), signal.SIGKILL)
        assert sorted(read_all(machine["c"], 0)) == lane0

        # Every copy gone: d fails at once with the cannot-heal error, not a hang.
        os.kill(host_pid(machine["b"], 0), signal.SIGKILL)
        os.kill(host_pid(machine["c"], 0), signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(CannotHealError, match="lane 0 cannot heal"):
            read_all(machine["d"], 0)
        assert time.monotonic() - started < 30

        # The application ends: every lane host removes its staging and exits.
        pids = [host_pid(machine["a"], 1)]
        owner.kill()
        owner.wait()
        for pid in pids:
            wait_gone(pid, 15)

        def left() -> list[Path]:
            files = [p for p in tmp_path.rglob("*") if p.is_file() and "lane-" in str(p)]
            return [p for p in files if not p.parent.name.startswith("lane-0")]

        wait_until("the lanes' staging to go", lambda: not left(), 15, details=lambda: str(left()))

        # A read task that starts a host after the application ended (its workers not
        # yet killed) sees why, and that host leaves with the task's worker, not
        # ORPHAN_LINGER (30 s) later.
        spec_file = tmp_path / "spec.pickle"
        spec_file.write_bytes(pickle.dumps(on_machine(spec, tmp_path / "e")))
        task = subprocess.run(
            [sys.executable, "-c", LATE_READ_TASK, str(spec_file)],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert "could not reach the lane registry" in task.stdout, (task.stdout, task.stderr)
        pid = int(task.stdout.split()[0])
        started = time.monotonic()
        wait_gone(pid, 15)
        assert time.monotonic() - started < 10
        assert not list((tmp_path / "e").rglob("lane-1")), list((tmp_path / "e").rglob("*"))

        # A host whose read task died before the host even ran (its executor killed with
        # the application) is init's child from the start: it must not take init for its
        # launcher and keep its error for ORPHAN_LINGER (a CI run saw lane hosts outlive
        # their application by 30 s this way).
        from spark_dilation.transfer.machine import spawn, write_private
        from spark_dilation.transfer.receive.lanehost import ORPHAN_LINGER
        from spark_dilation.transfer.receive.registrylink import REGISTRY_CONNECT

        gone_task = subprocess.Popen(["true"])
        gone_task.wait()
        staging = LaneStaging(
            on_machine(spec, tmp_path / "f").options.staging_root, spec.transfer_id, 1
        )
        staging.ensure()
        spec_path = write_private(staging.dir, on_machine(spec, tmp_path / "f"))
        orphan = spawn(
            "spark_dilation.transfer.receive.lanehost",
            [str(spec_path), "1", str(gone_task.pid)],
            staging.dir / "host.log",
        )
        started = time.monotonic()
        orphan.wait(REGISTRY_CONNECT + ORPHAN_LINGER + 30)
        assert time.monotonic() - started < REGISTRY_CONNECT + ORPHAN_LINGER / 2
        assert not staging.dir.exists(), list(staging.dir.rglob("*"))
    finally:
        owner.kill()


def test_a_lane_the_registry_receives_is_received_again_when_its_receiver_dies(
    mailbox_url: str, relay_url: str, tmp_path: Path
) -> None:
    """One read task runs lane 0 (it waits for the manifest, holding its slot); the
    registry receives lane 1 on the driver's machine. That receiver dies mid-partition:
    the registry starts another after the grace period (before, the lane stayed
    'claimed' with nobody receiving it, and both sides waited for their timeouts), and
    every row arrives exactly once."""
    data = table(40_000)
    code = "80209-registry-rehost"
    opts = {"mailbox": mailbox_url, "relay": relay_url, "peer_timeout": 60}
    sender, sent = send_in_thread(data, code, test_fail="sender-pause:8", **opts)
    owner = subprocess.Popen(["sleep", "600"])  # the driver JVM's stand-in
    try:
        spec = receive_session(code, TransferOptions(lanes=2, **opts))
        driver = on_machine(spec, tmp_path / "driver")
        spec = start_registry_host(driver, owner=owner.pid)
        got: dict[str, Any] = {}

        def read_lane0() -> None:
            try:
                got["ids"] = read_all(on_machine(spec, tmp_path / "a"), 0)
            except BaseException as e:  # reported by the assertion below
                got["error"] = e

        task = threading.Thread(target=read_lane0, daemon=True)
        task.start()
        lane1 = LaneStaging(driver.options.staging_root, spec.transfer_id, 1)
        wait_until(
            "the registry to receive lane 1", lambda: list(lane1.dir.glob(".p*.partial")), 60
        )
        first = host_pid(driver, 1)
        os.kill(first, signal.SIGKILL)
        killed = time.monotonic()
        while True:
            with contextlib.suppress(OSError, ValueError):
                if host_pid(driver, 1) != first:
                    break
            assert time.monotonic() - killed < RECEIVER_GONE_WAIT + 60, "nobody receives it again"
            time.sleep(0.1)
        assert time.monotonic() - killed >= RECEIVER_GONE_WAIT - 1  # a rerun task may come first
        task.join(120)
        assert "error" not in got, got.get("error")
        lane1_ids = read_all(on_machine(spec, tmp_path / "b"), 1)
        assert sorted(got["ids"] + lane1_ids) == list(range(40_000))
        sender.join(60)
        assert "error" not in sent, sent.get("error")
    finally:
        owner.kill()
        owner.wait()


# A read task's worker: reads lane 1, prints its host's pid and the error, exits.
LATE_READ_TASK = """
import pickle, sys
from spark_dilation.transfer.receive.laneread import read_lane
from spark_dilation.transfer.receive.staging import LaneStaging
spec = pickle.loads(open(sys.argv[1], "rb").read())
staging = LaneStaging(spec.options.staging_root, spec.transfer_id, 1)
try:
    list(read_lane(spec, 1))
except Exception as e:
    print((staging.dir / "host.pid").read_text(), e)
"""
