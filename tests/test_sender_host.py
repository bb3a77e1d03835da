"""The sender host on the real mailbox server and relay, without Spark.

What a Spark task does through ``hostlink`` (hand a partition over the local
socket, retry after a failed attempt, deliver the manifest) against a real
host process and real receiving lanes (the Python API's receiver).
"""

from __future__ import annotations

import shutil
import socket
import threading
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from spark_dilation.testing.waiting import wait_until
from spark_dilation.transfer import TransferOptions, receive_dataset
from spark_dilation.transfer.link import _LEN
from spark_dilation.transfer.meet.hub import SenderHub
from spark_dilation.transfer.meet.session import SenderSession
from spark_dilation.transfer.send.hostlink import (
    KIND_PARTITION,
    _connect,
    deliver_manifest_via_host,
    host_dir,
    send_partition_via_host,
    socket_path,
    start_sender_host,
    unix_address,
)
from spark_dilation.transfer.send.stream import PartitionStream


def table(rows: int, start: int = 0) -> pa.Table:
    return pa.table(
        {
            "id": pa.array(range(start, start + rows), pa.int64()),
            "s": pa.array([f"row-{i:09d}" for i in range(start, start + rows)]),
        }
    )


def agree(schema: pa.Schema, opts: dict[str, Any]) -> tuple[Any, threading.Thread, dict]:
    """A session over a code with a Python receiver (2 lanes) running in a thread.

    Returns the sender's spec, the receiver's thread and the dict that gets
    its ``result`` (or ``error``).
    """
    session = SenderSession.open(schema, TransferOptions(**opts))
    received: dict[str, Any] = {}

    def receive() -> None:
        try:
            received["result"] = receive_dataset(session.code, lanes=2, **opts)
        except BaseException as e:
            received["error"] = e

    receiver = threading.Thread(target=receive, daemon=True)
    receiver.start()
    # This process is the writing end, as the driver machine's host is for a Spark
    # writer: the hosts and tasks the test starts get their sender ids here.
    hub = SenderHub(session.wait(), serve=True)
    _hubs.append(hub)
    return hub.spec_with_hub(), receiver, received


_hubs: list[Any] = []


@pytest.fixture(autouse=True)
def _close_hubs() -> Any:
    yield
    while _hubs:
        _hubs.pop().close()


@pytest.fixture
def opts(mailbox_url: str, relay_url: str, tmp_path: Path) -> dict[str, Any]:
    return {"mailbox": mailbox_url, "relay": relay_url, "staging_dir": str(tmp_path / "staging")}


def test_tasks_hand_partitions_to_the_sender_host(opts: dict[str, Any]) -> None:
    parts = [table(30_000, start=p * 30_000) for p in range(4)]
    spec, receiver, received = agree(parts[0].schema, opts)

    # No host yet: a task learns it at once and sends in-process instead.
    assert send_partition_via_host(spec, 0, 0, iter(parts[0].to_batches())) is None

    assert start_sender_host(spec)
    wait_until("the sender host's socket", socket_path(spec).exists, 60)
    assert socket_path(spec).stat().st_mode & 0o077 == 0  # this user's alone

    # A stranger (no token of this transfer) is dropped; the host goes on.
    stranger = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with unix_address(socket_path(spec)) as address:  # as a task connects: a long path works
        stranger.connect(address)
    stranger.sendall(b"SDH1" + b"\0" * 32 + b"P" + _LEN.pack(2) + b"{}")
    stranger.settimeout(10)
    try:
        answer = stranger.recv(100)
    except ConnectionResetError:  # closed with the stranger's body unread
        answer = b""
    assert answer == b""
    stranger.close()

    # Partition 1's first attempt: the task dies after two messages. The lane
    # must drop that attempt, so attempt 1 delivers the partition exactly once.
    link = _connect(spec, KIND_PARTITION, {"partition": 1, "attempt": 0})
    assert link is not None
    messages = PartitionStream(spec, 1, 0).messages(parts[1].slice(0, 5000).to_batches())
    for message in [next(messages), next(messages)]:
        link.send(message)
    link.close()

    stats = []
    committed = []
    for p, attempt in [(0, 0), (1, 1), (2, 0), (3, 0)]:
        got = send_partition_via_host(spec, p, attempt, iter(parts[p].to_batches(30_00)))
        assert got is not None
        committed.append(got[0])
        stats.append(got[1])
    assert [c.rows for c in committed] == [30_000] * 4
    assert {c.lane for c in committed} == {0, 1}
    # One process (the host), one connection per lane, reused by every partition.
    assert {s.process for s in stats} == {stats[0].process}
    assert stats[-1].connections_opened == spec.lanes
    # compression=auto: each task asked the host what its connections carry.
    assert all(s.codec_why.startswith("link ") for s in stats), stats
    if set(stats[-1].paths) == {"direct"}:
        assert {s.codec for s in stats} == {"none"} and "direct" in stats[0].codec_why

    # The manifest goes on the lanes' connections again: still one per lane, same process.
    host_stats = deliver_manifest_via_host(spec, committed)
    assert host_stats is not None and host_stats.process == stats[0].process
    assert host_stats.connections_opened == spec.lanes
    receiver.join(120)
    assert "error" not in received, received.get("error")
    result = received["result"]
    assert result.table.sort_by("id").equals(pa.concat_tables(parts))
    # Done: the host leaves and takes its directory (socket, log) with it.
    wait_until("the sender host to exit", lambda: not host_dir(spec).exists(), 60)


def test_a_host_that_dies_mid_partition_is_a_retryable_loss(opts: dict[str, Any]) -> None:
    """The host killed while a task streams: LaneLostError, then the retry sends in-process."""
    import os
    import signal

    from spark_dilation.transfer.rules.errors import LaneLostError
    from spark_dilation.transfer.send.delivery import deliver_manifest
    from spark_dilation.transfer.send.pool import send_partition

    parts = [table(20_000, start=p * 20_000) for p in range(2)]
    spec, receiver, received = agree(parts[0].schema, opts)
    assert start_sender_host(spec)
    wait_until("the sender host's socket", socket_path(spec).exists, 60)
    host_pid = int((host_dir(spec) / "host.pid").read_text())

    def dying_batches() -> Any:
        batches = parts[0].to_batches(1000)
        yield batches[0]
        os.kill(host_pid, signal.SIGKILL)
        time.sleep(0.5)
        yield from batches[1:]

    with pytest.raises(LaneLostError, match="sender host"):
        send_partition_via_host(spec, 0, 0, dying_batches())
    # The host is gone: a task learns it at once and sends in-process.
    assert send_partition_via_host(spec, 0, 1, iter(parts[0].to_batches())) is None
    committed = [send_partition(spec, 0, 1, iter(parts[0].to_batches()))]
    committed.append(send_partition(spec, 1, 0, iter(parts[1].to_batches())))
    assert deliver_manifest_via_host(spec, committed) is None
    deliver_manifest(spec, committed)
    receiver.join(120)
    assert "error" not in received, received.get("error")
    assert received["result"].table.sort_by("id").equals(pa.concat_tables(parts))
    # A host killed with SIGKILL cannot remove its folder (`spark-dilation cleanup`
    # does, for a user); the test that killed it does.
    assert host_dir(spec).exists()
    shutil.rmtree(host_dir(spec))


def test_the_host_runs_the_session_for_writer(opts: dict[str, Any], tmp_path: Path) -> None:
    """writer()'s path: the host agrees on the code, hands the spec over, then serves."""
    from spark_dilation.errors import PeerTimeoutError
    from spark_dilation.transfer.send.hostlink import HostLaunch

    # Nobody uses the code: the session's own error, same class and message. High
    # nameplates: the session's shared mailbox allocates low ones to other tests'
    # senders, and one still waiting on nameplate 5 once took this test's code.
    launch = HostLaunch(table(1).schema, TransferOptions(**opts, peer_timeout=2), "80005-nobody")
    with pytest.raises(
        PeerTimeoutError, match="nobody used the code 80005-nobody within 2 seconds"
    ):
        launch.wait_spec()
    assert not launch.dir.exists()

    parts = [table(10_000, start=p * 10_000) for p in range(3)]
    launch = HostLaunch(parts[0].schema, TransferOptions(**opts), "80006-host-session")
    received: dict[str, Any] = {}

    def receive() -> None:
        try:
            received["result"] = receive_dataset("80006-host-session", lanes=2, **opts)
        except BaseException as e:
            received["error"] = e

    receiver = threading.Thread(target=receive, daemon=True)
    receiver.start()
    spec = launch.wait_spec()
    assert spec.lanes == 2 and spec.schema.equals(parts[0].schema)
    assert not (launch.dir / "spec.pkl").exists()  # the secret does not stay on disk
    committed = []
    for p, part in enumerate(parts):
        got = send_partition_via_host(spec, p, 0, iter(part.to_batches()))
        assert got is not None  # the host was serving before the spec came back
        committed.append(got[0])
    host_stats = deliver_manifest_via_host(spec, committed)
    assert host_stats is not None and host_stats.connections_opened == spec.lanes
    receiver.join(120)
    assert "error" not in received, received.get("error")
    assert received["result"].table.sort_by("id").equals(pa.concat_tables(parts))
    wait_until("the host to remove its files", lambda: not launch.dir.exists(), 60)
