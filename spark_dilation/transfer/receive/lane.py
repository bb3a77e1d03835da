"""One lane's receiver: it meets the senders, stages their partitions, answers them.

A *lane* is one reader partition. Its receiver runs in the background of the
process that first reads the lane (a Spark Python worker, or the Python
API's process) and outlives the read task, so a ``show()`` that stops
reading early does not stop the transfer. It opens a door for every sending
process the directory names (:mod:`..rules.directory`), accepts partition streams
on every Dilation connection a sender process makes, writes each stream to
``<staging>/<transfer>/lane-<n>/`` as an Arrow IPC stream file while it
arrives (memory holds only the Dilation buffers), renames it into place when
the trailer checks out, and only then answers "complete". When the manifest
has arrived and every partition it lists for the lane is staged, the lane
writes ``manifest.json`` there: later actions (``count()`` after ``show()``)
read the staged files and never wait for a sender again.

One receiver per lane and machine: an ``flock`` on ``lane-<n>/.lock`` elects
it; another process reading the same lane meanwhile follows the staged
files. Lane states: :data:`..rules.states.LANE` is the table, applied in
:meth:`LaneReceiver._apply` alone. RECEIVING (doors open) -> DONE (manifest
+ every partition staged) or FAILED (the sender's abort; the receiving side
ended it, :meth:`LaneReceiver.end_transfer` telling the senders; a partition
lost with an earlier incarnation: cannot heal; idle). RECEIVING -> FAILING (a
partition could not be staged: disk full, ...; that stream, every later one
and the manifest get "E" with the cause) -> FAILED with that cause. An
in-process receiver's lane is STAGED while the receiver writes the data out.

An in-process receiver (the Python API, the CLI) passes ``before_ok``: the
lane answers the final manifest only once the receiver has put the data where
it was asked ("K"), or with the receiver's error ("E"), so a sender's success
means the data arrived. Spark's lanes answer once staged: the staged lane is
what the reading application reads.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import struct
import threading
import time
import uuid
import weakref
from collections.abc import Callable
from typing import Any, Protocol

import crochet
import pyarrow as pa
import pyarrow.ipc as ipc

from ...dilation.blocking import DilationClosed, DilationTimeout, SubchannelClosed
from ...dilation.manager import DilationNoPath, DilationReconnectFailed
from ...errors import DilationError, TransferError
from ..meet.rendezvous import Paired, claim_door, dilate_paired, lost_state
from ..meet.views import sender_set
from ..rules.directory import Door, LaneDoors
from ..rules.endwait import EndWait
from ..rules.errors import (
    CannotHealError,
    LaneIdleError,
    OutputError,
    ProtocolError,
    StagingError,
    TransferAbortedError,
)
from ..rules.meeting import LaneDoor, LaneStep, Outcome
from ..rules.pqformat import FORMAT as PARQUET
from ..rules.pqformat import ChunkDecoder
from ..rules.protocol import (
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
    Abort,
    Complete,
    LaneBook,
    Manifest,
    PartitionAssembler,
    PartitionHeader,
    Trailer,
    decode_message,
    encode_json,
    failure_answer,
    ipc_rows,
)
from ..rules.report import tally
from ..rules.spec import TransferSpec
from ..rules.states import LANE, Lane, LaneEvent
from .staging import LaneStaging, rows_of, staging_error, take_lane_lock

log = logging.getLogger(__name__)

# stop() waits this long for the doors to end their pending meetings (each
# notices the stop within 0.25 s and then waits for the mailbox's close, at
# most rendezvous.CLOSE_WAIT; they close in parallel).
DOOR_STOP_WAIT = 10.0


class Causes(Protocol):
    """Where the reading side's lanes meet on the true cause of a transfer's end."""

    def cause(self, lane: int, own: BaseException | None = None) -> BaseException | None:
        """Declare ``own`` (this lane's own failure, if given); the first one declared."""


class LocalCauses:
    """:class:`Causes` for lanes in one process (the Python API, the CLI)."""

    def __init__(self) -> None:
        self._first: BaseException | None = None
        self._lock = threading.Lock()

    def cause(self, lane: int, own: BaseException | None = None) -> BaseException | None:
        with self._lock:
            if self._first is None:
                self._first = own
            return self._first


class LaneReceiver:
    """The background receiver of one lane in this process (see the module docstring)."""

    def __init__(
        self,
        spec: TransferSpec,
        lane: int,
        staging: LaneStaging,
        lock_fd: int,
        before_ok: Callable[[], str | None] | None = None,
        epoch: int = 0,
        causes: Causes | None = None,
    ) -> None:
        self.spec = spec
        self.lane = lane
        # The true cause wins: a lane declares its own failure here before it tells
        # the senders, and a lane the senders' abort ends takes the cause from here.
        self.causes = causes
        self.staging = staging
        self.incarnation = uuid.uuid4().hex[:12]
        self.book = LaneBook(spec.transfer_id, lane, spec.lanes, spec.fingerprint)
        self._lock_fd = lock_fd
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._stop_lock = threading.Lock()
        # Set (under _cond) before the staging folder is removed: no stream creates or
        # renames a file in it after that, so removing it leaves nothing behind.
        self._sealed = False
        # Progress: rows and wire bytes of the partitions kept, and of the streams
        # arriving now, counted per message (not when a partition completes).
        self._kept_rows = self._kept_bytes = 0
        self._arriving: dict[tuple[int, int], tuple[int, int]] = {}
        # Meeting by introduction: one door per sender the directory named.
        self.epoch = epoch
        self._doors = LaneDoors(lane, epoch)
        self._door_threads: list[threading.Thread] = []
        self._senders = sender_set(spec.transfer_id)
        self._connections: list[Any] = []
        self._waiting: dict[Door, Any] = {}  # door -> its wormhole while it waits (a thread each)
        # The lane's state (rules/states.py, LANE), changed by _apply alone, under
        # _cond; the cause it ended with, and its own first staging failure (disk
        # full, ...): every later stream and the manifest get that as "E".
        self.state = LANE.initial
        self.error: BaseException | None = None
        self.failure: StagingError | None = None
        # In-process receivers (the Python API, the CLI): run before the final
        # manifest's "K" once this lane is staged; blocks until the data is where
        # the receiver asked and returns the receiver's error, if any, to answer
        # "E" instead. None (Spark): "K" means staged, as the lane is the data.
        self.before_ok = before_ok
        self.last_activity = time.monotonic()
        self.active_streams = 0
        self.connections_made = 0
        self._ever_up = False  # a sender connection of this lane opened a subchannel
        self.reconnects = 0
        self.paths: list[str] = []
        # Why the last sender connection ended, when Dilation gave up on it
        # (down for reconnect_timeout); a clean close leaves it None.
        self.gave_up: BaseException | None = None
        self._reached: weakref.WeakSet[Any] = weakref.WeakSet()  # connections that carried one
        for partition in staging.complete():
            # Staged by an earlier incarnation on this machine: still good.
            self.book.completed(partition, -1, rows_of(staging.complete_path(partition)))

    # --- state ---------------------------------------------------------------------

    @property
    def finished(self) -> bool:
        return self.state in LANE.terminal

    @property
    def staged(self) -> bool:
        """Manifest and every partition staged; the receiver writes them out (before_ok)."""
        return self.state is Lane.STAGED

    def _apply(self, event: LaneEvent, cause: BaseException | None = None) -> bool:
        """Under ``_cond``: the one place the lane's state changes. True if this ended it."""
        before = self.state
        self.state = LANE.next(before, event)
        if event is LaneEvent.STAGING_FAILED and self.failure is None:
            assert isinstance(cause, StagingError)
            self.failure = cause
        ended = before not in LANE.terminal and self.state in LANE.terminal
        if ended:
            self.error = cause
        self._cond.notify_all()
        return ended

    # --- lifecycle ---------------------------------------------------------------

    def start(self) -> None:
        log.info(
            "lane %d (epoch %d): receiving; a door for each sender named", self.lane, self.epoch
        )
        self._senders.subscribe(self._learn)
        self._senders.subscribe_spoiled(self._reported)

    def seal(self) -> None:
        """No stream writes a new file into the staging from now on (its owner removes
        the folder next); a stream still under way ends without keeping its partition."""
        with self._cond:
            self._sealed = True

    def _unsealed(self, what: str) -> None:
        """Under ``_cond``: raise if the staging is sealed."""
        if self._sealed:
            raise TransferError(f"lane {self.lane} is ending: {what} was not kept")

    def stop(self, linger: float = 2.0) -> None:
        """Close the doors and every connection (idempotent; waits for a stop under way)."""
        with self._stop_lock:
            self._stop.set()
            with self._cond:
                self._sealed = True
                conns = list(self._connections)
                self._connections.clear()
                self._cond.notify_all()
            for conn in conns:
                self._keep_what_it_did(conn)
                with contextlib.suppress(Exception):
                    conn.close(timeout=10, linger=linger)
            self._senders.unsubscribe(self._learn)
            self._senders.unsubscribe_spoiled(self._reported)
            with self._cond:
                doors = list(self._door_threads)
            end = time.monotonic() + DOOR_STOP_WAIT
            for door in doors:
                if door.is_alive() and door is not threading.current_thread():
                    # Its pending meeting closes its wormhole on the mailbox: wait, so
                    # that a process exiting right after does not cut that close short.
                    door.join(max(0.0, end - time.monotonic()))
            if self._lock_fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(self._lock_fd)
                self._lock_fd = -1

    def end_transfer(
        self,
        abort: Abort,
        error: BaseException,
        timeout: float = 5.0,
        heard: threading.Event | None = None,
        flush: float | None = None,
    ) -> str:
        """The receiving side ends the transfer: tell each sender connection, then finish.

        ``A`` (``abort``) goes on a control subchannel of every connection
        this lane holds, in parallel; partition streams that still arrive
        are refused. The connections stay up until a sender answers ``K``
        (or ``timeout`` passes): closing sooner could drop the ``A`` still
        on its way, and the sender's answer queues behind the partition
        data it had sent (instant on a fast link, seconds on a slow one).
        Returns ``"confirmed"``, ``"sent"`` or ``""`` (no connection took
        it). The lane then finishes with ``error``. For a cancel and for
        any failure of the receiving side (its reason in ``abort``).
        ``heard``: set when the sender confirmed the end another way (the
        directory link); the lane then stops at once, with no linger.
        ``flush``: stop waiting this long after ``A`` was handed to a
        connection, confirmed or not (a process about to exit: the answer
        queues behind the data the sender had sent, seconds on a slow link,
        while ``A`` itself goes out at once on the quiet direction).
        """
        with self._cond:
            self.book.aborted = abort.text("receiver")
            conns = list(self._connections)
        # The stop rule is rules/endwait.py; here, what happens and when.
        wait = EndWait(time.monotonic() + timeout, flush, other_way=heard is not None)
        changed = threading.Condition()

        def tell(conn: Any) -> None:
            try:
                with conn.open(CONTROL_SUBPROTOCOL, timeout=timeout) as channel:
                    channel.send(abort.encode(), timeout=timeout)
                    with changed:
                        wait.on_sent(time.monotonic())
                        left = wait.deadline - time.monotonic()
                    reply = channel.receive(timeout=max(0.1, left))
                if reply is not None and decode_message(reply)[0] == TAG_OK:
                    with changed:
                        wait.on_confirmed()
                        changed.notify_all()
            except (DilationError, OSError) as e:  # gone, or a sender that does not listen
                log.info("lane %d: no confirmation from a sender of the end: %s", self.lane, e)

        threads = [threading.Thread(target=tell, args=(c,), daemon=True) for c in conns]
        for t in threads:
            t.start()
        with changed:
            while True:
                now = time.monotonic()
                if heard is not None and heard.is_set():
                    wait.on_heard()
                if not any(t.is_alive() for t in threads):
                    wait.on_tellers_done(now)
                if wait.over(now):
                    break
                changed.wait(0.05)
        self._finish(error, linger=2.0 if wait.linger else 0)
        return wait.outcome

    def sender_ended(self, abort: Abort, linger: float = 2.0) -> None:
        """The sending side ended the transfer (``A`` on a connection, or through the
        directory): the lane ends at once. After a staging failure, here or on another
        lane, the abort is its echo: the lane's error is that cause. ``linger``: 0 when
        the lane sent the senders nothing they wait for (the directory answers them)."""
        with self._cond:
            if self.finished:
                return
            self.book.aborted = abort.text("sender")
        self._finish(self._cause() or TransferAbortedError(abort.text("sender")), linger)

    def _lost_sender_message(self, gave_up: BaseException) -> str:
        """Redial's give-up text already says what was tried and names reconnect_timeout:
        say it once, spelled as the user gives options."""
        spelled = self.spec.options.spelled("reconnect_timeout")
        if isinstance(gave_up, DilationReconnectFailed):
            return f"lane {self.lane} lost the sender: " + str(gave_up).replace(
                "reconnect_timeout", spelled
            )
        limit = self.spec.options.reconnect_timeout
        return (
            f"lane {self.lane} lost the sender: no connection for {limit:g} s ({spelled}): "
            f"{gave_up}"
        )

    def arrived(self) -> tuple[int, int]:
        """(rows, wire bytes) this lane has: kept partitions and streams under way."""
        with self._cond:
            rows = self._kept_rows + sum(r for r, _ in self._arriving.values())
            return rows, self._kept_bytes + sum(b for _, b in self._arriving.values())

    def _keep_what_it_did(self, conn: Any) -> None:
        """A connection that ends: keep its path and reconnects for the report and the
        progress lines (:meth:`live_stats` counts the live ones)."""
        with contextlib.suppress(Exception):
            seen = tally([conn.status()])
            with self._cond:
                self.paths += seen.paths
                self.reconnects += seen.reconnects

    def live_stats(self) -> tuple[int, int, list[str], int, int]:
        """(connections made, reconnects, paths, reconnecting now, connecting now)."""
        with self._cond:
            conns = list(self._connections)
        paths = list(self.paths)
        reconnects = self.reconnects
        statuses = []
        for conn in conns:
            with contextlib.suppress(Exception):
                statuses.append(conn.status())
        seen = tally(statuses)
        paths += seen.paths
        return (
            self.connections_made,
            reconnects + seen.reconnects,
            paths,
            seen.reconnecting,
            seen.connecting,
        )

    def wait_finished(
        self, staged: bool = False, timeout: float | None = None
    ) -> BaseException | None:
        """Block until the lane is done or failed, or idle for ``idle_timeout``; its error.

        ``staged``: return once the lane is staged and waits in ``before_ok``.
        ``timeout``: give up waiting then (the lane goes on; returns None).
        """
        idle = self.spec.options.idle_timeout
        end = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while not self.finished and not (staged and self.staged):
                if end is not None and time.monotonic() >= end:
                    return None
                left = 0.5 if end is None else end - time.monotonic()
                self._cond.wait(max(0.0, min(0.5, left)))
                quiet = time.monotonic() - self.last_activity
                busy = self.active_streams or self.staged  # staged: the receiver writes out
                lost = None if self._connections else self.gave_up
                if lost and not busy and not self.finished:
                    # Every sender connection is gone and the last one did not come
                    # back within reconnect_timeout: the sender ended without a word
                    # (killed, machine lost) or the network between us is down. A lane
                    # never reached whose connection found no path ends with that
                    # error itself, as _accept_loop ends it (whichever comes first).
                    never_up = isinstance(lost, DilationNoPath) and not self._ever_up
                    self._apply(
                        LaneEvent.ENDED,
                        lost if never_up else LaneIdleError(self._lost_sender_message(lost)),
                    )
                elif quiet > idle and not busy and not self.finished:
                    self._apply(
                        LaneEvent.ENDED,
                        LaneIdleError(
                            f"lane {self.lane} heard nothing from the sender for {idle:g} s (no "
                            "new connection, no data, no final manifest). Check that the writer "
                            "is still running, or raise "
                            f"{self.spec.options.spelled('idle_timeout')}{self._lost_state()}"
                        ),
                    )
            return self.error

    def _lost_state(self) -> str:
        """Why no sender came, if the mailbox server lost its state meanwhile: a door's
        meeting, or the directory link (this process's reading end), was stranded."""
        doors = {lost_state(w) for w in list(self._waiting.values())} - {""}
        return doors.pop() if doors else self._senders.link_lost_state()

    def _own_failure(self, e: StagingError) -> StagingError:
        """Keep the lane's first own failure; declare it before the senders hear of it."""
        with self._cond:
            first = self.failure is None
            self._apply(LaneEvent.STAGING_FAILED, e)
        if first and self.causes is not None:
            try:
                self.causes.cause(self.lane, e)
            except Exception as why:  # the senders must hear of it anyway
                log.info("lane %d: could not declare its failure: %s", self.lane, why)
        return self.failure

    def _cause(self) -> BaseException | None:
        """This lane's own failure, else another lane's declared one (None: none)."""
        if self.failure is not None or self.causes is None:
            return self.failure
        try:
            return self.causes.cause(self.lane)
        except Exception as why:
            log.info("lane %d: could not ask for the transfer's cause: %s", self.lane, why)
            return None

    def _finish(self, error: BaseException | None = None, linger: float = 2.0) -> None:
        """Record the lane's end; stop it in the background, waiting up to ``linger`` s for
        the senders to answer the subchannels' closes (what it sent last reached them)."""
        with self._cond:
            if not self._apply(LaneEvent.COMPLETED if error is None else LaneEvent.ENDED, error):
                return
        threading.Thread(target=self.stop, kwargs={"linger": linger}, daemon=True).start()

    # --- doors and connections -----------------------------------------------------

    def _learn(self, senders: set[int]) -> None:
        """The directory named new senders: open a door for each (see :mod:`..rules.directory`)."""
        with self._cond:
            if self._stop.is_set():
                return
            doors = self._doors.learn(senders)
            threads = [
                threading.Thread(
                    target=self._door, args=(door,), name=f"lane-{self.lane}-door", daemon=True
                )
                for door in doors
            ]
            self._door_threads.extend(threads)
        for thread in threads:
            thread.start()

    def _reported(self, doors: set[Door]) -> None:
        """Senders found a stranger on ``doors``: a door of ours among them is given up
        (its thread's claim is cancelled) and the sender's next one opened."""
        with self._cond:
            open_now = self._doors.report(doors)
        if open_now:
            log.warning(
                "lane %d (epoch %d): senders found a stranger on %s; next door",
                self.lane, self.epoch, open_now,
            )  # fmt: skip

    def _given_up(self, door: Door) -> bool:
        """The door's claim stops: the lane stops, or the senders found a stranger there."""
        if self._stop.is_set():
            return True
        with self._cond:
            return door in self._doors.reported

    def _door(self, door: Door) -> None:
        """Wait at ``door`` for its sender; after each pairing, at the sender's next door
        (the lane door table, rules/meeting.py)."""
        opts = self.spec.options
        state = LaneDoor(self._doors, door)
        while not self._stop.is_set():
            door = state.door
            what = f"sender {door.sender} of lane {self.lane}"
            try:
                given_up = functools.partial(self._given_up, door)
                outcome, got = claim_door(
                    self.spec, door, ROLE_LANE, cancelled=given_up, what=what,
                    started=functools.partial(self._waiting.__setitem__, door),
                )  # fmt: skip
                self._waiting.pop(door, None)
                conn = None
                if outcome is Outcome.PAIRED:
                    try:
                        conn = dilate_paired(
                            Paired(got, door),
                            relay_url=opts.relay_url,
                            no_listen=opts.no_listen,
                            listen=(PARTITION_SUBPROTOCOL, CONTROL_SUBPROTOCOL),
                            peer_timeout=opts.reconnect_timeout,
                            timeout=opts.reconnect_timeout,
                            no_path_timeout=opts.no_path_timeout,
                        )
                    except DilationError as e:
                        outcome, got = Outcome.FAILED, e
            except crochet.ReactorStopped:
                return  # the process is exiting (a CLI after its transfer)
            with self._cond:
                stopped = self._stop.is_set()
                if conn is not None and stopped:
                    step = LaneStep.LEAVE
                else:
                    step = state.claimed(outcome)  # under the lock: it moves self._doors
                if conn is not None and not stopped:
                    self._connections.append(conn)
                    self.connections_made += 1
                    self.last_activity = time.monotonic()
            if conn is not None and stopped:
                conn.close(timeout=10, linger=0)  # stop() waits for this thread
                return
            if step is LaneStep.FAIL:  # mailbox unreachable and the like
                log.warning("lane %d: meeting %s failed: %s", self.lane, what, got)
                self._finish(got)
                return
            if step is LaneStep.LEAVE:  # stopped, or not the peer the directory sent
                if outcome is Outcome.NOT_OURS:
                    log.warning("lane %d: %s", self.lane, got)
                return
            if outcome is Outcome.SPOILED:  # it costs this attempt, not the lane
                log.warning("lane %d (epoch %d): %s; next door", self.lane, self.epoch, got)
                self._senders.tell_spoiled({door})  # the sender may never have seen it
                continue
            if outcome is Outcome.CANCELLED:  # the senders' side found the stranger
                continue
            log.info("lane %d (epoch %d): %s connected", self.lane, self.epoch, what)
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
            except DilationError as e:  # ended: closed, given up, no path
                log.info("lane %d: a sender connection ended: %s", self.lane, e)
                with self._cond:
                    ours = conn in self._connections
                    if ours:
                        self._connections.remove(conn)
                        clean = isinstance(e, DilationClosed | SubchannelClosed)
                        # A connection that never carried a stream (its sender died while
                        # it was connecting) does not hide why one that did ended.
                        if conn in self._reached or self.gave_up is None:
                            self.gave_up = None if clean else e
                        self._keep_what_it_did(conn)
                if isinstance(e, DilationNoPath) and not self._ever_up:
                    # No sender ever reached this lane and this one found no
                    # path at all: waiting for idle_timeout would help nobody.
                    if ours:  # its wormhole too, before the caller ends the process
                        with contextlib.suppress(Exception):
                            conn.close(timeout=10, linger=0)
                    self._finish(e)
                return
            self._ever_up = True  # a subchannel came: this lane was reached
            with self._cond:
                self._reached.add(conn)
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
            failure = self.failure
            self.active_streams += 1
        try:
            if failure is not None:
                channel.send(failure_answer(f"the receiver failed: {failure}"))
                return
            if decision.action == "refuse":
                refusal = {"error": decision.reason, "ended": decision.ended}
                channel.send(encode_json(TAG_ERROR, refusal))
                return
            try:
                self._receive_stream(channel, header, decision.action == "discard")
            except StagingError as e:
                # Not transient (disk full, no permission): say why, so the sender
                # fails with the cause instead of sending it again.
                log.info("%s", e)
                self._own_failure(e)
                channel.send(failure_answer(f"the receiver failed: {self.failure}"))
        finally:
            with self._cond:
                self.active_streams -= 1
                self._cond.notify_all()

    def _receive_stream(self, channel: Any, header: PartitionHeader, discard: bool) -> None:
        wait = self.spec.options.reconnect_timeout
        assembler = PartitionAssembler(header)
        partial = None if discard else self.staging.partial_path(header.partition, header.attempt)
        key, rows = (header.partition, header.attempt), 0
        what = f"partition {header.partition}"
        try:
            with self._cond:
                self._unsealed(what)
                out = open(partial, "wb") if partial else None
            if out is not None and header.compression == PARQUET:
                out = _ParquetStaging(out, self.spec.schema)
        except OSError as e:
            raise staging_error(self.lane, what, e, self.spec.options.staging_root) from e
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
                        try:
                            out.write(body)
                        except OSError as e:
                            root = self.spec.options.staging_root
                            raise staging_error(self.lane, what, e, root) from e
                        rows = out.rows if isinstance(out, _ParquetStaging) else rows + _rows(body)
                        with self._cond:
                            self._arriving[key] = (rows, assembler.bytes)
                    self._touch()
                elif tag == TAG_TRAILER:
                    trailer = Trailer.from_body(body)
                    assembler.finish(trailer)
                    if isinstance(out, _ParquetStaging):
                        out.check(header.partition, trailer.rows)
                    break
                else:
                    raise ProtocolError(f"unexpected {tag!r} inside a partition stream")
            try:
                if out is not None:
                    out.close()  # flushes: a full disk may say so only now
                    out = None
                with self._cond:
                    self._unsealed(what)
                    kept = partial is not None and self.book.completed(
                        header.partition, header.attempt, trailer.rows
                    )
                    if kept:
                        assert partial is not None
                        os.replace(partial, self.staging.complete_path(header.partition))
                        partial = None
                        self._kept_rows += trailer.rows
                        self._kept_bytes += assembler.bytes
                    self._arriving.pop(key, None)
                    self._cond.notify_all()
            except OSError as e:
                raise staging_error(self.lane, what, e, self.spec.options.staging_root) from e
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
            try:
                self._check_done()
            except StagingError as e:  # the manifest.json of a lane completed by this stream
                log.info("%s", e)
                self._finish(e)
        finally:
            with self._cond:
                self._arriving.pop(key, None)  # a dropped attempt no longer counts
            if out is not None:
                with contextlib.suppress(OSError):  # its error is already on its way
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
            try:
                error: BaseException | None = self._check_done(finish=False)
            except StagingError as e:
                error = self._own_failure(e)
            if error is None and self.failure is not None:
                error = self.failure
            if error is None and self.before_ok is not None:
                error = self._deliver()
            if isinstance(error, StagingError):
                channel.send(failure_answer(f"the receiver failed: {error}"))
                self._finish(error)
            elif isinstance(error, OutputError):
                channel.send(failure_answer(str(error)))
                self._finish(error)
            elif error is not None:
                channel.send(encode_json(TAG_ERROR, {"error": str(error)}))
                self._finish(error)
            else:
                channel.send(encode_json(TAG_OK, {}))
                with self._cond:
                    done = self.book.done()
                if done:
                    self._finish(None)
        elif tag == TAG_ABORT:
            channel.send(encode_json(TAG_OK, {}))
            self.sender_ended(Abort.from_body(body))
        else:
            channel.send(encode_json(TAG_ERROR, {"error": f"unexpected {tag!r}"}))

    def _deliver(self) -> BaseException | None:
        """Wait until every listed partition is staged, then for ``before_ok``; its error."""
        assert self.before_ok is not None
        with self._cond:
            while not self.book.done():
                if self.failure is not None:
                    return self.failure
                if self.finished or self._stop.is_set():
                    return self.error or TransferError(f"lane {self.lane} stopped")
                self._cond.wait(0.5)
            if self.failure is not None:  # a stream failed since the manifest came
                return self.failure
            self._apply(LaneEvent.ALL_STAGED)
        text = self.before_ok()
        return None if text is None else OutputError(text)

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
                self._apply(LaneEvent.ENDED, error)
                threading.Thread(target=self.stop, daemon=True).start()
                return error
            if missing:
                return None
            self.book.check_rows()
            try:
                self.staging.write_manifest(manifest)
            except OSError as e:
                root = self.spec.options.staging_root
                raise staging_error(self.lane, "its manifest", e, root) from e
        log.info("lane %d: done, %d partitions", self.lane, len(manifest.for_lane(self.lane)))
        if finish and self.before_ok is None:  # else the manifest's answer finishes the lane
            self._finish(None)
        return None


# --- the per-process registry ---------------------------------------------------------------

_registry_lock = threading.Lock()
_receivers: dict[tuple[str, int], LaneReceiver] = {}


def lane_receiver(
    spec: TransferSpec,
    lane: int,
    before_ok: Callable[[], str | None] | None = None,
    causes: Causes | None = None,
) -> LaneReceiver | None:
    """This process's receiver of ``lane``, started if this process wins the lane's lock.

    None if another process on this machine holds it (follow its staged files).
    ``before_ok``: see :class:`LaneReceiver` (in-process receivers only).
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
        receiver = LaneReceiver(spec, lane, staging, fd, before_ok, causes=causes)
        _receivers[key] = receiver
        receiver.start()
        return receiver


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


def _rows(body: bytes | memoryview) -> int:
    """Rows in a ``D`` message, for progress only: a damaged one counts none (the
    trailer's check fails the stream)."""
    try:
        return ipc_rows(body)
    except (ProtocolError, struct.error, IndexError):
        return 0


class _ParquetStaging:
    """Stages a ``parquet`` partition as Arrow IPC, like every other (see :mod:`..rules.pqformat`):
    each frame is decoded as it completes, so nothing after the lane differs."""

    def __init__(self, out: Any, schema: pa.Schema) -> None:
        self._out = out
        self._decoder = ChunkDecoder(schema)
        self._writer = ipc.new_stream(out, schema)
        self.rows = 0

    def write(self, data: bytes | memoryview) -> None:
        try:
            for table in self._decoder.feed(data):
                self._writer.write_table(table)
                self.rows += table.num_rows
        except OSError:
            raise  # the disk, not the data
        except (ValueError, pa.ArrowException) as e:
            raise ProtocolError(f"a Parquet frame could not be decoded: {e}") from e

    def check(self, partition: int, trailer_rows: int) -> None:
        """At the trailer: every frame complete, and the rows the sender counted."""
        try:
            self._decoder.finish()
        except ValueError as e:
            raise ProtocolError(f"partition {partition}: {e}") from e
        if self.rows != trailer_rows:
            raise ProtocolError(
                f"partition {partition} decoded to {self.rows} rows, the sender sent {trailer_rows}"
            )

    def close(self) -> None:
        try:
            self._writer.close()
        finally:
            self._out.close()
