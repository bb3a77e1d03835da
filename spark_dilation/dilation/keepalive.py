"""Keepalive and dead-path detection for one selected L2 connection (sans-IO).

Reference behaviour (magic-wormhole 0.24 ``Manager``/``TrafficTimer``, WIRE.md
§3.8): only the Leader pings, once when the connection is made and then once
per interval; only a PONG counts as traffic; two interval expiries without a
PONG call ``loseConnection``. Its flaws, which this module fixes:

* the first PING is sent before the connection is in use and is dropped.
  Our glue creates a :class:`Keepalive` per L2 connection and calls
  :meth:`Keepalive.connection_made` only once that connection is *selected*
  and the outbound queue uses it (Leader: after its KCM was sent), so the
  PING it returns is really transmitted;
* DATA, ACK and everything else from the peer is ignored, so a busy path
  depends on PONGs that queue behind megabytes of data. Here every inbound
  byte proves the path alive;
* ``loseConnection`` waits forever to flush a stalled path. We return
  :class:`AbortConnection` and the glue calls ``abortConnection()``.

The rule, precisely. ``last_rx`` is the time of the latest inbound traffic
(:meth:`~Keepalive.traffic_received`, :meth:`~Keepalive.ping_received` or
:meth:`~Keepalive.pong_received`), starting at the time of
:meth:`~Keepalive.connection_made` (the KCM that selected the connection was
itself inbound traffic). The connection is aborted at ``last_rx + timeout``
(``timeout`` is ``2 * interval`` by default), that is, iff a gap of inbound
traffic reaches ``timeout``. Time spent with our own reading paused
(:meth:`~Keepalive.reading_paused`) does not count: the silence is ours.

Leader: sends ``Ping`` at ``connection_made`` and every ``interval`` after it
(a fixed cadence, busy or idle, like the reference's steady state). Because
pings are ``interval`` apart, when the abort fires a PING sent at least one
interval earlier is still unanswered: the peer had a full interval to reply.

Follower: never sends PINGs (the reference Follower never does, and the
reference's status logic assumes "one side sees only Pings"). It answers every
PING with a PONG carrying the same id, and it runs the same dead-path rule,
relying on the Leader's PINGs to arrive at least once per ``interval``: if
nothing arrives for ``timeout`` it returns :class:`AbortConnection` so it stops
waiting on a dead L2, and then waits for the Leader to reconnect (the
Follower cannot start a new generation itself; the reconnect comes as an L1
``reconnect`` message or simply a new L2 from the Leader). A needless abort is
harmless to data (L4 replays un-ACKed records) but costs a reconnection, so
the Follower's ``timeout`` must exceed the Leader's ping interval: both sides
default to the reference's 30 s; against a Leader configured with a longer
interval, pass a larger ``timeout``.

Limitation shared with the reference: a peer that stops *reading* for longer
than ``timeout`` (one paused subchannel pauses its whole L2) looks dead, since
it answers nothing; we then reconnect and replay, which is safe.

The glue contract: call :meth:`~Keepalive.timer_fired` at (or after)
:meth:`~Keepalive.next_deadline`, before delivering later events; feed
inbound traffic as it arrives, ideally on every ``dataReceived`` (so a single
huge record arriving slowly still counts), at least once per decoded record.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

from ..errors import DilationError
from .records import Ping, Pong, Record

log = logging.getLogger(__name__)

DEFAULT_INTERVAL = 30.0  # the reference's ``ping_interval or 30.0``


class KeepaliveError(DilationError):
    """The keepalive was driven in an impossible order (a bug in the glue)."""


@dataclass(frozen=True, slots=True)
class SendRecord:
    """Send this record on the connection now (it is not queued by L4)."""

    record: Record


@dataclass(frozen=True, slots=True)
class AbortConnection:
    """The path is dead: call ``abortConnection()`` (never ``loseConnection()``)."""

    reason: str


KeepaliveAction = SendRecord | AbortConnection


class Keepalive:
    """Pings (Leader), PONG replies (both) and the dead-path rule for one L2 connection.

    One instance per selected connection: after :meth:`connection_lost` or an
    abort it is finished and ignores everything.
    """

    def __init__(
        self,
        interval: float = DEFAULT_INTERVAL,
        *,
        leader: bool,
        timeout: float | None = None,
        random_id: Callable[[int], bytes] = os.urandom,
    ) -> None:
        if not interval > 0:
            raise ValueError(f"the keepalive interval must be positive, not {interval!r}")
        timeout = 2 * interval if timeout is None else timeout
        if not timeout > 0:
            raise ValueError(f"the keepalive timeout must be positive, not {timeout!r}")
        self.interval = interval
        self.timeout = timeout
        self.leader = leader
        self._random_id = random_id
        self._state = "new"  # -> "connected" -> "aborted" | "closed"
        self._last_rx = 0.0
        self._next_ping = 0.0
        self._paused = False
        # ping_id -> time sent; pruned so a peer that never PONGs cannot grow it.
        self._outstanding: dict[bytes, float] = {}

    # --- introspection ------------------------------------------------------------

    @property
    def connected(self) -> bool:
        """True between connection_made and the abort or connection_lost."""
        return self._state == "connected"

    @property
    def aborted(self) -> bool:
        return self._state == "aborted"

    @property
    def last_traffic(self) -> float:
        """When the peer was last heard from (connection_made counts)."""
        return self._last_rx

    @property
    def outstanding_pings(self) -> dict[bytes, float]:
        """Unanswered PINGs (id -> time sent), a copy."""
        return dict(self._outstanding)

    # --- events ---------------------------------------------------------------------

    def connection_made(self, now: float) -> list[KeepaliveAction]:
        """The connection was selected and is in use: start (Leader: first PING)."""
        if self._state != "new":
            raise KeepaliveError(
                "connection_made called twice: create a new Keepalive for each connection"
            )
        self._state = "connected"
        self._last_rx = now
        if not self.leader:
            return []
        self._next_ping = now + self.interval
        return [self._ping(now)]

    def traffic_received(self, now: float) -> None:
        """Anything at all arrived from the peer: the path works."""
        if self._state == "connected":
            # max(): a glue that reports events slightly out of order must
            # never move the deadline backwards.
            self._last_rx = max(self._last_rx, now)

    def ping_received(self, ping_id: bytes, now: float) -> list[KeepaliveAction]:
        """Answer a PING with a PONG of the same id (both roles, like the reference)."""
        if self._state != "connected":
            return []
        self.traffic_received(now)
        return [SendRecord(Pong(ping_id))]

    def pong_received(self, ping_id: bytes, now: float) -> float | None:
        """Record a PONG; returns the round-trip time, or None for an unknown id.

        An unknown id (answered too late, or never ours) is ignored, but the
        PONG still counts as traffic.
        """
        if self._state != "connected":
            return None
        self.traffic_received(now)
        sent = self._outstanding.pop(ping_id, None)
        if sent is None:
            log.debug("PONG for unknown ping id %s ignored", ping_id.hex())
            return None
        return now - sent

    def reading_paused(self, now: float) -> None:
        """We stopped reading the connection (back-pressure): suspend the dead-path rule."""
        if self._state == "connected":
            self._paused = True

    def reading_resumed(self, now: float) -> None:
        """We read again: the peer gets a fresh ``timeout`` from now."""
        if self._state == "connected" and self._paused:
            self._paused = False
            # Whatever the peer sent meanwhile sits in our socket buffer and
            # arrives now; we cannot blame it for silence we caused.
            self._last_rx = max(self._last_rx, now)

    def connection_lost(self) -> None:
        """The connection is gone (after an abort, or for any other reason)."""
        self._state = "closed"
        self._outstanding.clear()

    # --- time -----------------------------------------------------------------------

    def next_deadline(self) -> float | None:
        """When :meth:`timer_fired` must next be called; None if never."""
        if self._state != "connected":
            return None
        deadlines = []
        if not self._paused:
            deadlines.append(self._last_rx + self.timeout)
        if self.leader:
            deadlines.append(self._next_ping)
        return min(deadlines) if deadlines else None

    def timer_fired(self, now: float) -> list[KeepaliveAction]:
        """Do whatever is due at ``now`` (an early call is harmless)."""
        if self._state != "connected":
            return []
        if not self._paused and now >= self._last_rx + self.timeout:
            # Checked before pinging: a dead path gets no more PINGs.
            self._state = "aborted"
            self._outstanding.clear()
            silent = now - self._last_rx
            peer = "follower" if self.leader else "leader"
            return [
                AbortConnection(
                    f"nothing received from the Dilation {peer} for {silent:.1f} s "
                    f"(keepalive timeout {self.timeout:g} s): the path is dead"
                )
            ]
        if self.leader and now >= self._next_ping:
            # Fixed cadence; if the timer fired late, skip the missed slots
            # rather than sending a burst of PINGs.
            while self._next_ping <= now:
                self._next_ping += self.interval
            return [self._ping(now)]
        return []

    # --- internals ------------------------------------------------------------------

    def _ping(self, now: float) -> SendRecord:
        # Forget PINGs older than the timeout: if the path is alive without
        # answering them, they no longer tell us anything.
        horizon = now - self.timeout
        for old in [i for i, sent in self._outstanding.items() if sent < horizon]:
            del self._outstanding[old]
        # Unique among unanswered PINGs, so a PONG names exactly one of them.
        for _ in range(100):
            ping_id = self._random_id(4)
            if ping_id not in self._outstanding:
                break
        else:
            raise KeepaliveError("the ping id source keeps repeating itself")
        self._outstanding[ping_id] = now
        return SendRecord(Ping(ping_id))
