"""Choosing the one L2 connection of a generation (sans-IO).

Reference behaviour (magic-wormhole 0.24 ``Connector.consider`` and
``select_and_stop_remaining``, WIRE.md §3.4-3.5): the Leader selects the first
connection on which the Follower's KCM arrives, with no preference, sends its
own KCM on it and closes the others. Since relay connections start at once
and race the direct ones, the reference often ends up on the relay even when
a direct path exists.

Ours (:class:`Selection`, Leader side): a connection becomes a *candidate*
when the Follower's KCM arrives on it.

* a direct candidate is selected at once;
* a relay candidate waits up to ``prefer_direct_window`` seconds for a direct
  one, if a direct path can exist at all (else it is selected at once). Each
  relay candidate waits at most the window from its own arrival; when the
  earliest live one has waited that long it is selected;
* exactly one :class:`Select` per generation; every other candidate, and
  every candidate that arrives later, gets a :class:`Drop`;
* a candidate that fails before selection is forgotten (a failure of the
  selected connection is the manager's business, not ours).

This stays wire compatible: the Follower simply selects the connection on
which the Leader's KCM arrives (:class:`FollowerSelection`), and a reference
Follower waits indefinitely on its candidates.

Glue contract: on :class:`Select` the Leader sends its KCM on that connection
(then uses it and starts its :class:`~.keepalive.Keepalive`), and also closes
the generation's connections that are not candidates yet (still in their
handshake) and stops its connectors; on :class:`Drop` it closes that
connection. Call :meth:`Selection.timer_fired` at :meth:`Selection.next_deadline`.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Literal

from ..errors import DilationError

log = logging.getLogger(__name__)

ConnectionKind = Literal["direct", "relay"]
DEFAULT_PREFER_DIRECT_WINDOW = 0.5


class SelectionError(DilationError, ValueError):
    """Selection was driven with impossible input (a bug in the glue)."""


@dataclass(frozen=True, slots=True)
class Select:
    """Use this connection for the generation (Leader: send our KCM on it)."""

    conn_id: Hashable


@dataclass(frozen=True, slots=True)
class Drop:
    """Close this connection: it lost (or arrived after the choice)."""

    conn_id: Hashable


SelectionAction = Select | Drop


class Selection:
    """The Leader's choice among one generation's candidate connections."""

    def __init__(self, prefer_direct_window: float = DEFAULT_PREFER_DIRECT_WINDOW) -> None:
        if not prefer_direct_window >= 0:
            raise ValueError(f"prefer_direct_window must be >= 0, not {prefer_direct_window!r}")
        self.prefer_direct_window = prefer_direct_window
        # conn_id -> arrival time of the live relay candidates (insertion order
        # is arrival order, so the first entry is the earliest).
        self._relays: dict[Hashable, float] = {}
        self._seen: set[Hashable] = set()
        self._selected: Hashable | None = None
        self._done = False

    @property
    def selected(self) -> Hashable | None:
        """The chosen connection, or None before the choice (or after stop)."""
        return self._selected

    @property
    def done(self) -> bool:
        """True once a connection was selected or the generation was stopped."""
        return self._done

    def candidate(
        self, conn_id: Hashable, kind: ConnectionKind, now: float, *, direct_possible: bool = True
    ) -> list[SelectionAction]:
        """The Follower's KCM arrived on ``conn_id``.

        ``direct_possible=False`` (we do not listen and the peer offered no
        direct hint) selects a relay candidate at once: no direct one can come.
        """
        if kind not in ("direct", "relay"):
            raise SelectionError(f"connection kind must be 'direct' or 'relay', not {kind!r}")
        if conn_id in self._seen:
            raise SelectionError(f"connection {conn_id!r} became a candidate twice")
        self._seen.add(conn_id)
        if self._done:
            return [Drop(conn_id)]
        if kind == "direct":
            return self._select(conn_id)
        self._relays[conn_id] = now
        if self.prefer_direct_window == 0 or not direct_possible:
            return self._select(conn_id)
        return []

    def timer_fired(self, now: float) -> list[SelectionAction]:
        """Select the earliest relay candidate if it has waited long enough."""
        deadline = self.next_deadline()
        if deadline is None or now < deadline:
            return []
        return self._select(next(iter(self._relays)))

    def next_deadline(self) -> float | None:
        """When :meth:`timer_fired` must be called; None if nothing is waiting."""
        if self._done or not self._relays:
            return None
        return next(iter(self._relays.values())) + self.prefer_direct_window

    def connection_failed(self, conn_id: Hashable) -> list[SelectionAction]:
        """A connection closed (or failed its handshake) before or after the choice."""
        # Forgetting it also moves the deadline to the next relay's, if any.
        self._relays.pop(conn_id, None)
        return []

    def stop(self) -> list[SelectionAction]:
        """Abandon the generation: drop every candidate, now and later."""
        if self._done:
            return []
        self._done = True
        drops: list[SelectionAction] = [Drop(c) for c in self._relays]
        self._relays.clear()
        return drops

    def _select(self, winner: Hashable) -> list[SelectionAction]:
        self._done = True
        self._selected = winner
        losers = [c for c in self._relays if c != winner]
        self._relays.clear()
        log.debug("selected L2 connection %r, dropping %r", winner, losers)
        return [Select(winner), *(Drop(c) for c in losers)]


class FollowerSelection:
    """The Follower's side: the connection the Leader's KCM arrives on is the one.

    Optionally tell it about connections on which our own KCM went out
    (:meth:`connection_ready`) so the others are dropped on selection, as the
    reference Follower does.
    """

    def __init__(self) -> None:
        self._ready: list[Hashable] = []
        self._selected: Hashable | None = None

    @property
    def selected(self) -> Hashable | None:
        return self._selected

    def connection_ready(self, conn_id: Hashable) -> list[SelectionAction]:
        """Our KCM went out on ``conn_id``; after the choice it is dropped at once."""
        if self._selected is not None:
            return [] if conn_id == self._selected else [Drop(conn_id)]
        if conn_id not in self._ready:
            self._ready.append(conn_id)
        return []

    def connection_failed(self, conn_id: Hashable) -> list[SelectionAction]:
        if conn_id in self._ready:
            self._ready.remove(conn_id)
        return []

    def leader_kcm(self, conn_id: Hashable) -> list[SelectionAction]:
        """The Leader's KCM arrived on ``conn_id``: select the first, drop later ones."""
        if self._selected is None:
            self._selected = conn_id
            losers = [c for c in self._ready if c != conn_id]
            self._ready.clear()
            return [Select(conn_id), *(Drop(c) for c in losers)]
        if conn_id == self._selected:
            # The reference logs this as UnexpectedKCM and keeps the connection.
            log.warning("a second Leader KCM arrived on the selected connection; ignored")
            return []
        return [Drop(conn_id)]
