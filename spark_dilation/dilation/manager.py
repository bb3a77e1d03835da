"""The Dilation manager: wires the pure layers to Twisted and the wormhole.

It owns no protocol rules itself. The L1 machine decides when to connect,
a :class:`~.connector.GenerationConnector` finds each generation's L2
connection, :class:`~.keepalive.Keepalive` watches it, the L4 queues
(:mod:`.outbound`, :mod:`.inbound`) make delivery durable, and the
:class:`~.subchannels.SubchannelTable` runs L5. The manager moves events
between them and the reactor (sockets, timers, producers).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from twisted.internet import defer
from twisted.internet.interfaces import IHalfCloseableProtocol, IPushProducer
from zope.interface import implementer

from ..errors import DilationError
from ..transit import hints as H
from ..wormhole.keys import derive_key
from . import keepalive as K
from . import l1
from . import l1machine as M
from . import outbound as O
from . import redial as R
from . import subchannels as S
from .connector import GenerationConnector, L2Protocol
from .deadline import DeadlineTimer
from .inbound import Inbound
from .records import Ack, Close, Data, Open, Ping, Pong, Record
from .subchannel import SubChannel

log = logging.getLogger(__name__)


class DilationFailed(DilationError):
    """Dilation cannot happen (the peer cannot dilate, or it was stopped)."""


class DilationReconnectFailed(DilationFailed):
    """No Dilation connection for ``reconnect_timeout`` seconds: given up.

    Every open subchannel and waiter fails with it; the message says what was
    tried and what to check.
    """


class DilationNoPath(DilationReconnectFailed):
    """The connection was never up and every hint failed (``no_path_timeout``).

    Nothing can have moved on it; another try over the same hints finds no
    path either, so callers end instead of retrying (and say it once).
    """


@dataclass
class DilationStatus:
    """A snapshot for UIs: ``on_status(status)`` gets one at every change."""

    role: str | None = None
    generation: int = -1
    state: str = "WAITING"
    connection: str | None = None  # e.g. "direct tcp:10.0.0.2:41234" or "relay ..."
    subchannels: tuple[str, ...] = ()
    hints_sent: list[dict[str, Any]] = field(default_factory=list)
    # L2 connections selected so far; ``connections - 1`` of them were reconnects
    # (``generation`` also counts generations that never connected).
    connections: int = 0
    # Of those, how many are on the relay although both sides offered direct
    # hints (a warning is logged for each, with the hints).
    relay_fallbacks: int = 0
    # While down: since when (reactor time), our retries so far, the last
    # attempt's failure. ``error``: why we gave up (state ``FAILED``).
    down_since: float | None = None
    retries: int = 0
    last_error: str | None = None
    # Bytes the peer ACKed so far and bytes sent but not yet ACKed. Filled in
    # by status() when called (a rate meter samples them); the snapshots
    # on_status gets do not follow every ACK.
    acked_bytes: int = 0
    queued_bytes: int = 0
    error: str | None = None


@implementer(IPushProducer)
class DilationManager:
    def __init__(
        self,
        wormhole: Any,
        reactor: Any,
        *,
        relay_url: str | None = None,
        no_listen: bool = False,
        listen_addresses: list[str] | None = None,
        ping_interval: float | None = None,
        expected_subprotocols: list[str] | tuple[str, ...] = (),
        on_status: Callable[[DilationStatus], None] | None = None,
        high_water: int = O.DEFAULT_HIGH_WATER,
        low_water: int = O.DEFAULT_LOW_WATER,
        reconnect_timeout: float = R.DEFAULT_GIVE_UP_AFTER,
        no_path_timeout: float = R.DEFAULT_NO_PATH_TIMEOUT,
        redial: R.RedialPolicy | None = None,
    ) -> None:
        self._w = wormhole
        self._reactor = reactor
        self._relays = [H.parse_relay_url(relay_url)] if relay_url else []
        self._no_listen = no_listen
        self._listen_addresses = listen_addresses
        self._interval = ping_interval or K.DEFAULT_INTERVAL
        self._on_status = on_status
        self._l1 = M.L1Machine()
        self._outbound = O.Outbound(high_water=high_water, low_water=low_water)
        self._inbound = Inbound()
        self._table = S.SubchannelTable(expected_subprotocols=expected_subprotocols)
        self._channels: dict[int, SubChannel] = {}
        self._factories: dict[str, Any] = {}
        self._connector: GenerationConnector | None = None
        self._l2: L2Protocol | None = None
        self._keepalive: K.Keepalive | None = None
        self._ka_timer = DeadlineTimer(reactor, self._ka_fired)
        self._dilated: defer.Deferred = defer.Deferred()
        self._dilated_waiters: list[defer.Deferred] = []
        self._dilation_failure: BaseException | None = None  # later waiters fail with it
        self._dilation_key: bytes | None = None
        self._status = DilationStatus()
        self.writers_paused = False
        self._transport_paused = False
        self._reading_paused = False
        self._stopped: defer.Deferred | None = None
        # Redial (see .redial): the policy, its timer, and what was tried since
        # the connection went down (description -> (attempts, last error)).
        self._redial = redial or R.RedialPolicy(
            give_up_after=reconnect_timeout, no_path_timeout=no_path_timeout
        )
        self._redial_timer = DeadlineTimer(reactor, self._redial_fired)
        self._tried: dict[str, tuple[int, str]] = {}
        self._down_generation = 0
        self._failure: DilationReconnectFailed | None = None
        # The highest seqnum received in the current chunk, ACKed when the
        # chunk is done (_flush_ack); -1: none due.
        self._ack_due = -1
        self._resume_turn = 0  # rotates which producer resumes first (fairness)

    # --- start ---

    def start(self) -> None:
        self._w._set_dilate_handler(self._got_l1)
        self._apply(self._l1.dilate())
        self._w.get_peer_versions().addCallbacks(self._got_versions, self._wormhole_failed)

    def _got_versions(self, versions: dict[str, Any]) -> None:
        self._apply(self._l1.got_versions(versions.get("can-dilate", [])))

    def _wormhole_failed(self, failure: Any) -> None:
        self._fail_waiters(failure.value)

    def _got_l1(self, plaintext: bytes) -> None:
        try:
            self._apply(self._l1.received(plaintext))
        except DilationError as e:
            log.warning("ignoring a bad dilation message: %s", e)

    # --- L1 actions ---

    def _apply(self, actions: list[M.Action]) -> None:
        for action in actions:
            match action:
                case M.SendL1(plaintext):
                    self._w.send_dilate(plaintext)
                case M.StartConnecting(generation, role):
                    self._start_generation(generation, role)
                case M.UseHints(hints):
                    if self._connector is not None:
                        self._connector.add_hints(hints)
                case M.StopConnecting():
                    if self._connector is not None:
                        self._connector.stop()
                        self._connector = None
                    self._redial_event(self._redial.waiting_for_peer)
                case M.AbandonConnection():
                    if self._l2 is not None:
                        self._l2.abort()
                case M.NoSharedVersion():
                    self._fail_waiters(
                        DilationFailed(
                            "the other side cannot dilate with us: it offered no "
                            "Dilation version we speak (can-dilate)"
                        )
                    )
                case M.Stopped():
                    if self._stopped is not None and not self._stopped.called:
                        self._stopped.callback(None)
        self._publish_status()

    def _start_generation(self, generation: int, role: l1.Role) -> None:
        if self._dilation_key is None:
            key = self._w.shared_key
            assert key is not None, "L1 runs only after the PAKE"
            self._dilation_key = derive_key(key, b"dilation-v1", 32)
        if self._table.role is None:
            self._table.set_role(role)
        if self._connector is not None:
            self._connector.stop()

        # Every hint this generation published (direct and relay messages alike).
        self._status.hints_sent = []

        def send_hints(hints: list[dict[str, Any]]) -> None:
            self._status.hints_sent = [*self._status.hints_sent, *hints]
            self._w.send_dilate(l1.connection_hints(hints))

        def on_attempts(busy: bool) -> None:
            if self._connector is connector:
                self._redial_event(
                    self._redial.attempting if busy else self._redial.attempts_failed
                )

        def on_attempt_failed(description: str, why: str) -> None:
            if self._connector is connector:
                attempts, _ = self._tried.get(description, (0, why))
                self._tried[description] = (attempts + 1, why)
                self._status.last_error = f"{description}: {why}"

        connector = self._connector = GenerationConnector(
            self._reactor,
            dilation_key=self._dilation_key,
            side=self._l1.side,
            leader=role is l1.Role.LEADER,
            send_hints=send_hints,
            on_selected=self._selected,
            relays=self._relays,
            no_listen=self._no_listen,
            listen_addresses=self._listen_addresses,
            on_attempts=on_attempts,
            on_attempt_failed=on_attempt_failed,
        )
        if self._redial.state == "UP":  # the first generation: the clock starts now
            self._went_down()
        self._redial_event(self._redial.attempting)
        connector.start().addErrback(lambda f: log.error("dilation connector: %s", f.value))

    # --- the selected L2 connection ---

    def _selected(self, p: L2Protocol) -> None:
        self._l2 = p
        self._connector = None
        p.transport.registerProducer(self, True)
        p.set_flow_paused(self._reading_paused)
        p.attach(self)
        for record in self._outbound.use_connection():
            p.send_record(record)
        now = self._reactor.seconds()
        self._keepalive = K.Keepalive(self._interval, leader=p.conn.leader)
        self._apply_keepalive(self._keepalive.connection_made(now))
        self._status.connection = p.description
        self._status.connections += 1
        self._status.relay_fallbacks += p.relay_fallback
        self._redial_event(self._redial.connected)
        self._tried.clear()
        self._status.last_error = None
        self._apply(self._l1.connection_made())
        for d in self._dilated_waiters:
            d.callback(None)
        self._dilated_waiters.clear()
        if not self._dilated.called:
            self._dilated.callback(None)

    def _connection_lost(self, p: L2Protocol) -> None:
        if p is not self._l2:
            return
        self._l2 = None
        self._ack_due = -1  # records not ACKed yet are replayed and ACKed on the next one
        self._status.connection = None
        if self._keepalive is not None:
            self._keepalive.connection_lost()
            self._keepalive = None
        self._ka_timer.cancel()
        self._outbound.connection_lost()
        self._transport_paused = False
        self._update_writers()
        self._went_down()
        self._apply(self._l1.connection_lost())

    # --- redial (see .redial) ---

    def _went_down(self) -> None:
        self._down_generation = self._l1.generation
        self._redial_event(self._redial.disconnected)

    def _redial_event(self, event: Callable[[float], list[R.RedialAction]]) -> None:
        if self._failure is not None:
            return
        for action in event(self._reactor.seconds()):
            match action:
                case R.Retry(attempt):
                    self._retry(attempt)
                case R.GiveUp(no_path=no_path):
                    self._give_up(no_path)
                    return
        self._arm_redial_timer()

    def _retry(self, attempt: int) -> None:
        if self._l1.role is l1.Role.LEADER:
            log.info("dilation: no path yet; starting a new generation (retry %d)", attempt)
            self._apply(self._l1.retry())
        elif self._connector is not None:
            log.info("dilation: no path yet; dialing the peer's hints again (retry %d)", attempt)
            self._connector.redial()
        else:
            self._redial_event(self._redial.waiting_for_peer)
        self._publish_status()

    def _arm_redial_timer(self) -> None:
        done = self._failure is not None or self._stopped is not None
        self._redial_timer.arm(None if done else self._redial.next_deadline())

    def _redial_fired(self, now: float) -> None:
        self._redial_event(self._redial.timer_fired)

    def _give_up(self, no_path: bool = False) -> None:
        relays = [f"tcp:{h.hostname}:{h.port}" for h in self._relays]
        kind = DilationNoPath if no_path else DilationReconnectFailed
        error = kind(
            R.give_up_message(
                give_up_after=self._redial.give_up_after,
                down_for=self._reactor.seconds() - (self._redial.down_since or 0.0),
                retries=self._redial.retries,
                generations=max(0, self._l1.generation - self._down_generation),
                tried=dict(self._tried),
                relays=relays,
                mailbox_connected=bool(getattr(self._w, "mailbox_connected", True)),
                first_connection=not self._dilated.called,
                no_path=no_path,
                no_path_timeout=self._redial.no_path_timeout,
            )
        )
        # Whoever waits on this connection raises it; a warning here would
        # print the same line twice on a CLI's stderr.
        log.info("dilation: %s", error)
        self._failure = error
        self._status.error = str(error)
        self._apply(self._l1.give_up())
        self._ka_timer.cancel()
        self._fail_waiters(error)
        channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            channel._connection_lost(error=error)
        self._publish_status()

    @property
    def reconnect_timeout(self) -> float:
        return self._redial.give_up_after

    def failure(self) -> DilationReconnectFailed | None:
        """The give-up error once reconnecting was given up, else None."""
        return self._failure

    def _traffic(self, p: L2Protocol) -> None:
        if p is self._l2 and self._keepalive is not None:
            self._keepalive.traffic_received(self._reactor.seconds())

    def _record_received(self, p: L2Protocol, record: Record) -> None:
        if p is not self._l2:
            return
        now = self._reactor.seconds()
        ka = self._keepalive
        match record:
            case Ping(ping_id):
                if ka is not None:
                    self._apply_keepalive(ka.ping_received(ping_id, now))
            case Pong(ping_id):
                if ka is not None:
                    ka.pong_received(ping_id, now)
            case Ack(resp_seqnum):
                if ka is not None:
                    ka.traffic_received(now)
                self._apply_outbound(self._outbound.handle_ack(resp_seqnum))
            case Open() | Data() | Close():
                if ka is not None:
                    ka.traffic_received(now)
                deliver, ack = self._inbound.received(record)
                # ACKs are cumulative (the reference's Outbound.handle_ack
                # retires every record <= resp_seqnum, as ours does), so one
                # ACK at the end of each received chunk covers all its records.
                if ack.resp_seqnum > self._ack_due:
                    self._ack_due = ack.resp_seqnum
                if deliver:
                    self._apply_l5(self._table.received(record))
            case _:
                log.info("ignoring unexpected record %r", record)

    def _flush_ack(self, p: L2Protocol) -> None:
        """``p`` finished handling a received chunk: send the ACK due for it, if any."""
        if self._ack_due >= 0 and p is self._l2:
            p.send_record(Ack(self._ack_due))
        self._ack_due = -1

    # --- keepalive timers ---

    def _apply_keepalive(self, actions: list[K.KeepaliveAction]) -> None:
        for action in actions:
            match action:
                case K.SendRecord(record):
                    if self._l2 is not None:
                        self._l2.send_record(record)
                case K.AbortConnection(reason):
                    log.warning("dilation: %s; reconnecting", reason)
                    if self._l2 is not None:
                        self._l2.abort()
        self._arm_ka_timer()

    def _arm_ka_timer(self) -> None:
        self._ka_timer.arm(None if self._keepalive is None else self._keepalive.next_deadline())

    def _ka_fired(self, now: float) -> None:
        if self._keepalive is not None:
            self._apply_keepalive(self._keepalive.timer_fired(now))

    # --- L4 / L5 ---

    def _queue(self, message: O.Unsequenced) -> None:
        _record, events = self._outbound.queue(message)
        self._apply_outbound(events)

    def _apply_outbound(self, events: list[O.OutboundEvent]) -> None:
        for event in events:
            match event:
                case O.Transmit(record):
                    if self._l2 is not None:
                        self._l2.send_record(record)
                case O.PauseWriters() | O.ResumeWriters():
                    self._update_writers()

    def _apply_l5(self, actions: list[S.L5Action]) -> None:
        for action in actions:
            match action:
                case O.SendOpen() | O.SendData() | O.SendClose():
                    self._queue(action)
                case S.Accepted(scid, subprotocol):
                    self._accept(scid, subprotocol)
                case S.DataReceived(scid, data):
                    channel = self._channels.get(scid)
                    if channel is not None:
                        channel.protocol.dataReceived(data)
                case S.ConnectionLost(scid):
                    channel = self._channels.pop(scid, None)
                    if channel is not None:
                        channel._connection_lost()
                case S.ReadConnectionLost(scid):
                    if scid in self._channels:
                        self._channels[scid]._connection_lost("read")
                case S.WriteConnectionLost(scid):
                    if scid in self._channels:
                        self._channels[scid]._connection_lost("write")
                case S.Rejected(scid, subprotocol, reason):
                    log.warning("refused subchannel %d (%r): %s", scid, subprotocol, reason)
        # Data alone changes nothing a status shows: skip the snapshot per DATA record.
        if not actions or any(type(a) is not S.DataReceived for a in actions):
            self._publish_status()

    def _accept(self, scid: int, subprotocol: str) -> None:
        factory = self._factories[subprotocol]
        channel = SubChannel(self, scid, subprotocol)
        protocol = factory.buildProtocol(channel.getPeer())
        channel.protocol = protocol
        self._channels[scid] = channel
        protocol.makeConnection(channel)

    # --- API used by subchannels and endpoints ---

    def when_dilated(self) -> defer.Deferred:
        d: defer.Deferred = defer.Deferred()
        if self._dilated.called:
            d.callback(None)
        elif self._dilation_failure is not None:
            d.errback(self._dilation_failure)
        else:
            self._dilated_waiters.append(d)
        return d

    def _fail_waiters(self, error: BaseException) -> None:
        if self._dilation_failure is None:
            self._dilation_failure = error
        waiters, self._dilated_waiters = self._dilated_waiters, []
        for d in waiters:
            d.errback(error)

    def register_listener(self, subprotocol: str, factory: Any) -> None:
        half = IHalfCloseableProtocol.implementedBy(getattr(factory, "protocol", object))
        if subprotocol in self._factories:
            raise ValueError(f"a listener for {subprotocol!r} is already registered")
        self._factories[subprotocol] = factory
        self._apply_l5(self._table.register_listener(subprotocol, half_closeable=bool(half)))

    def open_subchannel(self, subprotocol: str, factory: Any) -> Any:
        if self._failure is not None:
            raise self._failure
        half = IHalfCloseableProtocol.implementedBy(getattr(factory, "protocol", object))
        message = self._table.open(subprotocol, half_closeable=bool(half))
        channel = SubChannel(self, message.scid, subprotocol)
        protocol = factory.buildProtocol(channel.getPeer())
        channel.protocol = protocol
        self._channels[message.scid] = channel
        self._queue(message)
        protocol.makeConnection(channel)
        self._publish_status()
        return protocol

    def subchannel_write(self, scid: int, data: bytes) -> None:
        if self._failure is not None:
            raise self._failure
        self._queue(self._table.write(scid, data))

    def subchannel_lose(self, scid: int) -> None:
        self._apply_l5(self._table.lose_connection(scid))

    def subchannel_lose_write(self, scid: int) -> None:
        self._apply_l5(self._table.lose_write_connection(scid))

    # Reading back-pressure: a paused subchannel pauses the whole L2.
    def pause_reading(self) -> None:
        self._reading_paused = True
        if self._l2 is not None:
            self._l2.set_flow_paused(True)
            if self._keepalive is not None:
                self._keepalive.reading_paused(self._reactor.seconds())

    def resume_reading(self) -> None:
        self._reading_paused = False
        if self._l2 is not None:
            self._l2.set_flow_paused(False)
            if self._keepalive is not None:
                self._keepalive.reading_resumed(self._reactor.seconds())
                self._arm_ka_timer()

    # IPushProducer for the L2 transport: TCP buffers full -> pause writers.
    def pauseProducing(self) -> None:
        self._transport_paused = True
        self._update_writers()

    def resumeProducing(self) -> None:
        self._transport_paused = False
        self._update_writers()

    def stopProducing(self) -> None:
        pass

    def _update_writers(self) -> None:
        paused = self._outbound.writers_paused or self._transport_paused
        if paused == self.writers_paused:
            return
        self.writers_paused = paused
        channels = list(self._channels.values())
        if not paused and channels:
            # Take turns at going first, so one subchannel cannot starve the others.
            turn = self._resume_turn % len(channels)
            self._resume_turn += 1
            channels = channels[turn:] + channels[:turn]
        for channel in channels:
            if self.writers_paused != paused:
                # A producer's write flipped the state again, and that nested
                # call already told every producer; resuming the rest now
                # would let them write past the high-water mark.
                break
            if channel.producer is not None:
                if paused:
                    channel.producer.pauseProducing()
                else:
                    channel.producer.resumeProducing()

    # --- status and stop ---

    def _publish_status(self) -> None:
        s = self._status
        s.role = self._l1.role.name.lower() if self._l1.role else None
        s.generation = self._l1.generation
        s.state = self._l1.state
        s.subchannels = self._table.status().names
        s.down_since = self._redial.down_since
        s.retries = self._redial.retries
        if self._on_status is not None:
            self._on_status(DilationStatus(**vars(s)))

    def status(self) -> DilationStatus:
        now = DilationStatus(**vars(self._status))
        now.acked_bytes = self._outbound.acked_bytes
        now.queued_bytes = self._outbound.queued_bytes
        return now

    def stop(self) -> defer.Deferred:
        """Close the Dilation connection and stop reconnecting."""
        if self._stopped is None:
            self._stopped = defer.Deferred()
            self._apply(self._l1.stop())
            if self._connector is not None:
                self._connector.stop()
                self._connector = None
            self._ka_timer.cancel()
            self._redial_timer.cancel()
            self._fail_waiters(DilationFailed("dilation was stopped"))
        d: defer.Deferred = defer.Deferred()
        self._stopped.addBoth(lambda r: (d.callback(None), r)[1])
        return d
