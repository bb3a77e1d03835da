"""Rendezvous by introduction, on the crochet reactor: doors and the directory link.

The rules are in :mod:`..rules.directory` (pure). This module is their blocking glue:

* :func:`meet` claims one door (or the directory link's nameplate) and waits
  for the one peer the directory sent there: no pairing timer, no crowding;
  either side may come first.
* :class:`DirectoryLink` is the one wormhole between the reading end and the
  writing end of a transfer; each side sends its whole half of the directory
  as a mailbox message whenever it changes.
* :func:`dilate_paired` dilates a met door's wormhole.

Each process's views of the directory are in :mod:`.views`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import crochet

from ...errors import (
    CrowdedError,
    DilationError,
    ServerConnectionError,
)
from ...wormhole.blocking import claim, ensure_reactor, run_and_wait
from ..rules.directory import (
    DirectoryState,
    Door,
    abort_message,
    directory_code,
    end_message,
    lanes_message,
    rendezvous_appid,
    spoiled_doors,
    spoiled_message,
)
from ..rules.errors import ProtocolError
from ..rules.meeting import (
    ROLE_READER,
    ROLE_WRITER,
    Outcome,
    claim_outcome,
    meeting_versions,
)
from ..rules.protocol import ROLE_LANE, ROLE_SENDER, Abort
from ..rules.spec import TransferSpec

log = logging.getLogger(__name__)

# How long a cancelled meeting waits for the mailbox to confirm its close (a
# stop must not hang on a dead server; the wormhole's own close timeout is longer).
CLOSE_WAIT = 5.0
POLL = 0.25


class RendezvousTimeout(DilationError, TimeoutError):
    """The peer the directory named did not come within the deadline."""


class DoorSpoiled(DilationError):
    """A stranger was on the door: it was crowded, or a PAKE there did not confirm (a
    wrong code). Both sides of the door give that attempt up and meet on the next
    (the lane's door keeps its claim, so a sender who comes later finds it crowded)."""


class RendezvousCancelled(DilationError):
    """The meeting was cancelled (the lane finished, the epoch rose, the caller gave up)."""


def meet(
    spec: TransferSpec,
    code: str,
    role: str,
    door: Door | None = None,
    *,
    deadline: float | None = None,
    cancelled: Callable[[], bool] = lambda: False,
    what: str = "the peer",
    started: Callable[[Any], None] = lambda _: None,
) -> Any:
    """Claim ``code`` and wait for the peer the directory sent there (blocking; not in the
    reactor). Returns the wormhole, confirmed and not yet dilated.

    ``deadline`` is a ``time.monotonic()`` value (None: wait until ``cancelled()``).
    The mailbox connection is tried again with backoff until then, a first
    connection included: a meeting ends only by its peer, its deadline or its
    cancel, never by a dropped connection, so its door's attempt is never
    skipped (a claim that went out on a lost connection is sent again, by the
    same side, on the next). Raises :class:`RendezvousTimeout` (or, if the mailbox
    server was never reached, :class:`~spark_dilation.errors.ServerConnectionError`
    with why), :class:`RendezvousCancelled`, or the server's own refusal. The
    wormhole releases its nameplate once the peer is there and is closed on every
    failure. ``started(wormhole)`` runs once it exists (a caller's watch on
    ``connection_problem``).
    """
    from twisted.internet import reactor

    from ...wormhole.client import Wormhole

    ensure_reactor()
    versions = meeting_versions(spec.transfer_id, role, door)

    def start() -> tuple[Any, Any]:
        w = Wormhole(
            rendezvous_appid(spec.secret, spec.private_doors), spec.options.mailbox_url,
            reactor, app_versions=versions, dilation=True, connect_tries=None,
            guard_door=door is not None,
        )  # fmt: skip
        w.set_code(code)
        return w, crochet.EventualResult(w.get_versions(), reactor)

    w, waiter = run_and_wait(
        start, timeout=30, on_timeout=lambda: RendezvousTimeout("starting a wormhole took 30 s")
    )
    started(w)
    try:
        while True:
            try:
                theirs = waiter.wait(POLL)
                break
            except crochet.TimeoutError:
                if cancelled():
                    raise RendezvousCancelled(f"stopped waiting for {what}") from None
                if deadline is not None and time.monotonic() >= deadline:
                    raise unreachable(w, spec) or RendezvousTimeout(
                        f"{what} did not come in time" + lost_state(w)
                    ) from None
    except BaseException as e:
        claim(waiter)  # its error (the close below) is ours to drop, not crochet's to log
        close_wormhole(w)
        outcome, _ = claim_outcome(versions, error=e, at_door=door is not None)
        if outcome is Outcome.SPOILED:
            raise DoorSpoiled(f"a stranger was on the door to {what} ({e})") from e
        if isinstance(e, CrowdedError):
            raise DilationError(f"the door to {what} was crowded: {e}") from e
        raise
    outcome, problem = claim_outcome(versions, theirs=theirs)
    if outcome is Outcome.NOT_OURS:
        close_wormhole(w)
        raise ProtocolError(f"meeting {what}: {problem}")
    return w


def claim_door(
    spec: TransferSpec,
    door: Door,
    role: str,
    *,
    cancelled: Callable[[], bool],
    what: str,
    started: Callable[[Any], None] = lambda _: None,
) -> tuple[Outcome, Any]:
    """:func:`meet` at ``door`` with no deadline, its end as an :class:`Outcome` for the
    door's machine (:mod:`..rules.meeting`): ``(PAIRED, wormhole)``, else ``(outcome,
    error)``. The process's own end (``crochet.ReactorStopped``) is raised."""
    try:
        return Outcome.PAIRED, meet(
            spec, door.code(spec.secret), role, door, cancelled=cancelled, what=what,
            started=started,
        )  # fmt: skip
    except RendezvousCancelled as e:
        return Outcome.CANCELLED, e
    except DoorSpoiled as e:
        return Outcome.SPOILED, e
    except ProtocolError as e:
        return Outcome.NOT_OURS, e
    except DilationError as e:
        return Outcome.FAILED, e


def unreachable(w: Any, spec: TransferSpec) -> ServerConnectionError | None:
    """The mailbox server was never reached by ``w`` (a meeting's wormhole): why, or None."""
    problem = w.connection_problem if w is not None else None
    if problem is None:
        return None
    return ServerConnectionError(
        spec.options.mailbox_url, f"{problem} (tried {w.failed_tries} times, still trying)"
    )


def lost_state(w: Any) -> str:
    """What a timed-out meeting adds when the server forgot its claim meanwhile."""
    if getattr(w, "server_lost_state", False):
        return (
            "; the mailbox server lost its state meanwhile (restarted without its"
            " database), which strands a meeting that was under way at the restart"
        )
    return ""


def close_wormhole(w: Any) -> None:
    """Close ``w`` and wait (at most CLOSE_WAIT) for the mailbox to confirm: a process that
    exits right after must not cut the release short."""
    with contextlib.suppress(Exception):
        run_and_wait(
            lambda: w.close().addErrback(lambda _: None),
            timeout=CLOSE_WAIT,
            on_timeout=lambda: TimeoutError("close"),
        )


# --- the directory link ------------------------------------------------------------------


class DirectoryLink:
    """The reading end's and the writing end's one wormhole (see :mod:`..rules.directory`).

    ``on_message(dict)`` runs in the link's thread for every message of the
    other end; ``on_end(reason)`` once, when the link ends (closed by the
    other end, or the mailbox lost for good). :meth:`send` keeps only the
    latest half: each message carries all of it.
    """

    def __init__(
        self,
        spec: TransferSpec,
        role: str,
        on_message: Callable[[dict[str, Any]], None],
        on_end: Callable[[str], None] = lambda _: None,
    ) -> None:
        if role not in (ROLE_READER, ROLE_WRITER):
            raise ValueError(role)
        self.spec = spec
        self.role = role
        self._on_message = on_message
        self._on_end = on_end
        self._lock = threading.Lock()
        self._w: Any = None
        self._pending: bytes | None = None
        self._meeting: Any = None  # the link's wormhole while it meets
        self._stop = threading.Event()
        self.met = threading.Event()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="directory-link", daemon=True)

    def start(self) -> DirectoryLink:
        self._thread.start()
        return self

    def lost_state(self) -> str:
        """What a deadline adds while the link has not met and the server lost its state."""
        return "" if self.met.is_set() else lost_state(self._meeting)

    def send(self, message: dict[str, Any]) -> None:
        data = json.dumps(message, sort_keys=True).encode()
        with self._lock:
            w = self._w
            if w is None:
                self._pending = data
                return
        _send(w, data)

    def _run(self) -> None:
        try:
            w = meet(
                self.spec, directory_code(self.spec.secret), self.role,
                cancelled=self._stop.is_set, what="the other end's directory",
                started=lambda w: setattr(self, "_meeting", w),
            )  # fmt: skip
        except RendezvousCancelled:
            return
        except (DilationError, crochet.ReactorStopped) as e:
            self.error = e
            self._on_end(f"the directory link did not open: {e}")
            return
        with self._lock:
            self._w, pending, self._pending = w, self._pending, None
        self.met.set()
        log.info("directory link of transfer %s open (%s end)", self.spec.transfer_id, self.role)
        if pending is not None:
            _send(w, pending)
        self._receive(w)

    def _receive(self, w: Any) -> None:
        from twisted.internet import reactor

        waiter = None
        try:
            while not self._stop.is_set():
                if waiter is None:
                    waiter = run_and_wait(
                        lambda: crochet.EventualResult(w.get_message(), reactor),
                        timeout=10,
                        on_timeout=lambda: TimeoutError("the reactor did not answer in 10 s"),
                    )
                try:
                    data = waiter.wait(POLL)
                except crochet.TimeoutError:
                    continue
                except crochet.ReactorStopped:
                    return
                except Exception as e:  # closed by the other end, or the mailbox lost
                    waiter = None
                    if not self._stop.is_set():
                        self.error = e
                        self._on_end(f"the directory link ended: {e}")
                    return
                waiter = None
                try:
                    message = json.loads(data)
                    if not isinstance(message, dict):
                        raise ValueError("not an object")
                    self._on_message(message)
                except ValueError as e:
                    log.warning("directory link: ignored a malformed message: %s", e)
        finally:
            if waiter is not None:
                claim(waiter)  # stopped: the close fails it, and that is ours to drop

    def close(self) -> None:
        """Close the link (releases the nameplate, closes the mailbox); idempotent."""
        self._stop.set()
        with self._lock:
            w, self._w = self._w, None
        if w is not None:
            close_wormhole(w)
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(CLOSE_WAIT + 1)


def _send(w: Any, data: bytes) -> None:
    with contextlib.suppress(Exception):
        run_and_wait(
            lambda: w.send_message(data),
            timeout=10,
            on_timeout=lambda: TimeoutError("the reactor did not answer in 10 s"),
        )


def tell_end(
    tell: Callable[[Abort], None],
    wait_ended: Callable[[float], str],
    abort: Abort,
    deadline: float,
    answered: threading.Event,
) -> None:
    """Tell the other end through the directory link, from a thread of its own; set
    ``answered`` when its ``end`` comes before ``deadline``. The mailbox carries nothing
    else, so this does not queue behind data; an end that does not know ``abort`` never
    answers, and the in-band abort decides."""

    def run() -> None:
        tell(abort)
        if wait_ended(deadline):
            log.info("the other end confirmed the abort through the directory link")
            answered.set()

    threading.Thread(target=run, name="end-directory", daemon=True).start()


def heard_abort(
    spec: TransferSpec,
    body: dict[str, Any],
    other: str,
    on_abort: Callable[[Abort], None],
    answer: Callable[[dict[str, Any]], None],
) -> None:
    """The ``other`` end's abort came through the directory link (either end's half):
    answer ``end`` (we heard it: the other end need wait no longer), then end our part
    of the transfer."""
    abort = Abort.from_body(body)
    log.info("transfer %s: %s (directory link)", spec.transfer_id, abort.text(other))
    answer(end_message(abort.text(other)))
    on_abort(abort)


def wait_for_end(cond: threading.Condition, state: DirectoryState, deadline: float) -> str:
    """The other end's ``end`` in ``state`` (merged under ``cond``, which is notified),
    waiting until ``deadline``; "" if none came."""
    with cond:
        while not state.ended and time.monotonic() < deadline:
            cond.wait(min(POLL, max(0.0, deadline - time.monotonic())))
        return state.ended


class ReadingEnd:
    """The reading end of a transfer's directory: the lanes' epochs out, the senders in.

    Held by the Spark registry host (epochs from its lane registry) or by the
    receiving process of the CLI and the Python API (every lane in-process,
    epoch 0). ``on_senders(new ids)`` runs in the link's thread. With
    ``on_abort``, the writing end's abort through the directory ends the
    transfer here: ``on_abort(abort)`` ends the lanes, then this end answers
    ``end`` (the writing end's confirmation that the receiver was told).
    """

    def __init__(
        self,
        spec: TransferSpec,
        on_senders: Callable[[set[int]], None],
        on_abort: Callable[[Abort], None] | None = None,
        on_spoiled: Callable[[set[Door]], None] = lambda _: None,
    ) -> None:
        self.spec = spec
        self._state = DirectoryState()
        self._cond = threading.Condition()
        self._on_senders = on_senders
        self._on_abort = on_abort
        self._on_spoiled = on_spoiled  # doors the senders found a stranger on
        self._spoiled: set[Door] = set()  # ... and the ones our lanes did
        self._half: dict[str, Any] = {}  # ours, whole: the lanes' epochs, our abort or end
        self.ended = threading.Event()
        self.link = DirectoryLink(spec, ROLE_READER, self._from_writer, self._ended)
        self.link.start()

    def _from_writer(self, message: dict[str, Any]) -> None:
        with self._cond:
            told = self._state.abort
            spoiled = spoiled_doors(message) - self._state.spoiled
            new, _ = self._state.merge(message)
            self._cond.notify_all()
        if new:
            log.info("transfer %s: senders %s introduced", self.spec.transfer_id, sorted(new))
            self._on_senders(new)
        if spoiled:
            log.info("transfer %s: senders found strangers on %s", self.spec.transfer_id, spoiled)
            self._on_spoiled(spoiled)
        if told is None and self._state.abort is not None and self._on_abort is not None:
            heard_abort(self.spec, self._state.abort, "sender", self._on_abort, self._send)

    def _send(self, part: dict[str, Any]) -> None:
        with self._cond:
            self._half.update(part)
            half = dict(self._half)
        self.link.send(half)

    def tell_abort(self, abort: Abort) -> None:
        """This end ends the transfer: tell the writing end through the mailbox, ahead of
        the data queued toward us. :meth:`wait_ended` then has its answer."""
        self._send(abort_message(abort.reason, abort.cancelled))

    def wait_ended(self, deadline: float) -> str:
        """The writing end's ``end`` (it heard our abort), waiting until ``deadline``."""
        return wait_for_end(self._cond, self._state, deadline)

    def _ended(self, why: str) -> None:
        if not self.ended.is_set():
            log.info("transfer %s: %s", self.spec.transfer_id, why)

    @property
    def senders(self) -> set[int]:
        return set(self._state.senders)

    @property
    def spoiled(self) -> set[Door]:
        """Doors the senders found a stranger on (for a lane that starts later)."""
        with self._cond:
            return set(self._state.spoiled)

    def report_spoiled(self, doors: set[Door]) -> None:
        """Our lanes found a stranger on ``doors``: the senders waiting there move on."""
        with self._cond:
            self._spoiled |= doors
            part = spoiled_message(self._spoiled)
        self._send(part)

    def publish(
        self, epochs: dict[int, int], ended: dict[int, tuple[int, str]] | None = None
    ) -> None:
        """Tell the writing end every hosted lane's current epoch, and the lanes that ended
        for good (lane -> (epoch, error)): their senders fail with that error at once."""
        self._send(lanes_message(epochs, ended))

    def close(self) -> None:
        self.ended.set()
        self.link.close()


@dataclass
class Paired:
    """A met door wormhole, not yet dilated, and the door it met on."""

    wormhole: Any
    door: Door


def dilate_paired(
    paired: Paired,
    *,
    relay_url: str | None,
    no_listen: bool,
    listen: Iterable[str],
    peer_timeout: float,
    timeout: float,
    no_path_timeout: float,
    receive_buffer: int | None = None,
) -> Any:
    """Dilate a paired wormhole and wrap it in the blocking facade.

    ``peer_timeout`` (the transfer's ``reconnect_timeout``) is also the
    Dilation ``reconnect_timeout``, so its give-up error, which says what was
    tried and names the option's value, is the one raised.
    """
    from ...dilation.api import dilate
    from ...dilation.blocking import BlockingDilation, DilationTimeout

    names = tuple(listen)
    w = paired.wormhole

    def start() -> Any:
        return dilate(
            w,
            relay_url=relay_url,
            no_listen=no_listen,
            expected_subprotocols=names,
            reconnect_timeout=peer_timeout,
            no_path_timeout=no_path_timeout,
        )

    dw = run_and_wait(
        start, timeout=timeout, on_timeout=lambda: DilationTimeout("starting Dilation", timeout)
    )
    extra = {} if receive_buffer is None else {"receive_buffer": receive_buffer}
    return BlockingDilation(
        dw, listen=names, wormhole=w, peer_timeout=peer_timeout, timeout=timeout, **extra
    )


__all__ = [
    "ROLE_LANE",
    "ROLE_READER",
    "ROLE_SENDER",
    "ROLE_WRITER",
    "DirectoryLink",
    "Paired",
    "ReadingEnd",
    "RendezvousCancelled",
    "RendezvousTimeout",
    "claim_door",
    "close_wormhole",
    "dilate_paired",
    "meet",
    "meeting_versions",
]
