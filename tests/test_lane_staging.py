"""The lane's staging folder: once sealed (its owner removes it next), no stream
creates or renames a file in it, so removing it leaves nothing behind (a partition
completing as the reading application ends once left `lane-N/` files after the
removal). A fake channel plays the stream and seals at the moment of the race.

And the true cause of an end wins: a lane that cannot stage declares it before it
tells the sender, and another lane that the sender's abort then ends takes that
cause, not "the sender aborted" (a Spark reader once showed the abort)."""

from __future__ import annotations

import os
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from spark_dilation.errors import TransferError
from spark_dilation.transfer import machine as lifetime
from spark_dilation.transfer.machine import try_lock
from spark_dilation.transfer.receive.lane import LaneReceiver, LocalCauses
from spark_dilation.transfer.receive.staging import LaneStaging, host_alive, take_lane_lock
from spark_dilation.transfer.rules.errors import LaneIdleError, StagingError, TransferAbortedError
from spark_dilation.transfer.rules.options import TransferOptions
from spark_dilation.transfer.rules.protocol import (
    TAG_ERROR,
    TAG_TRAILER,
    Abort,
    decode_message,
    schema_bytes,
)
from spark_dilation.transfer.rules.spec import TransferSpec
from spark_dilation.transfer.send.stream import PartitionStream

TABLE = pa.table({"id": pa.array(range(1000), pa.int64())})


class Channel:
    """A partition stream's subchannel: ``messages`` in order; ``before_trailer`` runs
    just before the trailer is handed over."""

    def __init__(self, messages: list[bytes], before_trailer: Any = None) -> None:
        self._messages = list(messages)
        self._before_trailer = before_trailer
        self.sent: list[bytes] = []

    def receive(self, timeout: float) -> bytes | None:
        if not self._messages:
            return None
        message = self._messages.pop(0)
        if message[:1] == TAG_TRAILER and self._before_trailer is not None:
            self._before_trailer()
        return message

    def send(self, message: bytes, timeout: float | None = None) -> None:
        self.sent.append(message)


def lane(
    tmp_path: Path, number: int = 0, lanes: int = 1, causes: Any = None
) -> tuple[LaneReceiver, LaneStaging, list[bytes]]:
    spec = TransferSpec(
        "cd" * 16, b"s" * 32, lanes, schema_bytes(TABLE.schema), "none",
        TransferOptions(staging_dir=str(tmp_path)),
    )  # fmt: skip
    staging = LaneStaging(tmp_path, spec.transfer_id, number)
    staging.ensure()
    messages = list(PartitionStream(spec, number, 0).messages(TABLE.to_batches(250)))
    return LaneReceiver(spec, number, staging, -1, causes=causes), staging, messages


def test_a_partition_completes_into_the_staging(tmp_path: Path) -> None:
    receiver, staging, messages = lane(tmp_path)
    channel = Channel(messages)
    receiver._partition(channel)
    assert [p.name for p in staging.dir.iterdir() if not p.name.startswith(".")] == [
        staging.complete_path(0).name
    ]
    assert decode_message(channel.sent[-1])[1]["rows"] == TABLE.num_rows


def test_a_lane_never_reached_ends_with_no_path_whoever_sees_the_loss_first(
    tmp_path: Path, monkeypatch: Any
) -> None:
    """The lane's only connection found no path (relay refused, no direct): the
    connection's loop records the loss, then ends the lane after closing it. The
    waiter's idle check may see the loss in between (a loaded machine): the lane's
    error is the no-path error either way, not a lost sender (r12, test_deadlines)."""
    from spark_dilation.dilation.manager import DilationNoPath

    receiver, _, _ = lane(tmp_path)
    no_path = DilationNoPath("could not reach the other side: relay tcp:127.0.0.1:9 refused")

    class Conn:
        def accept(self, name: str, timeout: float) -> Any:
            raise no_path

        def close(self, timeout: float, linger: float) -> None:
            pass

        def status(self) -> Any:
            raise TransferError("closed")

    conn = Conn()
    receiver._connections.append(conn)
    recorded, go = threading.Event(), threading.Event()
    finish = receiver._finish

    def held_finish(error: BaseException | None, linger: float = 2.0) -> None:
        recorded.set()  # the loss is recorded; the waiter runs before the lane ends
        go.wait(10)
        finish(error, linger)

    monkeypatch.setattr(receiver, "_finish", held_finish)
    loop = threading.Thread(target=receiver._accept_loop, args=(conn, "p", None), daemon=True)
    loop.start()
    assert recorded.wait(10)
    error = receiver.wait_finished(timeout=5)
    go.set()
    loop.join(10)
    assert error is no_path, error


def test_a_partition_completing_after_the_seal_is_not_kept(tmp_path: Path) -> None:
    receiver, staging, messages = lane(tmp_path)
    channel = Channel(messages, before_trailer=receiver.seal)
    with pytest.raises(TransferError, match="lane 0 is ending: partition 0 was not kept"):
        receiver._partition(channel)
    assert list(staging.dir.iterdir()) == []  # no complete file, no partial left
    assert channel.sent == []  # never told the sender it has the rows


def test_a_partition_starting_after_the_seal_creates_no_file(tmp_path: Path) -> None:
    receiver, staging, messages = lane(tmp_path)
    receiver.seal()
    with pytest.raises(TransferError, match="was not kept"):
        receiver._partition(Channel(messages))
    assert list(staging.dir.iterdir()) == []


class Recording(LocalCauses):
    """LocalCauses that also logs each declaration next to what the channels sent."""

    def __init__(self, log: list[str]) -> None:
        super().__init__()
        self.log = log

    def cause(self, lane: int, own: BaseException | None = None) -> BaseException | None:
        if own is not None:
            self.log.append(f"lane {lane} declared")
        return super().cause(lane, own)


class LoggingChannel(Channel):
    def __init__(self, messages: list[bytes], log: list[str], name: str) -> None:
        super().__init__(messages)
        self.log, self.name = log, name

    def send(self, message: bytes, timeout: float | None = None) -> None:
        self.log.append(f"{self.name} sent {decode_message(message)[0]!r}")
        super().send(message, timeout)


def unstageable(staging: LaneStaging) -> None:
    """The lane's folder is a file now: opening a partial file fails (as a full disk does)."""
    staging.dir.rmdir()
    staging.dir.write_text("not a folder")


def test_the_staging_failure_is_the_cause_on_every_lane(tmp_path: Path) -> None:
    log: list[str] = []
    causes = Recording(log)
    failing, failing_staging, messages = lane(tmp_path, 1, lanes=2, causes=causes)
    healthy, _, _ = lane(tmp_path, 0, lanes=2, causes=causes)
    unstageable(failing_staging)
    # Lane 1 cannot stage: it declares the failure, then tells the sender ("E").
    failing._partition(LoggingChannel(messages, log, "lane 1"))
    assert log == ["lane 1 declared", f"lane 1 sent {TAG_ERROR!r}"]
    assert isinstance(failing.failure, StagingError)
    # The sender's job fails and it aborts the transfer: lane 0 ends with lane 1's cause.
    abort = Abort("the Spark job writing the dataset failed").encode()
    healthy._control(LoggingChannel([abort], log, "lane 0"))
    assert healthy.finished and healthy.error is failing.failure, healthy.error
    assert "could not stage" in str(healthy.error), healthy.error


def test_an_abort_with_no_failure_behind_it_is_the_abort(tmp_path: Path) -> None:
    healthy, _, _ = lane(tmp_path, 0, lanes=2, causes=LocalCauses())
    healthy._control(Channel([Abort("cancelled by the user").encode()]))
    assert isinstance(healthy.error, TransferAbortedError), healthy.error
    assert "the sender aborted the transfer" in str(healthy.error)


def test_a_host_starting_during_a_probe_still_takes_the_lane(tmp_path: Path) -> None:
    """host_alive() takes the lane's lock for an instant; a host that starts in that
    instant must not take the probe for a live host and leave (a clean-clone run saw
    "its receiver process exited with code 0")."""
    staging = LaneStaging(tmp_path, "ab" * 16, 0)
    staging.ensure()
    probe = try_lock(staging.dir / ".lock")  # the read task's probe, mid-way
    assert probe is not None
    threading.Timer(0.1, os.close, args=(probe,)).start()  # ... which lets go
    fd = take_lane_lock(staging)
    assert fd is not None, "the probe was taken for a live host"
    assert host_alive(staging)  # and the host holds the lane now
    os.close(fd)


def test_a_live_host_keeps_the_lane(tmp_path: Path) -> None:
    staging = LaneStaging(tmp_path, "ab" * 16, 0)
    held = take_lane_lock(staging)
    assert held is not None
    assert take_lane_lock(staging, patience=0.2) is None  # another host leaves
    os.close(held)


def test_a_host_whose_lane_failed_at_once_still_holds_the_lane(
    tmp_path: Path, monkeypatch: Any
) -> None:
    """A lane host holds the lane's lock for as long as it lives, whatever its lane
    did. A lane that failed at once (a full staging disk) once let go with its
    receiver, and the read task waiting for the host to take the lock saw a live
    process that never did, until its 60 s wait ran out (a clean-clone run)."""
    from spark_dilation.transfer.receive import lanehost

    staging = LaneStaging(tmp_path, "ab" * 16, 0)
    fd = take_lane_lock(staging)
    assert fd is not None

    class FailsAtOnce:  # LaneReceiver's part here: it closes the descriptor it is given
        def __init__(self, spec: Any, lane: int, staging: Any, lock_fd: int, **_: Any) -> None:
            self.lock_fd = lock_fd

        def start(self) -> None: ...

        def wait_finished(self) -> BaseException:
            return StagingError("lane 0: could not stage partition 0: No space left on device")

        def stop(self, linger: float) -> None:
            os.close(self.lock_fd)

    class Registry:
        def claim(self, lane: int, host: Any, complete: bool) -> dict[str, Any]:
            return {"do": "receive", "epoch": 0}

    monkeypatch.setattr(lanehost, "LaneReceiver", FailsAtOnce)
    host = lanehost.RegisteredLane(None, 0, staging, launcher=os.getpid())  # type: ignore[arg-type]
    error = host._obtain(Registry(), server=type("Server", (), {"host": None}), fd=fd)
    assert "could not stage partition" in str(error)
    assert host_alive(staging), "the host let go of its lane when the lane failed"
    os.close(fd)
    assert not host_alive(staging)


def test_the_probe_does_not_take_the_lock(tmp_path: Path, monkeypatch: Any) -> None:
    """host_alive() reads /proc/locks instead of taking the lock: however a host's start
    and a read task's probe interleave, the host takes the lane at its first try."""
    staging = LaneStaging(tmp_path, "ab" * 16, 0)
    staging.ensure()
    (staging.dir / ".lock").touch()  # a host ran here before
    assert not host_alive(staging)
    taken: list[int | None] = []
    real_read = lifetime.PROC_LOCKS.read_text

    def probe_then_start() -> str:
        text = real_read()  # the probe mid-way: the host starts right here
        taken.append(take_lane_lock(staging, patience=0.0))
        return text

    monkeypatch.setattr(lifetime, "PROC_LOCKS", type("P", (), {"read_text": probe_then_start}))
    assert not host_alive(staging)  # the instant before the host took it
    monkeypatch.undo()
    assert taken[0] is not None, "a probe made the starting host leave"
    assert host_alive(staging)
    os.close(taken[0])
    assert not host_alive(staging)


def test_proc_locks_lines_name_the_files_held() -> None:
    table = (
        "1: FLOCK  ADVISORY  WRITE 4056 fe:00:2154523 0 EOF\n"
        "1: -> FLOCK  ADVISORY  WRITE 4100 00:2d:77 0 EOF\n"  # a waiter, not a holder
        "2: POSIX  ADVISORY  WRITE 3695 00:2d:78 0 EOF\n"  # fcntl locks: not ours
        "3: FLOCK  ADVISORY  WRITE 3937 00:2d:79 0 EOF\n"
    )
    assert lifetime.held_in(table, os.makedev(0xFE, 0), 2154523)
    assert lifetime.held_in(table, os.makedev(0, 0x2D), 79)
    assert not lifetime.held_in(table, os.makedev(0, 0x2D), 77)
    assert not lifetime.held_in(table, os.makedev(0, 0x2D), 78)
    assert not lifetime.held_in(table, os.makedev(0, 0x2E), 79)


@pytest.mark.parametrize("stranded", ["door", "directory link"])
def test_an_idle_lane_names_a_server_that_lost_its_state(tmp_path: Path, stranded: str) -> None:
    """No sender ever came because the mailbox server lost its state meanwhile (a
    restart without its database stranded a door's meeting, or this process's
    directory link): the lane's idle_timeout error says so, not only "heard nothing"."""
    from types import SimpleNamespace

    from spark_dilation.transfer.rules.directory import Door

    receiver, _, _ = lane(tmp_path)
    receiver.spec = replace(receiver.spec, options=receiver.spec.options.with_(idle_timeout=0.3))
    if stranded == "door":
        receiver._waiting[Door(0, 0, 0, 0)] = SimpleNamespace(server_lost_state=True)
    else:
        receiver._senders.link_lost_state = lambda: "; the mailbox server lost its state"
    error = receiver.wait_finished(timeout=10)
    assert isinstance(error, LaneIdleError), error
    assert "heard nothing from the sender" in str(error)
    assert "lost its state" in str(error), error
