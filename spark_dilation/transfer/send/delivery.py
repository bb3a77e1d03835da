"""Delivering the end of a transfer to every lane: the manifest, or the abort.

The driver machine's side of the commit and of ``abort()``: each lane gets
the control message (``M`` or ``A``) on a control subchannel of its
connection from :mod:`.pool`, and answers it. An abort also races the
directory link (:mod:`..meet.rendezvous`), which does not queue behind data.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

from ...errors import DilationError
from ..meet.rendezvous import tell_end
from ..meet.views import registered_view
from ..rules.errors import (
    LaneLostError,
)
from ..rules.protocol import (
    ABORT_TIMEOUT,
    CONTROL_SUBPROTOCOL,
    TAG_ABORT,
    TAG_OK,
    Abort,
    CommittedPartition,
    Manifest,
    lane_answer,
)
from ..rules.spec import TransferSpec
from .pool import ConnectionPool

log = logging.getLogger(__name__)


def deliver_control(
    spec: TransferSpec,
    message: bytes,
    *,
    timeout: float,
    connections: ConnectionPool | None = None,
    lanes: Iterable[int] | None = None,
    any_lane: bool = False,
) -> int:
    """Send the manifest (or an abort) to every lane and wait for each to confirm.

    With ``any_lane`` (a cancel), return as soon as one lane confirmed: the
    receiver then ends every lane, so the others may never answer.

    Returns how many Dilation connections it opened (one per lane, more if a
    lane went away meanwhile), which the transfer report counts.

    Runs in a fresh process (Spark's commit()/abort() worker) with a pool of
    its own (one connection per lane, in parallel), or with the pool whose
    connections the partitions used (``connections``: the Python API's send,
    the sender host), closed afterwards. The latter needs no new meeting, so no
    mailbox: a mailbox lost mid-transfer does not cost the transfer.
    """
    errors: list[BaseException] = []
    deadline = time.monotonic() + timeout
    opened_before = connections.opened.get(spec.transfer_id, 0) if connections else 0
    connections = connections or ConnectionPool()
    what = "the abort" if message[:1] == TAG_ABORT else "the final manifest"

    def once(lane: int) -> None:
        conn = connections.get(spec, lane, deadline, what=what)
        try:
            with conn.open(CONTROL_SUBPROTOCOL, timeout=timeout) as channel:
                channel.send(message, timeout=timeout)
                reply = channel.receive(timeout=max(1.0, deadline - time.monotonic()))
        except DilationError as e:  # gone, given up, or never reached (no path): again
            connections.evict(spec.transfer_id, lane, conn)
            raise LaneLostError(f"lane {lane} went away during {what}: {e}") from e
        if reply is None:
            connections.evict(spec.transfer_id, lane, conn)
        lane_answer(reply, lane, TAG_OK, what)

    confirmed = threading.Event()

    def one(lane: int) -> None:
        # A lane re-hosted meanwhile (a new epoch) gets it again.
        while True:
            try:
                once(lane)
                confirmed.set()
                return
            except LaneLostError as e:
                if confirmed.is_set() and any_lane:
                    return
                if time.monotonic() >= deadline:
                    errors.append(e)
                    return
                log.info("%s; trying again", e)
                time.sleep(0.5)
            except BaseException as e:
                errors.append(e)
                return

    targets = list(range(spec.lanes) if lanes is None else lanes)
    if any_lane:
        workers = [threading.Thread(target=one, args=(lane,), daemon=True) for lane in targets]
        for w in workers:
            w.start()
        if _first_confirmed(confirmed, workers, deadline):
            return 0
        raise errors[0] if errors else LaneLostError(f"no lane confirmed {what} in {timeout:g} s")
    with ThreadPoolExecutor(max_workers=max(1, min(16, len(targets)))) as ex:
        list(ex.map(one, targets))
    opened = connections.stats(spec.transfer_id).connections_opened - opened_before
    connections.close_transfer(spec.transfer_id)
    if errors:
        raise errors[0]
    return opened


def _first_confirmed(
    confirmed: threading.Event, threads: list[threading.Thread], deadline: float
) -> bool:
    """Wait until ``confirmed`` is set, every thread has ended, or a second past
    ``deadline`` (the threads' own bound); whether it was set."""
    while not confirmed.is_set() and any(t.is_alive() for t in threads):
        if time.monotonic() > deadline + 1.0:
            break
        confirmed.wait(0.05)
    return confirmed.is_set()


def deliver_manifest(
    spec: TransferSpec,
    partitions: Iterable[CommittedPartition],
    connections: ConnectionPool | None = None,
) -> tuple[Manifest, int]:
    """Deliver the final manifest to every lane: (the manifest, connections opened)."""
    manifest = Manifest.of(spec.transfer_id, partitions)
    opened = deliver_control(
        spec, manifest.encode(), timeout=spec.options.lane_start_timeout, connections=connections
    )
    return manifest, opened


def deliver_abort(
    spec: TransferSpec,
    reason: str,
    timeout: float = ABORT_TIMEOUT,
    connections: ConnectionPool | None = None,
    *,
    cancelled: bool = False,
    reached_only: bool = False,
) -> bool:
    """Tell every reachable lane the transfer failed or was cancelled (best effort, bounded).

    ``reason``: what failed, or the cause of the cancel (``"Ctrl-C"``). With
    ``reached_only`` only the lanes ``connections`` is connected to are told
    (the receiver ends every lane when one is aborted), or every lane over new
    connections if it has none. True if every lane told confirmed, or if the
    receiver ended the transfer itself (a lane's ``A`` reached ``connections``):
    its lanes are gone, and waiting for them would only delay the caller's error.

    On a connection the abort travels behind the data already queued on it
    (up to the Dilation queue's high-water mark plus the socket buffers:
    half a minute on a 0.5 MB/s link). So where this process is the writing
    end, the abort also goes through the directory link (the mailbox), and a
    reading end that knows it answers at once; a ``reached_only`` abort that
    is confirmed neither way within :data:`FRESH_ABORT_AFTER` also goes over a
    new connection (the lanes' next doors), which carries nothing else. The
    first confirmation wins; the receiver ignores the others.
    """
    if connections is not None and connections.receiver_ended(spec.transfer_id):
        log.info("the receiver ended transfer %s itself: no abort to tell", spec.transfer_id)
        return True
    abort = Abort(reason, cancelled)
    lanes = connections.lanes_connected(spec.transfer_id) if reached_only and connections else []
    try:
        if lanes:
            _abort_soonest(spec, abort, timeout, connections, lanes)
        else:  # every lane on ``connections``, or none reached: over new connections
            _abort_soonest(spec, abort, timeout, None if reached_only else connections, None)
        return True
    except (DilationError, TimeoutError) as e:
        log.warning("could not tell every lane about the abort: %s", e)
        return False


FRESH_ABORT_AFTER = 0.5  # s: an in-band abort on an idle or fast link has confirmed by then


def _abort_soonest(
    spec: TransferSpec,
    abort: Abort,
    timeout: float,
    connections: ConnectionPool | None,
    lanes: list[int] | None,
) -> None:
    """Race the ways to tell the lanes; return at the first confirmation.

    * in-band: ``lanes`` (any one confirming is enough: the receiver ends them
      all) on ``connections``, or every lane (each confirming) when ``lanes``
      is None;
    * the directory link, where this process is the writing end;
    * with ``lanes``, after :data:`FRESH_ABORT_AFTER`: new connections to them.
    """
    deadline = time.monotonic() + timeout
    done = threading.Event()
    errors: list[BaseException] = []
    fresh = ConnectionPool()

    def tell(pool: ConnectionPool | None) -> None:
        try:
            deliver_control(spec, abort.encode(), timeout=timeout, connections=pool,
                            lanes=lanes, any_lane=lanes is not None)  # fmt: skip
            done.set()
        except BaseException as e:
            errors.append(e)

    racers = [threading.Thread(target=tell, args=(connections,), daemon=True, name="abort")]
    racers[0].start()
    view = registered_view(spec.transfer_id)
    tell_abort = view.tell_abort if view is not None else None
    if view is not None and tell_abort is not None:
        tell_end(tell_abort, view.wait_ended, abort, deadline, done)
    try:
        if lanes is not None and not done.wait(FRESH_ABORT_AFTER):
            log.info(
                "the abort waits behind queued data: telling the lanes on a new connection too"
            )
            racers.append(
                threading.Thread(target=tell, args=(fresh,), daemon=True, name="abort-fresh")
            )
            racers[-1].start()
        confirmed = _first_confirmed(done, racers, deadline)
        if not confirmed and tell_abort is not None:
            # The connections are done with (failed): the directory's answer may still
            # come, a moment later, from a receiver that ended on it.
            confirmed = done.wait(max(0.0, min(1.0, deadline - time.monotonic())))
    finally:
        fresh.close_transfer(spec.transfer_id, linger=0.0)
    if not confirmed:
        raise errors[0] if errors else TimeoutError(f"no lane confirmed the abort in {timeout:g} s")
