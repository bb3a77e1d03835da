"""Each process's views of a transfer's directory (blocking; fed by :mod:`.hub` and the
registry links, stepped by the connection pool and the lanes).

* :class:`SenderView` is a sending process's view: its sender id and the lanes'
  epochs (fed by the writing end, :mod:`.hub`); the connection pool asks it
  which door to claim (:class:`~..rules.meeting.SenderMeeting`), hears when an
  epoch rises, and reports the doors its meetings found a stranger on.
* :class:`SenderSet` is a receiving process's view: the sender ids the writing
  end issued, for its lanes' doors, and the doors the senders found spoiled.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, Generic, TypeVar

from ..rules.directory import DirectoryState, Door, SenderDoors
from ..rules.meeting import Outcome, SenderMeeting, Step
from ..rules.protocol import Abort
from ..rules.spec import TransferSpec
from .rendezvous import POLL, RendezvousCancelled, RendezvousTimeout, wait_for_end

log = logging.getLogger(__name__)
T = TypeVar("T")


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
        return wait_for_end(self._cond, self._state, deadline)

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
        # Why the reading end's directory link has not met, if the server lost its state
        # (where the reading end runs in this process).
        self.link_lost_state: Callable[[], str] = lambda: ""

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


__all__ = [
    "SenderSet",
    "SenderView",
    "forget",
    "register_view",
    "registered_view",
    "sender_set",
    "sender_view",
]
