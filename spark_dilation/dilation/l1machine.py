"""The L1 state machine: when to say please, connect, reconnect, stop.

Sans-IO: fed the peer's L1 messages and our connection events, it returns
actions for the manager. States and transitions follow magic-wormhole 0.24
(``_dilation/manager.py``), so a reference peer sees exactly what it expects:

* ``WAITING`` until ``dilate()`` was called and the peer's versions arrived;
  then send ``please`` (``WANTING``);
* the peer's ``please`` decides the roles and starts generation 0
  (``CONNECTING``); hints are used only while ``CONNECTING`` (hints that come
  while ``WANTING`` are kept for that first generation instead of being
  dropped: the reference drops them, which can strand a slow peer);
* Leader loses L2: send ``reconnect``, wait for ``reconnecting``
  (``FLUSHING``), then connect the next generation;
* Follower loses L2: wait for ``reconnect`` (``LONELY``); a ``reconnect``
  while still connected abandons the connection first (``ABANDONING``); in
  every case answer ``reconnecting`` and connect the next generation.

Beyond the reference (the redial fix, :mod:`.redial`): ``retry()`` lets a
Leader whose generation found no path start the next one (``CONNECTING``
-> ``FLUSHING`` with a ``reconnect``; the reference Follower handles a
``reconnect`` while ``CONNECTING`` by dialing again), and ``give_up()`` ends
everything in ``FAILED``, where every input is ignored.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from . import l1

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SendL1:
    plaintext: bytes


@dataclass(frozen=True)
class StartConnecting:
    generation: int
    role: l1.Role


@dataclass(frozen=True)
class UseHints:
    hints: tuple[dict[str, Any], ...]


@dataclass(frozen=True)
class StopConnecting:
    pass


@dataclass(frozen=True)
class AbandonConnection:
    pass


@dataclass(frozen=True)
class NoSharedVersion:
    """The peer cannot dilate with us (no common ``can-dilate`` version)."""


@dataclass(frozen=True)
class Stopped:
    pass


Action = SendL1 | StartConnecting | UseHints | StopConnecting | AbandonConnection
Action = Action | NoSharedVersion | Stopped


class L1Machine:
    def __init__(self, side: str | None = None) -> None:
        self.side = side or l1.make_side()
        self.state = "WAITING"
        self.role: l1.Role | None = None
        self.generation = -1
        self.version: str | None = None
        self._dilate_called = False
        self._their_versions: list[Any] | None = None
        self._early_hints: list[dict[str, Any]] = []
        # The peer's please can arrive before its versions are processed here
        # (records queued before dilate() are replayed at once, while the
        # versions come a reactor turn later): keep it for WANTING.
        self._early_please: l1.PleaseMsg | None = None

    # --- inputs from our side ---

    def dilate(self) -> list[Action]:
        self._dilate_called = True
        return self._maybe_start()

    def got_versions(self, their_can_dilate: Any) -> list[Action]:
        self._their_versions = list(their_can_dilate or [])
        return self._maybe_start()

    def _maybe_start(self) -> list[Action]:
        if self.state != "WAITING" or not self._dilate_called or self._their_versions is None:
            return []
        self.version = l1.choose_version(l1.DILATION_VERSIONS, self._their_versions)
        self.state = "WANTING"
        actions: list[Action] = [SendL1(l1.please(self.side, self.version))]
        if self.version is None:
            actions.append(NoSharedVersion())  # the reference still sends please
        if self._early_please is not None:
            early, self._early_please = self._early_please, None
            try:
                actions.extend(self._rx_please(early))
            except l1.L1Error as e:  # e.g. our own side reflected back: keep our please
                log.warning("ignoring a bad dilation message: %s", e)
        return actions

    def connection_made(self) -> list[Action]:
        if self.state == "CONNECTING":
            self.state = "CONNECTED"
        return []

    def connection_lost(self) -> list[Action]:
        if self.state == "CONNECTED":
            if self.role is l1.Role.LEADER:
                self.state = "FLUSHING"
                return [SendL1(l1.reconnect())]
            self.state = "LONELY"
            return []
        if self.state == "ABANDONING":
            return self._reconnect_as_follower()
        if self.state == "STOPPING":
            self.state = "STOPPED"
            return [Stopped()]
        return []

    def retry(self) -> list[Action]:
        """Our generation found no path: as Leader, start the next one.

        A Follower cannot start a generation; it redials within this one
        (the manager does that), so this returns nothing for it.
        """
        if self.state == "CONNECTING" and self.role is l1.Role.LEADER:
            self.state = "FLUSHING"
            return [StopConnecting(), SendL1(l1.reconnect())]
        return []

    def give_up(self) -> list[Action]:
        """No connection for too long: stop connecting for good."""
        if self.state in ("STOPPED", "STOPPING", "FAILED"):
            return []
        was_connecting = self.state == "CONNECTING"
        self.state = "FAILED"
        return [StopConnecting()] if was_connecting else []

    def stop(self) -> list[Action]:
        if self.state in ("STOPPED", "STOPPING"):
            return []
        if self.state == "CONNECTED":
            self.state = "STOPPING"
            return [AbandonConnection()]
        was_connecting = self.state == "CONNECTING"
        self.state = "STOPPED"
        return [StopConnecting(), Stopped()] if was_connecting else [Stopped()]

    # --- the peer's L1 messages ---

    def received(self, plaintext: bytes) -> list[Action]:
        msg = l1.parse_l1(plaintext)
        if isinstance(msg, l1.PleaseMsg):
            return self._rx_please(msg)
        if isinstance(msg, l1.HintsMsg):
            if self.state == "CONNECTING":
                return [UseHints(msg.hints)]
            if self.state in ("WAITING", "WANTING"):
                self._early_hints.extend(msg.hints)
            else:
                log.debug("ignoring hints in state %s", self.state)
            return []
        if isinstance(msg, l1.ReconnectMsg):
            return self._rx_reconnect()
        if isinstance(msg, l1.ReconnectingMsg):
            if self.state == "FLUSHING":
                return self._next_generation()
            return []
        log.info("ignoring unknown dilation message type %r", msg.type)
        return []

    def _rx_please(self, msg: l1.PleaseMsg) -> list[Action]:
        if self.state == "WAITING" and self._early_please is None:
            self._early_please = msg
            return []
        if self.state != "WANTING":
            log.info("ignoring a 'please' in state %s", self.state)
            return []
        self.role = l1.choose_role(self.side, msg.side)
        actions = self._next_generation()
        if self._early_hints:
            actions.append(UseHints(tuple(self._early_hints)))
            self._early_hints = []
        return actions

    def _rx_reconnect(self) -> list[Action]:
        if self.state == "CONNECTED":
            self.state = "ABANDONING"
            return [AbandonConnection()]
        if self.state == "LONELY":
            return self._reconnect_as_follower()
        if self.state == "CONNECTING" and self.role is l1.Role.FOLLOWER:
            return [StopConnecting(), *self._reconnect_as_follower()]
        return []

    def _reconnect_as_follower(self) -> list[Action]:
        return [SendL1(l1.reconnecting()), *self._next_generation()]

    def _next_generation(self) -> list[Action]:
        assert self.role is not None
        self.state = "CONNECTING"
        self.generation += 1
        return [StartConnecting(self.generation, self.role)]
