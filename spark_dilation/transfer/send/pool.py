"""The sending side: the per-process connection pool, partition streams, manifest delivery.

A sender process (a Spark Python worker, or the single process of the
Python API) keeps at most one Dilation connection per lane of a transfer in
:class:`ConnectionPool`, made through the rendezvous and reused by every
partition it sends to that lane, each on its own subchannel. The pool is a
cache: Spark may kill the worker when it is idle, and a broken connection is
evicted and made again by the next partition.

A lane may end the whole transfer from the receiving side (``A`` on a
control subchannel it opens: cancelled, or failed there): the pool hears it
on every connection it made and fails the transfer at once
(:meth:`ConnectionPool.fail`): streams under way are cut, every partition of
it raises the lane's reason (:class:`TransferAbortedError`) and none is sent
again. A local cancel uses the same cut.

A partition attempt's states are :data:`..rules.states.SENDER_TASK`, applied
in :class:`_Attempt` alone: CONNECTING --subchannel open--> STREAMING
--trailer sent--> AWAITING_COMPLETE --"C"--> COMMITTED (the task may
succeed); any of them --error, "E", deadline--> FAILED (the lane drops it).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import socket
import threading
import time
from collections.abc import Iterable
from typing import Any

import crochet
import pyarrow as pa

from ...dilation.blocking import BlockingDilationError, DilationTimeout
from ...errors import DilationError, TransferError
from ..meet.rendezvous import (
    CLOSE_WAIT,
    DoorSpoiled,
    Paired,
    RendezvousCancelled,
    claim_door,
    close_wormhole,
    dilate_paired,
    lost_state,
    unreachable,
)
from ..meet.views import SenderView, registered_view, sender_view
from ..rules.directory import Door
from ..rules.errors import (
    InjectedFailure,
    LaneLostError,
    LaneNotStartedError,
    LaneRefusedError,
    ReceiverFailedError,
    TransferAbortedError,
)
from ..rules.meeting import Outcome, Step
from ..rules.protocol import (
    CONTROL_SUBPROTOCOL,
    PARTITION_SUBPROTOCOL,
    ROLE_SENDER,
    TAG_ABORT,
    TAG_COMPLETE,
    TAG_ERROR,
    TAG_OK,
    Abort,
    CommittedPartition,
    Complete,
    decode_message,
    encode_json,
    lane_answer,
    lane_of,
)
from ..rules.report import ConnectionStats, path_of, tally
from ..rules.spec import TransferSpec
from ..rules.states import SENDER_TASK, Task, TaskEvent
from . import meter
from .stream import PartitionStream

log = logging.getLogger(__name__)

__all__ = [
    "ConnectionPool",
    "InjectedFailure",
    "LaneLostError",
    "LaneNotStartedError",
    "LaneRefusedError",
    "ReceiverFailedError",
    "pool",
    "send_partition",
    "stream_partition",
]


def process_name() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


WATCH_INTERVAL = 0.5


class _Meeting:
    """One background meeting of a pool with a lane's current host (see ConnectionPool)."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.cancel = threading.Event()
        self.conn: Any = None
        self.error: BaseException | None = None
        self.thread: threading.Thread | None = None
        self.wormhole: Any = None  # the door's wormhole now: why the mailbox is not reached
        self.spoiled: DoorSpoiled | None = None  # the last door a stranger was on


class ConnectionPool:
    """Dilation connections of this process, one per (transfer, lane); thread-safe.

    Each is made through the lane's door (:mod:`..rules.directory`): this process's
    view of the transfer's directory says which. A meeting runs in the
    background and is never given up before it pairs, except when the lane's
    epoch rises (its host was replaced: the meeting moves to the new door) or
    the transfer ends: a caller whose deadline passes fails
    (``lane_start_timeout``) while the meeting goes on, so the door sequence
    has no holes and the next caller finds the connection made. When the
    reading end re-hosts a lane, the pool swaps in a connection to the new
    host at once; partitions in flight on the old one fail as retryable
    losses and go again (the lane keeps the first complete attempt, so
    nothing doubles).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._conns: dict[tuple[str, int], Any] = {}
        self._meetings: dict[tuple[str, int], _Meeting] = {}
        # key -> (spec, door) of the pooled connection
        self._paired: dict[tuple[str, int], tuple[TransferSpec, Door]] = {}
        self._listening: set[str] = set()  # transfers whose epoch pushes this pool hears
        self._watcher: threading.Thread | None = None
        self.opened: dict[str, int] = {}  # transfer -> connections opened
        self.paths: dict[str, list[str]] = {}
        self._failed: dict[str, BaseException] = {}  # transfer -> why it ended (first wins)
        self._streams: dict[str, set[Any]] = {}  # transfer -> partition subchannels under way
        self._ending: dict[str, threading.Event] = {}  # transfer -> set by fail(): stop pairing

    def get(self, spec: TransferSpec, lane: int, deadline: float, what: str = "a partition") -> Any:
        key = (spec.transfer_id, lane)
        with self._lock:
            conn = self._conns.get(key)
        if conn is not None and conn._error is None and not conn._closed:
            return conn
        # A connection that found no path, or was given up, is made again on the
        # lane's next door (its host opened it when this one paired).
        if conn is not None:
            self.evict(spec.transfer_id, lane, conn)
        meeting = self._meeting(spec, lane)
        ended = self._ended_event(spec.transfer_id)
        while not meeting.done.wait(0.25):
            if ended.is_set():
                raise self.failure(spec.transfer_id) or TransferError("cancelled")
            if time.monotonic() >= deadline:
                # The true cause: a mailbox server never reached, or a stranger on the
                # lane's doors, is not a lane never hosted.
                if meeting.spoiled is not None:
                    raise TransferError(
                        f"{what}: {meeting.spoiled}, and its host did not come to the next "
                        f"door within {spec.options.lane_start_timeout:g} s "
                        "(lane_start_timeout)"
                    )
                view = registered_view(spec.transfer_id)  # the writing end's, in-process
                link = view.link_lost_state() if view is not None else ""
                if lost := lost_state(meeting.wormhole) or link:
                    raise TransferError(
                        f"{what}: lane {lane} did not pair within "
                        f"{spec.options.lane_start_timeout:g} s (lane_start_timeout){lost}"
                    )
                raise unreachable(meeting.wormhole, spec) or LaneNotStartedError(
                    lane, spec.lanes, spec.options.lane_start_timeout, what, spec.options
                )
        if isinstance(meeting.error, RendezvousCancelled):
            raise self.failure(spec.transfer_id) or TransferError("cancelled") from None
        if meeting.error is not None:
            raise meeting.error
        return meeting.conn

    def _meeting(self, spec: TransferSpec, lane: int) -> _Meeting:
        """The meeting under way for ``lane``, or a new one."""
        key = (spec.transfer_id, lane)
        with self._lock:
            meeting = self._meetings.get(key)
            if meeting is None or meeting.done.is_set():
                meeting = self._meetings[key] = _Meeting()
                meeting.thread = threading.Thread(
                    target=self._meet, args=(spec, lane, meeting), name="lane-meeting", daemon=True
                )
                meeting.thread.start()
        return meeting

    def _adopt(self, key: tuple[str, int], spec: TransferSpec, paired: Paired, conn: Any) -> None:
        self._conns[key] = conn
        self._paired[key] = (spec, paired.door)
        self.opened[spec.transfer_id] = self.opened.get(spec.transfer_id, 0) + 1
        if self._watcher is None:
            self._watcher = threading.Thread(target=self._watch, name="lane-watch", daemon=True)
            self._watcher.start()

    def _view(self, spec: TransferSpec) -> SenderView:
        view = sender_view(spec, time.monotonic() + spec.options.lane_start_timeout)
        with self._lock:
            hear = spec.transfer_id not in self._listening
            self._listening.add(spec.transfer_id)
        if hear:
            view.listen(lambda epochs: self._rehosted(spec, epochs))
        return view

    def _meet(self, spec: TransferSpec, lane: int, meeting: _Meeting) -> None:
        """Meet ``lane``'s current host at its door and pool the connection (a thread)."""
        key = (spec.transfer_id, lane)
        ended = self._ended_event(spec.transfer_id)
        what = f"lane {lane}"

        def stopped() -> bool:
            return ended.is_set() or meeting.cancel.is_set()

        try:
            view = self._view(spec)
            state = view.meeting(lane, what)  # the sender meeting table (rules/meeting.py)
            while True:
                door = view.next_door(state, float("inf"), stopped)
                # The claim also ends when the writing end's end comes (its hub gone, the
                # reading end's abort): a meeting of a reused Spark worker must not keep
                # its claim for life. So does the lane's end for good, or a new epoch.
                outcome, got = claim_door(
                    spec, door, ROLE_SENDER,
                    cancelled=lambda: view.stale(state, stopped()),
                    what=what, started=lambda w: setattr(meeting, "wormhole", w),
                )  # fmt: skip
                step = view.claimed(state, outcome, stopped())
                if step is Step.NEXT:
                    if outcome is Outcome.SPOILED:  # it costs this attempt: the lane moves on
                        log.warning(
                            "lane %d of transfer %s: %s; next door", lane, spec.transfer_id, got
                        )
                        meeting.spoiled = got
                    elif state.reported == door:  # the lane's side found the stranger
                        meeting.spoiled = DoorSpoiled(
                            f"a stranger was on the door to {what} (the lane found it there, "
                            f"attempt {door.attempt})"
                        )
                    continue
                if step is Step.CLOSE_NEXT:  # paired, but the lane was re-hosted meanwhile
                    close_wormhole(got)
                    continue
                if step is Step.STOP:
                    raise RendezvousCancelled(f"stopped meeting {what}")
                if step is Step.FAIL:
                    raise got
                w = got
                paired = Paired(w, door)
                conn = self._dilate(spec, lane, paired)
                with self._lock:
                    old = self._conns.get(key)
                    if not stopped():
                        self._adopt(key, spec, paired, conn)
                if stopped():
                    _quiet_close(conn, 0.0)
                    raise RendezvousCancelled(f"stopped meeting {what}")
                if old is not None and old is not conn:
                    log.warning(
                        "lane %d of transfer %s: its receiver was replaced (now epoch %d); "
                        "partitions in flight go again to the new one",
                        lane, spec.transfer_id, door.epoch,
                    )  # fmt: skip
                    threading.Thread(target=_quiet_close, args=(old, 0.0), daemon=True).start()
                meeting.conn = conn
                return
        except crochet.ReactorStopped as e:  # the process is exiting
            meeting.error = TransferError(f"stopped meeting {what}: {e}")
        except BaseException as e:
            meeting.error = e
        finally:
            meeting.done.set()

    def _dilate(self, spec: TransferSpec, lane: int, paired: Paired) -> Any:
        opts = spec.options
        conn = dilate_paired(
            paired,
            relay_url=opts.relay_url,
            no_listen=opts.no_listen,
            listen=(CONTROL_SUBPROTOCOL,),  # the lane's abort (the receiving side ended)
            peer_timeout=opts.reconnect_timeout,
            timeout=opts.reconnect_timeout,
            no_path_timeout=opts.no_path_timeout,
        )
        door = paired.door
        log.info(
            "connected to lane %d of transfer %s (epoch %d, sender %d, attempt %d)",
            lane, spec.transfer_id, door.epoch, door.sender, door.attempt,
        )  # fmt: skip
        threading.Thread(
            target=self._hear_lane, args=(spec.transfer_id, lane, conn), daemon=True
        ).start()
        return conn

    # --- re-hosted lanes -------------------------------------------------------------

    def _watch(self) -> None:
        """compression=auto's link meter: what each connection's lane acknowledged."""
        while True:
            time.sleep(WATCH_INTERVAL)
            with self._lock:
                conns = list(self._conns.items())
            now = time.monotonic()
            progress: dict[str, tuple[dict[object, int], dict[object, int]]] = {}
            for key, conn in conns:
                try:
                    status = conn.status()
                except DilationError:
                    continue
                except crochet.ReactorStopped:  # the process is exiting
                    return
                acked, queued = progress.setdefault(key[0], ({}, {}))
                # By id: the meter must not keep closed connections alive.
                acked[id(conn)], queued[id(conn)] = status.acked_bytes, status.queued_bytes
            for transfer_id, (acked, queued) in progress.items():
                meter.note_progress(transfer_id, now, acked, queued)

    def _rehosted(self, spec: TransferSpec, epochs: dict[int, int]) -> None:
        """The directory's push: these lanes have a new host; meet it now (the meeting
        swaps the pooled connection when it pairs)."""
        for lane, epoch in epochs.items():
            with self._lock:
                entry = self._paired.get((spec.transfer_id, lane))
            if entry is not None and entry[1].epoch < epoch:
                self._meeting(spec, lane)

    def _hear_lane(self, transfer_id: str, lane: int, conn: Any) -> None:
        """Accept the lane's control subchannels until the connection closes."""
        while True:
            try:
                channel = conn.accept(CONTROL_SUBPROTOCOL, timeout=1.0)
            except DilationTimeout:
                continue
            except DilationError:
                return  # closed, gone or no path: nothing more to hear on it
            try:
                with channel:
                    message = channel.receive(timeout=5.0)
                    if message is None:
                        continue
                    tag, body = decode_message(message)
                    if tag != TAG_ABORT:
                        channel.send(encode_json(TAG_ERROR, {"error": f"unexpected {tag!r}"}))
                        continue
                    channel.send(encode_json(TAG_OK, {}))
            except (DilationError, OSError) as e:
                log.info("lane %d: a control stream ended early: %s", lane, e)
                continue
            abort = Abort.from_body(body)
            log.info("lane %d: %s", lane, abort.text("receiver"))
            self.fail(transfer_id, TransferAbortedError(abort.text("receiver")))

    def fail(self, transfer_id: str, error: BaseException) -> None:
        """End the transfer here: cut its streams under way; its partitions raise ``error``.

        The first call wins (a cancel, or the receiver's abort). Connections
        stay open, so the sender can still tell the lanes (:func:`deliver_abort`).
        """
        with self._lock:
            if transfer_id in self._failed:
                return
            self._failed[transfer_id] = error
            streams = list(self._streams.pop(transfer_id, ()))
        self._ended_event(transfer_id).set()  # a partition still pairing stops too
        for channel in streams:
            # No trailer: each lane drops its attempt; a blocked send() raises at once.
            with contextlib.suppress(Exception):
                channel.close(timeout=5)

    def lanes_connected(self, transfer_id: str) -> list[int]:
        """The lanes of the transfer this pool holds a live connection to."""
        with self._lock:
            return sorted(
                lane
                for (t, lane), c in self._conns.items()
                if t == transfer_id and c._error is None and not c._closed
            )

    def _ended_event(self, transfer_id: str) -> threading.Event:
        with self._lock:
            return self._ending.setdefault(transfer_id, threading.Event())

    def failure(self, transfer_id: str) -> BaseException | None:
        """A copy of why the transfer ended here (each raiser gets its own), or None."""
        with self._lock:
            error = self._failed.get(transfer_id)
        return None if error is None else copy.copy(error)

    def receiver_ended(self, transfer_id: str) -> bool:
        """Whether the receiving side ended the transfer (so it need not be told)."""
        with self._lock:
            return isinstance(self._failed.get(transfer_id), TransferAbortedError)

    def _track(self, transfer_id: str, channel: Any) -> bool:
        """Register a partition stream under way; False if the transfer already ended."""
        with self._lock:
            if transfer_id in self._failed:
                return False
            self._streams.setdefault(transfer_id, set()).add(channel)
            return True

    def _untrack(self, transfer_id: str, channel: Any) -> None:
        with self._lock:
            self._streams.get(transfer_id, set()).discard(channel)

    def evict(self, transfer_id: str, lane: int, conn: Any = None) -> None:
        with self._lock:
            current = self._conns.get((transfer_id, lane))
            if conn is None or current is conn:
                self._conns.pop((transfer_id, lane), None)
            else:
                return
        if current is not None:
            threading.Thread(target=_quiet_close, args=(current,), daemon=True).start()

    def _statuses(self, transfer_id: str) -> list[Any]:
        """The status of each of the transfer's pooled connections still answering."""
        with self._lock:
            conns = [c for (t, _), c in self._conns.items() if t == transfer_id]
        statuses = []
        for c in conns:
            with contextlib.suppress(DilationError):
                statuses.append(c.status())
        return statuses

    def stats(self, transfer_id: str) -> ConnectionStats:
        with self._lock:
            opened = self.opened.get(transfer_id, 0)
        seen = tally(self._statuses(transfer_id))
        return ConnectionStats(
            process_name(),
            opened,
            seen.reconnects,
            seen.paths,
            seen.reconnecting,
            seen.relay_fallbacks,
            seen.connecting,
        )

    def link_bytes(self, transfer_id: str) -> tuple[int, int]:
        """(bytes the lanes acknowledged, bytes sent and not yet acknowledged) on the
        transfer's live connections, Dilation framing included."""
        statuses = self._statuses(transfer_id)
        return sum(s.acked_bytes for s in statuses), sum(s.queued_bytes for s in statuses)

    def close_transfer(self, transfer_id: str, linger: float = 2.0) -> None:
        """Close the transfer's connections (in parallel; ``linger``: see BlockingDilation)
        and end its meetings under way (each closes its wormhole on the mailbox)."""
        with self._lock:
            keys = [k for k in self._conns if k[0] == transfer_id]
            conns = [self._conns.pop(k) for k in keys]
            for k in keys:
                self._paired.pop(k, None)
            meetings = [m for k, m in self._meetings.items() if k[0] == transfer_id]
            for k in [k for k in self._meetings if k[0] == transfer_id]:
                del self._meetings[k]
        for meeting in meetings:
            meeting.cancel.set()
        for meeting in meetings:
            if meeting.thread is not None and meeting.thread is not threading.current_thread():
                meeting.thread.join(CLOSE_WAIT + 1)
        closing = [
            threading.Thread(target=_quiet_close, args=(c, linger), daemon=True) for c in conns
        ]
        for t in closing:
            t.start()
        for t in closing:
            t.join()


def _quiet_close(conn: Any, linger: float = 2.0) -> None:
    try:
        conn.close(timeout=10, linger=linger)
    except Exception as e:  # teardown
        log.info("closing a pooled connection: %s", e)


_POOL = ConnectionPool()


def pool() -> ConnectionPool:
    """This process's pool (one per Python worker; it survives between tasks)."""
    return _POOL


def send_partition(
    spec: TransferSpec,
    partition: int,
    attempt: int,
    batches: Iterable[pa.RecordBatch],
    *,
    connections: ConnectionPool | None = None,
) -> CommittedPartition:
    """Stream one partition to its lane and wait for "complete" (blocking).

    Raises :class:`LaneNotStartedError`, :class:`LaneLostError` (retryable:
    nothing of this attempt is kept by the lane), :class:`LaneRefusedError`.
    """
    stream = PartitionStream(spec, partition, attempt)
    done = stream_partition(spec, partition, stream.messages(batches), connections=connections)
    return stream.committed(done, lane_of(partition, spec.lanes))


class _Attempt:
    """One partition attempt's state (:data:`..rules.states.SENDER_TASK`); logs its end."""

    def __init__(self, transfer_id: str, partition: int, lane: int) -> None:
        self.state = SENDER_TASK.initial
        self.what = f"partition {partition} to lane {lane} of transfer {transfer_id}"

    def to(self, event: TaskEvent) -> None:
        before, self.state = self.state, SENDER_TASK.next(self.state, event)
        if self.state is Task.FAILED and before is not Task.FAILED:
            log.debug("%s: %s ended %s", self.what, before.value, self.state.value)


def stream_partition(
    spec: TransferSpec,
    partition: int,
    messages: Iterable[bytes],
    *,
    connections: ConnectionPool | None = None,
) -> Complete:
    """Send a partition's messages (header first, trailer last) on a new subchannel.

    Returns the lane's "complete" answer. If ``messages`` raises before the
    trailer, the subchannel closes without it and the lane drops the attempt.
    """
    connections = connections or pool()
    lane = lane_of(partition, spec.lanes)
    tid = spec.transfer_id
    attempt = _Attempt(tid, partition, lane)
    try:
        complete = _stream(spec, partition, messages, connections, lane, attempt)
    except BaseException:
        attempt.to(TaskEvent.FAILED)
        raise
    attempt.to(TaskEvent.COMPLETE)
    return complete


def _stream(
    spec: TransferSpec,
    partition: int,
    messages: Iterable[bytes],
    connections: ConnectionPool,
    lane: int,
    attempt: _Attempt,
) -> Complete:
    opts = spec.options
    tid = spec.transfer_id
    ended = connections.failure(tid)
    if ended is not None:
        raise ended
    deadline = time.monotonic() + opts.lane_start_timeout
    conn = connections.get(spec, lane, deadline)
    try:
        channel = conn.open(PARTITION_SUBPROTOCOL, timeout=opts.lane_start_timeout)
    except BlockingDilationError as e:
        connections.evict(tid, lane, conn)
        raise connections.failure(tid) or LaneLostError(
            f"could not open a subchannel to lane {lane}: {e}"
        ) from e
    if not connections._track(tid, channel):
        channel.close()
        raise connections.failure(tid) or AssertionError("unreachable")
    path = _path(conn)
    meter.note_path(tid, path)  # compression=auto decides with it (partition.py)
    attempt.to(TaskEvent.OPENED)
    try:
        for message in messages:
            channel.send(message, timeout=opts.reconnect_timeout)
        attempt.to(TaskEvent.TRAILER_SENT)
        reply = channel.receive(timeout=opts.reconnect_timeout + opts.lane_start_timeout)
    except DilationTimeout as e:
        channel.close()
        raise connections.failure(tid) or LaneLostError(
            f"lane {lane} did not confirm partition {partition}: {e}"
        ) from e
    except BlockingDilationError as e:
        ended = connections.failure(tid)
        if ended is not None:  # cut by fail(): the connection is still good
            raise ended from None
        early = _early_answer(channel)
        if early is not None:  # the lane refused mid-stream and closed: its reason
            channel.close()
            lane_answer(early, lane, TAG_COMPLETE, f"partition {partition}")
        connections.evict(tid, lane, conn)
        raise LaneLostError(
            f"the connection to lane {lane} failed while sending partition {partition}: {e}"
        ) from e
    except BaseException:
        channel.close()  # no trailer: the lane drops this attempt
        raise
    finally:
        connections._untrack(tid, channel)
    channel.close()
    ended = connections.failure(tid)
    if ended is not None and reply is not None and reply[:1] == TAG_ERROR:
        raise ended  # refused because the receiver ended the transfer: say why, once
    return Complete.from_body(lane_answer(reply, lane, TAG_COMPLETE, f"partition {partition}"))


def _path(conn: Any) -> str:
    try:
        return path_of(conn.status().connection)
    except DilationError:
        return "unknown"


def _early_answer(channel: Any) -> bytes | None:
    """An ``E`` the lane sent before closing the subchannel under our sends, if any."""
    try:
        reply = channel.receive(timeout=0)
    except BlockingDilationError:
        return None
    return reply if reply is not None and reply[:1] == TAG_ERROR else None
