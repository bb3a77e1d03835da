"""One generation's connection attempts (Twisted glue): listen, dial, select.

A :class:`GenerationConnector` listens on a new ephemeral port (unless
``no_listen``), publishes its hints through the mailbox (direct hints first,
relay hints in a second message, like the reference), dials the peer's direct
hints at once and relays after :data:`RELAY_DELAY` (at once when every
direct dial has already failed: see :func:`relay_delay`), runs an
:class:`~.connection.L2Connection` on every TCP connection, and hands the
selected one to the manager. Everything else is aborted.

The Leader selects the first connection whose Follower KCM arrives, waiting
briefly for a direct one when a relayed one wins the race (``Selection``);
the Follower takes the connection on which the Leader's KCM arrives.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from typing import Any

from twisted.internet import defer, endpoints, protocol
from twisted.internet import error as E
from twisted.python.failure import Failure

from ..transit import hints as H
from ..transit.addresses import unmapped
from ..transit.connector import (
    cancel_pending,
    direct_addresses,
    listen_tcp,
    log_relay_fallback,
)
from . import connection as C
from .deadline import DeadlineTimer
from .records import Record
from .selection import Drop, Select, Selection

log = logging.getLogger(__name__)

RELAY_DELAY = 2.0
PREFER_DIRECT_WINDOW = 0.5
# A slow link hands over a record a packet or two at a time, and every piece costs
# a wake-up of the reactor: a lane relayed at 100 Mbit/s took 23,000 reads of 3 KB
# for 75 MB, half of its host's CPU. A record's first bytes are of no use before
# its last, so after a small read in the middle of one (at least SMALL_READ still
# to come) the selected connection stops reading for a moment and then takes what
# arrived meanwhile in one read. A fast link reads big pieces and never naps.
SMALL_READ = 16 * 1024
READ_NAP = 0.005  # the first nap, and the shortest
READ_NAP_MAX = 0.05  # a record's tail waits at most this long for a slow link


def next_nap(nap: float, read: int) -> float:
    """How long the next nap lasts, given that ``read`` bytes came in the read
    right after a nap of ``nap`` seconds: the time 2 x SMALL_READ bytes take at
    that rate, within [READ_NAP, READ_NAP_MAX]."""
    return min(READ_NAP_MAX, max(READ_NAP, nap * 2 * SMALL_READ / max(read, 1)))


_ids = itertools.count(1)


class L2Protocol(protocol.Protocol):
    """A TCP connection running the Dilation L2 handshake, then records."""

    def __init__(self, connector: GenerationConnector, conn: C.L2Connection, desc: str) -> None:
        self.connector = connector
        self.conn = conn
        self.description = desc
        self.id = next(_ids)
        self.selected = False
        self.is_relay = False
        # Selected on the relay although both sides offered direct hints.
        self.relay_fallback = False
        self.owner: Any = None  # the manager, once selected
        self._held: list[Record] = []
        # Reading stops while the manager holds it (a subchannel's back-pressure)
        # or while napping (SMALL_READ); _update_reading applies both.
        self._flow_paused = False
        self._nap: Any = None  # the IDelayedCall that ends a nap
        self._nap_length = READ_NAP
        self._after_nap = False  # the next read tells how fast the link brings bytes
        self._reading = True

    def connectionMade(self) -> None:
        self.transport.setTcpNoDelay(True)
        self._apply(self.conn.connection_made())

    def dataReceived(self, data: bytes) -> None:
        if self.owner is not None:
            self.owner._traffic(self)  # every byte proves the path alive, not just records
        self._apply(self.conn.data_received(data))
        if self.owner is not None:
            self.owner._flush_ack(self)  # one cumulative ACK per received chunk
            if self._after_nap:
                self._after_nap = False
                self._nap_length = next_nap(self._nap_length, len(data))
            if len(data) < SMALL_READ and self.conn.missing >= SMALL_READ and self.connected:
                self._start_nap()

    def set_flow_paused(self, paused: bool) -> None:
        """The manager's back-pressure: stop (or go on) reading this connection."""
        self._flow_paused = paused
        self._update_reading()

    def _start_nap(self) -> None:
        if self._nap is None:
            self._nap = self.connector._reactor.callLater(self._nap_length, self._end_nap)
            self._update_reading()

    def _end_nap(self) -> None:
        self._nap = None
        self._after_nap = True
        self._update_reading()

    def _update_reading(self) -> None:
        reading = not self._flow_paused and self._nap is None
        if reading == self._reading or self.transport is None:
            return
        self._reading = reading
        if reading:
            self.transport.resumeProducing()
        else:
            self.transport.pauseProducing()

    def _apply(self, events: list[C.Event]) -> None:
        for event in events:
            match event:
                case C.Write(data):
                    self.transport.write(bytes(data) if isinstance(data, bytearray) else data)
                case C.PeerKCM():
                    self.connector._peer_kcm(self)
                case C.RecordReceived(record):
                    if self.owner is not None:
                        self.owner._record_received(self, record)
                    else:
                        self._held.append(record)  # before selection completes
                case C.Failed(error):
                    log.info("dilation %s: %s", self.description, error)
                    self.transport.abortConnection()
                case C.HandshakeComplete():
                    pass

    def attach(self, owner: Any) -> None:
        """Selected: from now on records go to ``owner``."""
        self.owner = owner
        held, self._held = self._held, []
        for record in held:
            owner._record_received(self, record)
        owner._flush_ack(self)

    def send_record(self, record: Record) -> None:
        self.transport.write(bytes(self.conn.encode(record)))

    def abort(self) -> None:
        if self.transport is not None and self.connected:
            self.transport.abortConnection()

    def connectionLost(self, reason: Failure = protocol.connectionDone) -> None:
        self.connected = False
        if self._nap is not None:
            self._nap.cancel()
            self._nap = None
        self.connector._lost(self)
        if self.owner is not None:
            self.owner._connection_lost(self)


def short_reason(error: BaseException | None, message: str) -> str:
    """A failed dial in a few words: "refused", "timed out", or the error's text."""
    if isinstance(error, E.ConnectionRefusedError):
        return "refused"
    if isinstance(error, E.TimeoutError | E.TCPTimedOutError):
        return "timed out"
    if isinstance(error, E.DNSLookupError):
        return "not found (DNS lookup failed)"
    if isinstance(error, E.NoRouteError):
        return "unreachable (no route)"
    return message


class _Factory(protocol.Factory):
    def __init__(self, connector: GenerationConnector, relay: bool, desc: str) -> None:
        self.connector, self.relay, self.desc = connector, relay, desc

    def buildProtocol(self, addr: Any) -> L2Protocol:
        desc = self.desc or f"direct from {unmapped(addr.host)}:{addr.port}"
        return self.connector._build(self.relay, desc)


def relay_delay(direct_possible: bool, direct_pending: bool) -> float:
    """How long relay dials wait: direct paths get a head start while one may still work.

    ``direct_possible``: we listen or the peer offered direct hints;
    ``direct_pending``: a direct dial is under way (or not made yet) or a
    direct connection is alive. Once every direct dial has failed, the
    relays go at once (the peer may still dial us, and the Leader's
    selection still prefers a direct connection that arrives in time).
    """
    return RELAY_DELAY if direct_possible and direct_pending else 0.0


class GenerationConnector:
    """Attempts for one generation; ``on_selected(L2Protocol)`` gets the winner."""

    def __init__(
        self,
        reactor: Any,
        *,
        dilation_key: bytes,
        side: str,
        leader: bool,
        send_hints: Callable[[list[dict[str, Any]]], None],
        on_selected: Callable[[L2Protocol], None],
        relays: list[H.DirectTCPV1Hint],
        no_listen: bool = False,
        listen_addresses: list[str] | None = None,
        prefer_direct_window: float = PREFER_DIRECT_WINDOW,
        on_attempts: Callable[[bool], None] | None = None,
        on_attempt_failed: Callable[[str, str], None] | None = None,
    ) -> None:
        self._reactor = reactor
        self._key = dilation_key
        self._side = side
        self.leader = leader
        self._send_hints = send_hints
        self._on_selected = on_selected
        self._relays = relays
        self._no_listen = no_listen
        self._listen_addresses = listen_addresses
        self._selection = Selection(prefer_direct_window)  # the Leader's choice
        self._port: Any = None
        self._our_direct: list[H.DirectTCPV1Hint] = []
        self._protocols: set[L2Protocol] = set()
        self._pending: list[Any] = []
        self._dialed: set[tuple[str, int, bool]] = set()
        self._window_timer = DeadlineTimer(reactor, self._window_fired)
        self.winner: L2Protocol | None = None
        self.stopped = False
        # Redial bookkeeping: the peer's hints (to dial again) and how many of
        # our attempts are scheduled, dialing or in their handshake.
        self._peer_direct: list[H.DirectTCPV1Hint] = []
        self._peer_relays: list[H.DirectTCPV1Hint] = []
        self._inflight = 0
        # Direct dials under way and whether any was made: when they have all
        # failed, the relays need not wait (see relay_delay).
        self._direct_dials = 0
        self._direct_tried = False
        self._relays_later: list[tuple[Any, H.DirectTCPV1Hint]] = []
        self._on_attempts = on_attempts or (lambda busy: None)
        self._on_attempt_failed = on_attempt_failed or (lambda desc, why: None)

    @defer.inlineCallbacks
    def start(self) -> Any:
        if not self._no_listen:
            self._port, families = yield listen_tcp(self._reactor, _Factory(self, False, ""))
            if self.stopped:
                self._port.stopListening()
                return
            port = self._port.getHost().port
            addresses = direct_addresses(families, self._listen_addresses)
            self._our_direct = [H.DirectTCPV1Hint(a, port, 0.0) for a in addresses]
            self._send_hints([H.encode_hint(h) for h in self._our_direct])
        if self._relays:
            self._send_hints([H.encode_hint(H.RelayV1Hint(tuple(self._relays)))])
            self._dial_relays(self._relays)

    def add_hints(self, hint_dicts: Any) -> None:
        if self.stopped or self.winner is not None:
            return
        parsed = H.parse_hints(list(hint_dicts))
        direct = [h for h in parsed if isinstance(h, H.DirectTCPV1Hint)]
        relays = [
            hint
            for relay in parsed
            if isinstance(relay, H.RelayV1Hint)
            for hint in relay.hints
            if isinstance(hint, H.DirectTCPV1Hint)
        ]
        self._peer_direct += direct
        self._peer_relays += relays
        for hint in direct:
            self._dial(hint, False)
        self._dial_relays(relays)
        for hint in parsed:
            if isinstance(hint, H.TorTCPV1Hint):
                log.info("skipping %s: Tor support is not installed", H.describe(hint))
        self._check_idle()

    def redial(self) -> None:
        """Dial every known hint again (the Follower's retry within a generation)."""
        if self.stopped or self.winner is not None:
            return
        self._dialed.clear()
        for hint in self._peer_direct:
            self._dial(hint, False)
        self._dial_relays([*self._relays, *self._peer_relays])
        self._check_idle()

    @property
    def direct_possible(self) -> bool:
        """A direct path may still appear: we listen, or the peer offered direct hints."""
        return self._port is not None or bool(self._peer_direct)

    def _dial_relays(self, hints: list[H.DirectTCPV1Hint]) -> None:
        delay = relay_delay(self.direct_possible, self._direct_path_pending())
        for hint in hints:
            if delay:
                self._later_dial(delay, hint)
            else:
                self._dial(hint, True)

    def _direct_path_pending(self) -> bool:
        """A direct dial is under way, none was made yet, or a direct connection is alive."""
        return (
            not self._direct_tried
            or self._direct_dials > 0
            or any(not p.is_relay for p in self._protocols)
        )

    def _later_dial(self, delay: float, hint: H.DirectTCPV1Hint) -> None:
        def fire() -> None:
            self._relays_later = [(c, h) for c, h in self._relays_later if c is not call]
            self._attempt_done()
            self._dial(hint, True)
            self._check_idle()

        self._attempt_started()
        call = self._reactor.callLater(delay, fire)
        self._pending.append(call)
        self._relays_later.append((call, hint))

    def _direct_dial_ended(self) -> None:
        self._direct_dials -= 1
        if self._relays_later and not self._direct_path_pending():
            # Every direct dial failed (an unreachable network fails at once):
            # waiting out RELAY_DELAY would only delay the one path left.
            later, self._relays_later = self._relays_later, []
            for call, hint in later:
                if call.active():
                    call.cancel()
                    self._attempt_done()
                    self._dial(hint, True)

    def _dial(self, hint: H.DirectTCPV1Hint, relay: bool) -> None:
        key = (hint.hostname, hint.port, relay)
        if self.stopped or self.winner is not None or key in self._dialed:
            return
        self._dialed.add(key)
        if not relay:
            self._direct_tried = True
            self._direct_dials += 1
        desc = ("relay " if relay else "direct ") + H.describe(hint)
        ep = endpoints.HostnameEndpoint(self._reactor, hint.hostname, hint.port, timeout=10)
        self._attempt_started()
        d = ep.connect(_Factory(self, relay, desc))

        def failed(f: Failure) -> None:
            if f.check(defer.CancelledError):
                return  # we stopped it
            log.info("dilation %s failed: %s", desc, f.getErrorMessage())
            self._on_attempt_failed(desc, short_reason(f.value, f.getErrorMessage()))

        d.addErrback(failed)
        if not relay:
            d.addBoth(lambda _: self._direct_dial_ended())
        # The protocol (if any) was built before this fires: it counts on its own.
        d.addBoth(lambda _: (self._attempt_done(), self._check_idle()))
        self._pending.append(d)

    def _build(self, relay: bool, desc: str) -> L2Protocol:
        conn = C.L2Connection(
            self._key, leader=self.leader, relay_side=self._side if relay else None
        )
        p = L2Protocol(self, conn, desc)
        p.is_relay = relay
        self._protocols.add(p)
        self._attempt_started()
        return p

    # --- how many attempts are alive (for the redial policy) ---

    def _attempt_started(self) -> None:
        self._inflight += 1
        if self._inflight == 1 and not self.stopped and self.winner is None:
            self._on_attempts(True)

    def _attempt_done(self) -> None:
        self._inflight -= 1

    def _check_idle(self) -> None:
        """Tell the manager when nothing of this generation is alive any more."""
        if self._inflight == 0 and not self.stopped and self.winner is None:
            self._on_attempts(False)

    # --- selection ---

    def _peer_kcm(self, p: L2Protocol) -> None:
        if self.stopped or self.winner is not None:
            p.abort()
            return
        if not self.leader:
            self._select(p)  # the Leader's KCM arrived here: it chose this one
            return
        kind = "relay" if p.is_relay else "direct"
        now = self._reactor.seconds()
        # Waiting for a direct path only makes sense if one can exist.
        actions = self._selection.candidate(p, kind, now, direct_possible=self.direct_possible)
        self._apply_selection(actions)

    def _apply_selection(self, actions: list[Select | Drop]) -> None:
        for action in actions:
            match action:
                case Select(winner):
                    self._select(winner)
                case Drop(loser):
                    loser.abort()
        self._arm_window()

    def _arm_window(self) -> None:
        """Wake the selection when a relay candidate has waited long enough."""
        self._window_timer.arm(None if self.stopped else self._selection.next_deadline())

    def _window_fired(self, now: float) -> None:
        self._apply_selection(self._selection.timer_fired(now))

    def _select(self, p: L2Protocol) -> None:
        self.winner = p
        p.selected = True
        if self.leader:
            p.transport.write(bytes(p.conn.select()))
        log.info("dilation connected: %s", p.description)
        if p.is_relay and self._our_direct and self._peer_direct:
            p.relay_fallback = True
            ours = [H.describe(h) for h in self._our_direct]
            theirs = [H.describe(h) for h in self._peer_direct]
            log_relay_fallback("the dilation connection", p.description, ours, theirs)
        self._stop_others()
        self._on_selected(p)

    def _lost(self, p: L2Protocol) -> None:
        if p in self._protocols:
            self._protocols.discard(p)
            self._attempt_done()
            if not p.selected and not self.stopped and self.winner is None:
                self._on_attempt_failed(p.description, "closed during the handshake")
        if self.leader and self.winner is None:
            self._apply_selection(self._selection.connection_failed(p))
        self._check_idle()

    def _stop_others(self) -> None:
        self._window_timer.cancel()
        cancel_pending(self._pending)
        for p in list(self._protocols):
            if p is not self.winner:
                p.abort()
        if self._port is not None:
            self._port.stopListening()
            self._port = None

    def stop(self) -> None:
        """Abandon this generation (the winner, if any, is the manager's)."""
        self.stopped = True
        self._stop_others()
