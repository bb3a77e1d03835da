"""The receiving side: lanes, their staging on local disk, and reading them back.

A *lane* is one reader partition. Its receiver runs in the background of the
process that first reads the lane (a Spark Python worker, or the Python
API's process) and outlives the read task, so a ``show()`` that stops
reading early does not stop the transfer. It keeps one rendezvous lobby open,
accepts partition streams on every Dilation connection a sender process
makes, writes each stream to ``<staging>/<transfer>/lane-<n>/`` as an Arrow
IPC stream file while it arrives (memory holds only the Dilation buffers),
renames it into place when the trailer checks out, and only then answers
"complete". When the manifest has arrived and every partition it lists for
the lane is staged, the lane writes ``manifest.json`` there: later actions
(``count()`` after ``show()``) read the staged files and never wait for a
sender again.

One receiver per lane and machine: an ``flock`` on ``lane-<n>/.lock`` elects
it; another process reading the same lane meanwhile follows the staged
files. Lane states (``docs/transfer.md`` has the diagram)::

    STARTING -> RECEIVING (lobby open) -> DONE (manifest + every partition staged)
    RECEIVING -> ABORTED (the sender's abort) | FAILED (a partition lost with an
    earlier incarnation: cannot heal)
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import crochet
import pyarrow as pa
import pyarrow.ipc as ipc

from ..dilation.blocking import BlockingDilationError, DilationTimeout
from ..errors import DilationError, TransferError
from .protocol import (
    CONTROL_SUBPROTOCOL,
    PARTITION_SUBPROTOCOL,
    ROLE_LANE,
    TAG_ABORT,
    TAG_DATA,
    TAG_ERROR,
    TAG_HEADER,
    TAG_MANIFEST,
    TAG_OK,
    TAG_TRAILER,
    Complete,
    LaneBook,
    Manifest,
    PartitionAssembler,
    PartitionHeader,
    ProtocolError,
    Trailer,
    decode_message,
    encode_json,
)
from .rendezvous import RendezvousCancelled, dilate_paired, pair
from .report import is_reconnecting, path_of, reconnects_of
from .spec import TransferSpec

log = logging.getLogger(__name__)

MANIFEST_FILE = "manifest.json"
# How often a read task looks for new staged partitions and the manifest: the
# last partition and the manifest are on the transfer's critical path, and a
# look (a directory listing, a stat, a lock probe) costs ~0.1 ms.
_POLL = 0.05


class TransferAbortedError(TransferError):
    def __init__(self, reason: str) -> None:
        super().__init__(f"the sender aborted the transfer: {reason}")


class CannotHealError(TransferError):
    """Partitions were confirmed to a lane incarnation whose data is gone."""


class LaneIdleError(TransferError, TimeoutError):
    pass


class LaneStaging:
    """Files of one lane: ``p<partition>.arrow`` once complete, ``.partial`` while arriving."""

    def __init__(self, root: Path, transfer_id: str, lane: int) -> None:
        self.dir = Path(root) / transfer_id / f"lane-{lane}"

    def ensure(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)

    def complete_path(self, partition: int) -> Path:
        return self.dir / f"p{partition:06d}.arrow"

    def partial_path(self, partition: int, attempt: int) -> Path:
        return self.dir / f".p{partition:06d}-a{attempt}-{uuid.uuid4().hex[:8]}.partial"

    def complete(self) -> dict[int, Path]:
        out: dict[int, Path] = {}
        if self.dir.is_dir():
            for path in self.dir.glob("p*.arrow"):  # p000123.arrow
                with contextlib.suppress(ValueError):
                    out[int(path.stem[1:])] = path
        return out

    def manifest(self) -> Manifest | None:
        path = self.dir / MANIFEST_FILE
        if not path.exists():
            return None
        return Manifest.from_json(path.read_text())

    def write_manifest(self, manifest: Manifest) -> None:
        tmp = self.dir / f".{MANIFEST_FILE}.tmp"
        tmp.write_text(manifest.to_json())
        os.replace(tmp, self.dir / MANIFEST_FILE)


def read_staged(path: Path) -> Iterator[pa.RecordBatch]:
    with pa.memory_map(str(path)) as source:
        yield from ipc.open_stream(source)


class LaneReceiver:
    """The background receiver of one lane in this process (see the module docstring)."""

    def __init__(self, spec: TransferSpec, lane: int, staging: LaneStaging, lock_fd: int) -> None:
        self.spec = spec
        self.lane = lane
        self.staging = staging
        self.incarnation = uuid.uuid4().hex[:12]
        self.book = LaneBook(spec.transfer_id, lane, spec.lanes, spec.fingerprint)
        self._lock_fd = lock_fd
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._stop_lock = threading.Lock()
        self._connections: list[Any] = []
        self.error: BaseException | None = None
        self.finished = False
        self.last_activity = time.monotonic()
        self.active_streams = 0
        self.connections_made = 0
        self.reconnects = 0
        self.paths: list[str] = []
        for partition in staging.complete():
            # Staged by an earlier incarnation on this machine: still good.
            self.book.completed(partition, -1, _rows_of(staging.complete_path(partition)))

    # --- lifecycle ---------------------------------------------------------------

    def start(self) -> None:
        threading.Thread(target=self._lobby, name=f"lane-{self.lane}-lobby", daemon=True).start()

    def stop(self, linger: float = 2.0) -> None:
        """Close the lobby and every connection (idempotent; waits for a stop under way)."""
        with self._stop_lock:
            self._stop.set()
            with self._cond:
                conns = list(self._connections)
                self._connections.clear()
                self._cond.notify_all()
            for conn in conns:
                with contextlib.suppress(Exception):
                    status = conn.status()
                    self.paths.append(path_of(status.connection))
                    self.reconnects += reconnects_of(status)
                with contextlib.suppress(Exception):
                    conn.close(timeout=10, linger=linger)
            if self._lock_fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(self._lock_fd)
                self._lock_fd = -1

    def live_stats(self) -> tuple[int, int, list[str], int]:
        """(connections made, reconnects, paths, reconnecting now), for progress reports."""
        with self._cond:
            conns = list(self._connections)
        paths = list(self.paths)
        reconnects = self.reconnects
        reconnecting = 0
        for conn in conns:
            with contextlib.suppress(Exception):
                status = conn.status()
                paths.append(path_of(status.connection))
                reconnects += reconnects_of(status)
                reconnecting += is_reconnecting(status)
        return self.connections_made, reconnects, paths, reconnecting

    def wait_finished(self) -> BaseException | None:
        """Block until the lane is done or failed, or idle for ``idle_timeout``; its error."""
        idle = self.spec.options.idle_timeout
        with self._cond:
            while not self.finished:
                self._cond.wait(0.5)
                quiet = time.monotonic() - self.last_activity
                if quiet > idle and not self.active_streams and not self.finished:
                    self.finished = True
                    self.error = LaneIdleError(
                        f"lane {self.lane} heard nothing from the sender for {idle:g} s (no "
                        "new connection, no data, no final manifest). Check that the writer "
                        "is still running, or raise option idle_timeout"
                    )
            return self.error

    def _finish(self, error: BaseException | None = None) -> None:
        with self._cond:
            if self.finished:
                return
            self.finished = True
            self.error = error
            self._cond.notify_all()
        threading.Thread(target=self.stop, daemon=True).start()

    # --- lobby and connections -----------------------------------------------------

    def _lobby(self) -> None:
        opts = self.spec.options
        slot = 0
        while not self._stop.is_set():
            try:
                paired = pair(
                    mailbox_url=opts.mailbox_url,
                    secret=self.spec.secret,
                    transfer_id=self.spec.transfer_id,
                    lane=self.lane,
                    role=ROLE_LANE,
                    start_slot=slot,
                    cancel=self._stop,
                    what=f"senders of lane {self.lane}",
                )
                slot = paired.slot + 1
                conn = dilate_paired(
                    paired,
                    relay_url=opts.relay_url,
                    no_listen=opts.no_listen,
                    listen=(PARTITION_SUBPROTOCOL, CONTROL_SUBPROTOCOL),
                    peer_timeout=opts.reconnect_timeout,
                    timeout=opts.reconnect_timeout,
                )
            except (RendezvousCancelled, crochet.ReactorStopped):
                return  # stopped, or the process is exiting (a CLI after its transfer)
            except DilationError as e:  # mailbox unreachable and the like
                log.warning("lane %d: rendezvous failed: %s", self.lane, e)
                self._finish(e)
                return
            with self._cond:
                if self._stop.is_set():
                    threading.Thread(target=conn.close, daemon=True).start()
                    return
                self._connections.append(conn)
                self.connections_made += 1
                self.last_activity = time.monotonic()
            for name, handler in (
                (PARTITION_SUBPROTOCOL, self._partition),
                (CONTROL_SUBPROTOCOL, self._control),
            ):
                threading.Thread(
                    target=self._accept_loop, args=(conn, name, handler), daemon=True
                ).start()

    def _accept_loop(self, conn: Any, name: str, handler: Any) -> None:
        while not self._stop.is_set():
            try:
                channel = conn.accept(name, timeout=0.5)
            except DilationTimeout:
                continue
            except BlockingDilationError as e:
                log.info("lane %d: a sender connection ended: %s", self.lane, e)
                with self._cond:
                    if conn in self._connections:
                        self._connections.remove(conn)
                        # Keep what it did for the report and the progress lines.
                        with contextlib.suppress(Exception):
                            status = conn.status()
                            self.paths.append(path_of(status.connection))
                            self.reconnects += reconnects_of(status)
                return
            threading.Thread(target=self._guard, args=(handler, channel), daemon=True).start()

    def _guard(self, handler: Any, channel: Any) -> None:
        try:
            handler(channel)
        except (DilationError, OSError) as e:
            log.info("lane %d: a stream ended early: %s", self.lane, e)
        except Exception:
            log.exception("lane %d: unexpected error in a stream", self.lane)
        finally:
            with contextlib.suppress(Exception):
                channel.close(timeout=5)

    def _touch(self) -> None:
        with self._cond:
            self.last_activity = time.monotonic()

    # --- one partition stream -------------------------------------------------------

    def _partition(self, channel: Any) -> None:
        opts = self.spec.options
        wait = opts.reconnect_timeout
        first = channel.receive(timeout=wait)
        if first is None:
            return
        tag, body = decode_message(first)
        if tag != TAG_HEADER:
            raise ProtocolError(f"a partition stream must start with a header, not {tag!r}")
        header = PartitionHeader.from_body(body)
        with self._cond:
            decision = self.book.begin(header)
            self.active_streams += 1
        try:
            if decision.action == "refuse":
                channel.send(encode_json(TAG_ERROR, {"error": decision.reason}))
                return
            self._receive_stream(channel, header, decision.action == "discard")
        finally:
            with self._cond:
                self.active_streams -= 1
                self._cond.notify_all()

    def _receive_stream(self, channel: Any, header: PartitionHeader, discard: bool) -> None:
        wait = self.spec.options.reconnect_timeout
        assembler = PartitionAssembler(header)
        partial = None if discard else self.staging.partial_path(header.partition, header.attempt)
        out = open(partial, "wb") if partial else None
        try:
            while True:
                message = channel.receive(timeout=wait)
                if message is None:
                    raise TransferError(
                        f"partition {header.partition} attempt {header.attempt} ended before "
                        "its trailer; the attempt is dropped"
                    )
                tag, body = decode_message(message)
                if tag == TAG_DATA:
                    assembler.data(body)
                    if out is not None:
                        out.write(body)
                    self._touch()
                elif tag == TAG_TRAILER:
                    trailer = Trailer.from_body(body)
                    assembler.finish(trailer)
                    break
                else:
                    raise ProtocolError(f"unexpected {tag!r} inside a partition stream")
            if out is not None:
                out.close()
                out = None
            with self._cond:
                kept = partial is not None and self.book.completed(
                    header.partition, header.attempt, trailer.rows
                )
                if kept:
                    assert partial is not None
                    os.replace(partial, self.staging.complete_path(header.partition))
                    partial = None
                self._cond.notify_all()
            channel.send(
                Complete(
                    header.partition,
                    header.attempt,
                    self.lane,
                    self.incarnation,
                    trailer.rows,
                    duplicate=not kept,
                ).encode()
            )
            self._check_done()
        finally:
            if out is not None:
                out.close()
            if partial is not None:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(partial)

    # --- control: manifest, abort ----------------------------------------------------

    def _control(self, channel: Any) -> None:
        message = channel.receive(timeout=self.spec.options.reconnect_timeout)
        if message is None:
            return
        tag, body = decode_message(message)
        if tag == TAG_MANIFEST:
            manifest = Manifest.from_body(body)
            with self._cond:
                self.book.got_manifest(manifest)
                self._cond.notify_all()
            # Answer first, then finish: finishing closes this connection.
            error = self._check_done(finish=False)
            if error is not None:
                channel.send(encode_json(TAG_ERROR, {"error": str(error)}))
                self._finish(error)
            else:
                channel.send(encode_json(TAG_OK, {}))
                with self._cond:
                    done = self.book.done()
                if done:
                    self._finish(None)
        elif tag == TAG_ABORT:
            reason = str(body.get("reason", "no reason given"))
            with self._cond:
                self.book.aborted = reason
            channel.send(encode_json(TAG_OK, {}))
            self._finish(TransferAbortedError(reason))
        else:
            channel.send(encode_json(TAG_ERROR, {"error": f"unexpected {tag!r}"}))

    def _check_done(self, finish: bool = True) -> CannotHealError | None:
        """Finish the lane if the manifest and every listed partition are here.

        Returns the cannot-heal error (also raised to readers) when a listed
        partition was confirmed to an earlier incarnation whose data is gone:
        its sender task succeeded, so it will never come again.
        """
        with self._cond:
            manifest = self.book.manifest
            if manifest is None:
                return None
            if self.finished:
                return self.error if isinstance(self.error, CannotHealError) else None
            missing = self.book.missing()
            lost = [c for c in missing if c.incarnation != self.incarnation]
            if lost:
                error = CannotHealError(
                    f"lane {self.lane} cannot heal: partitions "
                    f"{', '.join(str(c.partition) for c in lost)} were confirmed to an "
                    "earlier run of this lane whose staged data is gone (its process or "
                    "machine was lost after receiving them, and their sender tasks have "
                    "finished). Nothing was emitted twice or lost silently; send the dataset "
                    "again with a new code"
                )
                if not finish:
                    return error
                self.finished = True
                self.error = error
                self._cond.notify_all()
                threading.Thread(target=self.stop, daemon=True).start()
                return error
            if missing:
                return None
            self.book.check_rows()
            self.staging.write_manifest(manifest)
        log.info("lane %d: done, %d partitions", self.lane, len(manifest.for_lane(self.lane)))
        if finish:
            self._finish(None)
        return None


def _rows_of(path: Path) -> int:
    with pa.memory_map(str(path)) as source:
        return sum(b.num_rows for b in ipc.open_stream(source))


def _attempt() -> int:
    """The Spark task attempt number of the current read task (0 outside Spark)."""
    try:
        from pyspark import TaskContext

        ctx = TaskContext.get()
        return ctx.attemptNumber() if ctx is not None else 0
    except ImportError:
        return 0


# --- the per-process registry ---------------------------------------------------------------

_registry_lock = threading.Lock()
_receivers: dict[tuple[str, int], LaneReceiver] = {}


def lane_receiver(spec: TransferSpec, lane: int) -> LaneReceiver | None:
    """This process's receiver of ``lane``, started if this process wins the lane's lock.

    None if another process on this machine holds it (follow its staged files).
    """
    key = (spec.transfer_id, lane)
    with _registry_lock:
        current = _receivers.get(key)
        if current is not None and not (current.finished and current.error is not None):
            return current
        staging = LaneStaging(spec.options.staging_root, spec.transfer_id, lane)
        fd = take_lane_lock(staging)
        if fd is None:
            return None
        if current is not None:
            _receivers.pop(key, None)
        receiver = LaneReceiver(spec, lane, staging, fd)
        _receivers[key] = receiver
        receiver.start()
        return receiver


def take_lane_lock(staging: LaneStaging) -> int | None:
    """The lane's lock on this machine (its file descriptor), or None if a process holds it."""
    staging.ensure()
    fd = os.open(staging.dir / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def read_lane(spec: TransferSpec, lane: int) -> Iterator[pa.RecordBatch]:
    """Every row the lane receives, once: staged partitions as they complete.

    The receiver runs in a lane host process (:mod:`.lanehost`) started on
    first use (or during ``load()``, with early lanes), so the transfer goes
    on when Spark ends or kills the Python worker of this task (``show()``
    stops reading early; idle workers are killed); this generator follows
    the staged files. Yields Arrow batches with the transfer's schema. Raises
    when the sender aborts, a partition cannot heal, or the lane hears
    nothing for ``idle_timeout``.
    """
    staging = LaneStaging(spec.options.staging_root, spec.transfer_id, lane)
    emitted: set[int] = set()
    faults = _Faults(spec.options.test_fail, lane, staging)
    manifest = staging.manifest()
    if manifest is not None:
        yield from _emit_manifest(staging, manifest, lane, emitted, faults)
        return
    staging.ensure()
    ensure_host(spec, lane, staging)
    while True:
        _raise_host_error(staging)
        complete = sorted(staging.complete().items())
        if complete:
            faults.before_rows()
        for partition, path in complete:
            if partition not in emitted:
                emitted.add(partition)
                yield from read_staged(path)
                faults.after_rows()
        manifest = staging.manifest()
        if manifest is not None:
            yield from _emit_manifest(staging, manifest, lane, emitted, faults)
            return
        if not host_alive(staging):
            _raise_host_error(staging)
            if staging.manifest() is None:
                log.warning("lane %d: its receiver process ended; starting another", lane)
                ensure_host(spec, lane, staging)
        time.sleep(_POLL)


class _Faults:
    """Test-only fault injection of a read task (option ``test_fail``), first attempt only."""

    def __init__(self, test_fail: str, lane: int, staging: LaneStaging) -> None:
        self.armed = bool(test_fail) and _attempt() == 0
        self.test_fail, self.lane, self.staging = test_fail, lane, staging

    def before_rows(self) -> None:
        if self.armed and "lane-before-rows" in self.test_fail:
            raise TransferError(f"test_fail: lane {self.lane} fails before emitting rows")

    def after_rows(self) -> None:
        if self.armed and self.lane == 0 and "lane-after-rows" in self.test_fail:
            _lose_lane(self.staging)
            raise TransferError(
                f"test_fail: lane {self.lane} fails after emitting rows, losing its staging"
            )


# --- lane host processes --------------------------------------------------------------------

ERROR_FILE = "error.json"


def write_host_error(staging: LaneStaging, error: BaseException) -> None:
    """The lane's error for its read tasks, and copies elsewhere (hostlink's error record)."""
    from .hostlink import error_record

    tmp = staging.dir / f".{ERROR_FILE}.tmp"
    tmp.write_text(json.dumps(error_record(error)))
    os.replace(tmp, staging.dir / ERROR_FILE)


def _raise_host_error(staging: LaneStaging) -> None:
    from .hostlink import rebuild_error

    path = staging.dir / ERROR_FILE
    if not path.exists():
        return
    raise rebuild_error(json.loads(path.read_text()))


def host_alive(staging: LaneStaging) -> bool:
    """Whether a process holds the lane's lock (a live receiver)."""
    if not staging.dir.is_dir():
        return False  # removed: its host ended with the application
    fd = os.open(staging.dir / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # also drops the lock if we got it
    return False


def start_lanes(spec: TransferSpec, wait: float = 60.0) -> None:
    """Start every lane's host process now (early lanes), then wait until each runs.

    The read tasks that come later find the hosts alive and follow their
    staged files, exactly as a second action does.
    """
    started = []
    for lane in range(spec.lanes):
        staging = LaneStaging(spec.options.staging_root, spec.transfer_id, lane)
        staging.ensure()
        started.append((lane, staging, _spawn_host(spec, lane, staging)))
    for lane, staging, proc in started:
        _wait_host(lane, staging, proc, wait)


def ensure_host(spec: TransferSpec, lane: int, staging: LaneStaging, wait: float = 60.0) -> None:
    """Start the lane's host process unless one runs; wait until it holds the lock."""
    _wait_host(lane, staging, _spawn_host(spec, lane, staging), wait)


def _spawn_host(spec: TransferSpec, lane: int, staging: LaneStaging) -> Any:
    """A new lane host process, or None if one already holds the lane's lock."""
    import pickle
    import subprocess
    import sys

    if host_alive(staging):
        return None
    staging.ensure()
    spec_path = staging.dir / f".spec-{uuid.uuid4().hex}.pkl"
    fd = os.open(spec_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # holds the secret
    with os.fdopen(fd, "wb") as f:
        pickle.dump(spec, f)
    with open(staging.dir / "host.log", "ab") as log_file:
        proc = subprocess.Popen(
            [sys.executable, "-m", "spark_dilation.transfer.lanehost", str(spec_path), str(lane)],
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=log_file,
            start_new_session=True,  # outlives this worker, and Spark's kills of its group
            close_fds=True,
        )
    return proc


def _wait_host(lane: int, staging: LaneStaging, proc: Any, wait: float) -> None:
    if proc is None:
        return
    deadline = time.monotonic() + wait
    while not host_alive(staging):
        if proc.poll() is not None:
            if host_alive(staging) or staging.manifest() is not None:
                return  # another process won the lock, or the lane is already done
            _raise_host_error(staging)
            raise TransferError(
                f"lane {lane}: its receiver process exited with code {proc.returncode}; "
                f"see {staging.dir / 'host.log'}"
            )
        if time.monotonic() > deadline:
            raise TransferError(f"lane {lane}: its receiver process did not start in {wait:g} s")
        time.sleep(0.05)


def _lose_lane(staging: LaneStaging) -> None:
    """Test-only: what losing the lane's machine does (receiver and staged files gone)."""
    import signal

    pid_file = staging.dir / "host.pid"
    if pid_file.exists():
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid_file.read_text()), signal.SIGKILL)
    deadline = time.monotonic() + 10
    while host_alive(staging) and time.monotonic() < deadline:
        time.sleep(0.05)
    for path in staging.complete().values():
        path.unlink(missing_ok=True)


def _emit_manifest(
    staging: LaneStaging,
    manifest: Manifest,
    lane: int,
    emitted: set[int],
    faults: _Faults | None = None,
) -> Iterator[pa.RecordBatch]:
    complete = staging.complete()
    if faults is not None and manifest.for_lane(lane):
        faults.before_rows()
    for c in manifest.for_lane(lane):
        if c.partition in emitted:
            continue
        path = complete.get(c.partition)
        if path is None:
            raise CannotHealError(
                f"lane {lane} cannot heal: the staged data of partition {c.partition} is gone "
                f"(staging directory {staging.dir}) and its sender has finished. Keep the "
                "staging directory while the DataFrame is in use, or send the dataset again"
            )
        emitted.add(c.partition)
        yield from read_staged(path)
        if faults is not None:
            faults.after_rows()
    extra = emitted - {c.partition for c in manifest.for_lane(lane)}
    if extra:
        # Cannot happen with Spark's commit protocol; never silently.
        raise CannotHealError(
            f"lane {lane} emitted partitions {sorted(extra)} that the sender did not commit"
        )


def lane_connection_statuses() -> list[Any]:
    """Dilation status of every live lane connection in this process (monitoring, tests)."""
    with _registry_lock:
        receivers = list(_receivers.values())
    statuses = []
    for receiver in receivers:
        with receiver._cond:
            conns = list(receiver._connections)
        for conn in conns:
            with contextlib.suppress(DilationError):
                statuses.append(conn.status())
    return statuses
