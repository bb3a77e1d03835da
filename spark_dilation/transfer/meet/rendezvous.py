"""Rendezvous by introduction, on the crochet reactor: doors, the directory link, views.

The rules are in :mod:`..rules.directory` (pure). This module is their blocking glue:

* :func:`meet` claims one door (or the directory link's nameplate) and waits
  for the one peer the directory sent there: no pairing timer, no crowding;
  either side may come first.
* :class:`DirectoryLink` is the one wormhole between the reading end and the
  writing end of a transfer; each side sends its whole half of the directory
  as a mailbox message whenever it changes.
* :class:`SenderView` is a sending process's view: its sender id and the lanes'
  epochs (fed by the writing end, :mod:`.hub`); the connection pool asks it
  which door to claim and hears when an epoch rises.
* :class:`SenderSet` is a receiving process's view: the sender ids the writing
  end issued, for its lanes' doors.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

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
    SenderDoors,
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
    SenderMeeting,
    Step,
    claim_outcome,
    meeting_versions,
)
from ..rules.protocol import ROLE_LANE, ROLE_SENDER, Abort
from ..rules.spec import TransferSpec

log = logging.getLogger(__name__)
T = TypeVar("T")

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


def _wait_ended(cond: threading.Condition, state: DirectoryState, deadline: float) -> str:
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
        return _wait_ended(self._cond, self._state, deadline)

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


# --- views ---------------------------------------------------------------------------------


class SenderView:
    """A sending process's view of one transfer's directory: its id and the lanes' epochs."""

    def __init__(self, transfer_id: str, sender: int) -> None:
        self.transfer_id = transfer_id
        self.sender = sender
        self._state = DirectoryState()
        self._doors = SenderDoors(sender)
        self._cond = threading.Condition()
        self._listeners: list[Callable[[dict[int, int]], None]] = []
        # The writing end's abort through the directory (the hub's ``tell_abort``);
        # None in a process that only reaches the writing end through its hub.
        self.tell_abort: Callable[[Abort], None] | None = None
        # Our spoiled doors to the writing end (the hub, or this process's hub link).
        self.tell_spoiled: Callable[[set[Door]], None] = lambda _: None
        # Why the directory link has not met, if the server lost its state (the hub's).
        self.link_lost_state: Callable[[], str] = lambda: ""

    def update(self, message: dict[str, Any]) -> None:
        """The writing end's news (lanes' epochs, the end); tells listeners of risen epochs."""
        with self._cond:
            _, risen = self._state.merge(message)
            stale = self._doors.epochs(risen)
            self._cond.notify_all()
            listeners = list(self._listeners)
        if stale:
            log.info("transfer %s: lanes re-hosted (lane: epoch): %s", self.transfer_id, stale)
            for listener in listeners:
                listener(stale)

    def listen(self, listener: Callable[[dict[int, int]], None]) -> None:
        """``listener({lane: new epoch})`` for lanes this process used, when re-hosted."""
        with self._cond:
            self._listeners.append(listener)

    @property
    def ended(self) -> str:
        return self._state.ended

    def wait_ended(self, deadline: float) -> str:
        """The reading end's ``end``, waiting for it until ``deadline``; "" if none came."""
        return _wait_ended(self._cond, self._state, deadline)

    def meeting(self, lane: int, what: str) -> SenderMeeting:
        """A new connection's meeting with ``lane`` (step it through this view)."""
        return SenderMeeting(lane, self._state, self._doors, what)

    def next_door(
        self, meeting: SenderMeeting, deadline: float, cancelled: Callable[[], bool]
    ) -> Door:
        """The meeting's next door, once the lane's epoch is known (blocking). Raises
        :class:`~..rules.meeting.MeetingEnded` (the transfer or the lane ended)."""
        with self._cond:
            while True:
                door = meeting.next_door()
                if door is not None:
                    return door
                if cancelled():
                    raise RendezvousCancelled(f"stopped waiting for {meeting.what}")
                if time.monotonic() >= deadline:
                    raise RendezvousTimeout(f"{meeting.what} was never hosted by the receiver")
                self._cond.wait(POLL)

    def stale(self, meeting: SenderMeeting, stopped: bool) -> bool:
        with self._cond:
            return meeting.stale(stopped)

    def claimed(self, meeting: SenderMeeting, outcome: Outcome, stopped: bool) -> Step:
        """The machine's step; a door we found a stranger on goes to the writing end,
        which tells the lane (whose side may never have seen the stranger)."""
        with self._cond:
            door = meeting.door
            step = meeting.claimed(outcome, stopped)
        if outcome is Outcome.SPOILED and door is not None:
            self.tell_spoiled({door})
        return step


class _Growing(Generic[T]):
    """A set that only grows; each listener hears what it held when it subscribed, then
    each batch of new items (outside the lock)."""

    def __init__(self) -> None:
        self._items: set[T] = set()
        self._lock = threading.Lock()
        self._listeners: list[Callable[[set[T]], None]] = []

    def add(self, items: Iterable[T]) -> None:
        with self._lock:
            new = set(items) - self._items
            self._items |= new
            listeners = list(self._listeners)
        if new:
            for listener in listeners:
                listener(new)

    def subscribe(self, listener: Callable[[set[T]], None]) -> None:
        with self._lock:
            self._listeners.append(listener)
            now = set(self._items)
        if now:
            listener(now)

    def unsubscribe(self, listener: Callable[[set[T]], None]) -> None:
        with self._lock:
            with contextlib.suppress(ValueError):
                self._listeners.remove(listener)


class SenderSet:
    """A receiving process's view: the sender ids the writing end issued (only grows),
    and the doors the senders found a stranger on (only grows)."""

    def __init__(self) -> None:
        self._senders: _Growing[int] = _Growing()
        self._spoiled: _Growing[Door] = _Growing()
        # Our lanes' spoiled doors to the reading end (in-process, or the registry link).
        self.tell_spoiled: Callable[[set[Door]], None] = lambda _: None

    def add(self, senders: Iterable[int]) -> None:
        self._senders.add(senders)

    def subscribe(self, listener: Callable[[set[int]], None]) -> None:
        """Call ``listener`` with the senders known now, then with each new batch."""
        self._senders.subscribe(listener)

    def unsubscribe(self, listener: Callable[[set[int]], None]) -> None:
        self._senders.unsubscribe(listener)

    def spoil(self, doors: set[Door]) -> None:
        """The senders found a stranger on ``doors`` (the directory): lanes hear the new ones."""
        self._spoiled.add(doors)

    def subscribe_spoiled(self, listener: Callable[[set[Door]], None]) -> None:
        """Call ``listener`` with the spoiled doors known now, then with each new batch."""
        self._spoiled.subscribe(listener)

    def unsubscribe_spoiled(self, listener: Callable[[set[Door]], None]) -> None:
        self._spoiled.unsubscribe(listener)


_lock = threading.Lock()
_sender_views: dict[str, SenderView] = {}
_sender_sets: dict[str, SenderSet] = {}
_hub_clients: dict[str, Any] = {}


def register_view(view: SenderView) -> None:
    """This process sends for ``view.transfer_id`` with ``view`` (the writing end itself)."""
    with _lock:
        _sender_views[view.transfer_id] = view


def registered_view(transfer_id: str) -> SenderView | None:
    """This process's view of ``transfer_id``'s directory, if it has one already."""
    with _lock:
        return _sender_views.get(transfer_id)


def forget(transfer_id: str) -> None:
    with _lock:
        _sender_views.pop(transfer_id, None)
        _sender_sets.pop(transfer_id, None)
        client = _hub_clients.pop(transfer_id, None)
    if client is not None:
        client.close()


def sender_view(spec: TransferSpec, deadline: float) -> SenderView:
    """This process's view of ``spec``'s directory: registered by the writing end in this
    process, else obtained from the writing end's hub (:mod:`.hub`), once per process."""
    with _lock:
        view = _sender_views.get(spec.transfer_id)
        if view is not None:
            return view
    from .hub import HubClient

    client = HubClient.connect(spec, deadline)
    with _lock:
        view = _sender_views.get(spec.transfer_id)
        if view is not None:  # another thread connected meanwhile
            extra = client
        else:
            view, extra = client.view, None
            _sender_views[spec.transfer_id] = view
            _hub_clients[spec.transfer_id] = client
    if extra is not None:
        extra.close()
    return view


def sender_set(transfer_id: str) -> SenderSet:
    """The senders this process's lanes of ``transfer_id`` open doors for."""
    with _lock:
        return _sender_sets.setdefault(transfer_id, SenderSet())


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
    "SenderSet",
    "SenderView",
    "claim_door",
    "close_wormhole",
    "dilate_paired",
    "forget",
    "meet",
    "meeting_versions",
    "register_view",
    "sender_set",
    "sender_view",
]
