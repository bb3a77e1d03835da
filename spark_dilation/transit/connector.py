"""Twisted glue for classic Transit: listen, dial hints, pick one connection.

:class:`TransitConnector` listens on an ephemeral port (unless told not to),
advertises hints, dials the peer's direct hints at once and the relays after
a short delay, runs one :class:`~.protocol.TransitConnectionCore` per TCP
connection and keeps the first that negotiates: the sender answers ``go`` on
it and ``nevermind`` on the rest. The winner is a :class:`TransitConnection`
that sends and receives whole records.
"""

from __future__ import annotations

import logging
import os
import socket
from collections import deque
from typing import Any, BinaryIO

from twisted.internet import defer, endpoints, protocol
from twisted.internet.error import UnsupportedAddressFamily
from twisted.internet.interfaces import IPushProducer, IReactorSocket
from twisted.python.failure import Failure
from zope.interface import implementer

from . import hints as H
from . import protocol as P
from .addresses import LOOPBACK, family_of, local_addresses, unmapped

log = logging.getLogger(__name__)

RELAY_DELAY = 2.0
CONNECT_TIMEOUT = 60.0
SEND_CHUNK = 256 * 1024


def is_pending(item: Any) -> bool:
    """A connect Deferred not yet fired, or a DelayedCall not yet run."""
    return item.active() if hasattr(item, "active") else not item.called


def cancel_pending(items: list[Any]) -> None:
    """Cancel every still-pending connect Deferred or DelayedCall, then forget them all."""
    for item in items:
        if is_pending(item):
            item.cancel()
    items.clear()


@defer.inlineCallbacks
def listen_tcp(reactor: Any, factory: protocol.Factory) -> Any:
    """Listen on an ephemeral port of every interface; fires with ``(port, families)``.

    One IPv6 socket with ``IPV6_V6ONLY`` off takes IPv4 connections too
    (whatever ``net.ipv6.bindv6only`` says), so IPv6 hints are reachable as
    well; without IPv6, or with a reactor that cannot adopt a socket, IPv4
    only. ``families`` says which of ``AF_INET``/``AF_INET6`` the port serves.
    """
    port = _listen_dual_stack(reactor, factory)
    if port is not None:
        return port, frozenset({socket.AF_INET, socket.AF_INET6})
    port = yield endpoints.TCP4ServerEndpoint(reactor, 0).listen(factory)
    return port, frozenset({socket.AF_INET})


def _listen_dual_stack(reactor: Any, factory: protocol.Factory) -> Any:
    if not (socket.has_ipv6 and IReactorSocket.providedBy(reactor)):
        return None
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            s.bind(("::", 0))
            s.listen(50)
            s.setblocking(False)
            return reactor.adoptStreamPort(s.fileno(), socket.AF_INET6, factory)  # a dup of s
    except (OSError, UnsupportedAddressFamily):
        return None  # no IPv6 here


def direct_addresses(families: frozenset[int], listen_addresses: list[str] | None) -> list[str]:
    """The addresses for our direct hints: the caller's, else ours that ``families`` serve."""
    if listen_addresses:
        return list(listen_addresses)
    return [a for a in local_addresses() if family_of(a) in families] or [LOOPBACK]


def log_relay_fallback(what: str, path: str, ours: list[str], theirs: list[str]) -> None:
    """Say that ``what`` ended up on the relay although both sides offered direct hints."""
    log.warning(
        "%s is on the relay (%s) although both sides offered direct hints "
        "(ours: %s; theirs: %s): none of them connected in time",
        what,
        path,
        ", ".join(dict.fromkeys(ours)),
        ", ".join(dict.fromkeys(theirs)),
    )


class TransitConnection(protocol.Protocol):
    """One TCP connection running the Transit handshake, then records."""

    def __init__(self, connector: TransitConnector, core: P.TransitConnectionCore, desc: str):
        self._connector = connector
        self.core = core
        self.description = desc
        self._records: deque[bytes] = deque()
        self._waiters: deque[defer.Deferred] = deque()
        self._record_handler: Any = None
        self._error: P.TransitError | None = None
        self._closed = defer.Deferred()
        self.is_winner = False

    # --- Twisted protocol ---

    def connectionMade(self) -> None:
        self.transport.setTcpNoDelay(True)
        self._handle(self.core.connection_made())

    def dataReceived(self, data: bytes) -> None:
        self._handle(self.core.data_received(data))

    def connectionLost(self, reason: Failure = protocol.connectionDone) -> None:
        # Twisted sets ``connected`` in makeConnection but never clears it;
        # receive_record(), close() and abort() rely on it being accurate.
        self.connected = False
        if self._error is None:
            self._error = P.TransitError(
                "the transit connection closed" + ("" if self.is_winner else " before it was ready")
            )
        while self._waiters:
            self._waiters.popleft().errback(Failure(self._error))
        self._connector._lost(self)
        self._closed.callback(None)

    # --- record API (winner only) ---

    def describe(self) -> str:
        return self.description

    def send_record(self, record: bytes) -> None:
        self.transport.write(self.core.encode_record(record))

    def receive_record(self) -> defer.Deferred:
        """The next record; fails with TransitError if the connection ends first."""
        if self._records:
            return defer.succeed(self._records.popleft())
        if self._error is not None and not self.connected:
            return defer.fail(self._error)
        d: defer.Deferred = defer.Deferred()
        self._waiters.append(d)
        return d

    def set_record_handler(self, handler: Any) -> None:
        """Deliver records to ``handler(record)`` instead of receive_record()."""
        self._record_handler = handler
        while self._records:
            handler(self._records.popleft())

    def pause_reading(self) -> None:
        self.transport.pauseProducing()

    def resume_reading(self) -> None:
        self.transport.resumeProducing()

    def send_file(self, f: BinaryIO, hasher: Any = None, progress: Any = None) -> defer.Deferred:
        """Send ``f`` to EOF as records, honouring TCP back-pressure."""
        return _FileSender(self, f, hasher, progress).start()

    def close(self) -> defer.Deferred:
        if self.connected:
            self.transport.loseConnection()
        return self.when_closed()

    def abort(self) -> None:
        if self.connected:
            self.transport.abortConnection()

    def when_closed(self) -> defer.Deferred:
        d: defer.Deferred = defer.Deferred()
        if self._closed.called:
            d.callback(None)
        else:
            self._closed.addBoth(lambda r: (d.callback(None), r)[1])
        return d

    # --- events from the core ---

    def _handle(self, events: list[P.Event]) -> None:
        for event in events:
            match event:
                case P.Send(data):
                    self.transport.write(data)
                case P.ReadyForDecision():
                    self._handle(self.core.decide(self._connector._claim(self)))
                case P.Negotiated():
                    # The sender claimed at its decision; a receiver claims on "go".
                    if self.core.is_sender or self._connector._claim(self):
                        self._connector._won(self)
                    else:
                        self.transport.loseConnection()  # the sender said go twice
                case P.RecordReceived(record):
                    if self._record_handler is not None:
                        self._record_handler(record)
                    elif self._waiters:
                        self._waiters.popleft().callback(record)
                    else:
                        self._records.append(record)
                case P.Failed(error):
                    self._error = error
                    log.info("transit %s: %s", self.description, error)
                    if self.is_winner:
                        self.transport.abortConnection()
                    else:
                        self.transport.loseConnection()


@implementer(IPushProducer)
class _FileSender:
    def __init__(self, conn: TransitConnection, f: BinaryIO, hasher: Any, progress: Any):
        self._conn, self._f, self._hasher, self._progress = conn, f, hasher, progress
        self._paused = False
        self._done: defer.Deferred = defer.Deferred()

    def start(self) -> defer.Deferred:
        self._conn.transport.registerProducer(self, True)
        self._conn._closed.addCallback(self._lost)
        self.resumeProducing()
        return self._done

    def _lost(self, result: Any) -> Any:
        if not self._done.called:
            self._done.errback(
                P.TransitError("the transit connection closed before the file was sent")
            )
        return result

    def pauseProducing(self) -> None:
        self._paused = True

    def resumeProducing(self) -> None:
        self._paused = False
        while not self._paused and not self._done.called:
            chunk = self._f.read(SEND_CHUNK)
            if not chunk:
                self._conn.transport.unregisterProducer()
                self._done.callback(None)
                return
            if self._hasher is not None:
                self._hasher.update(chunk)
            if self._progress is not None:
                self._progress(len(chunk))
            self._conn.send_record(chunk)

    def stopProducing(self) -> None:
        self._lost(None)


class _Factory(protocol.ClientFactory):
    def __init__(self, connector: TransitConnector, relay: bool, desc: str) -> None:
        self._connector, self._relay, self._desc = connector, relay, desc

    def buildProtocol(self, addr: Any) -> TransitConnection:
        desc = self._desc or f"from {unmapped(addr.host)}:{addr.port}"
        return self._connector._build(self._relay, desc)


class TransitConnector:
    """Find one Transit connection to the peer.

    ``relay_url`` is our transit relay (``tcp:HOST:PORT``); the peer's relay
    hints are used too. ``no_listen`` offers no direct hints (relay only
    from our side); ``listen_addresses`` overrides the advertised addresses.
    """

    def __init__(
        self,
        reactor: Any,
        *,
        is_sender: bool,
        relay_url: str | None = None,
        no_listen: bool = False,
        listen_addresses: list[str] | None = None,
        connect_timeout: float = CONNECT_TIMEOUT,
        max_record: int = P.DEFAULT_MAX_RECORD,
    ) -> None:
        self._reactor = reactor
        self.is_sender = is_sender
        self._side = os.urandom(8).hex()
        self._relays: list[H.RelayV1Hint] = []
        if relay_url:
            self._relays.append(H.RelayV1Hint((H.parse_relay_url(relay_url),)))
        self._no_listen = no_listen
        self._listen_addresses = listen_addresses
        self._timeout = connect_timeout
        self._max_record = max_record
        self._key: bytes | None = None
        self._their_direct: list[H.DirectTCPV1Hint] = []
        self._listening_port: Any = None
        self._my_hints: list[dict[str, Any]] | None = None
        self._connections: set[TransitConnection] = set()
        self._pending: list[Any] = []  # connect Deferreds and delayed calls
        self._winner: TransitConnection | None = None
        self._result: defer.Deferred | None = None
        self._timer: Any = None
        self._attempts: list[str] = []

    # --- setup ---

    @staticmethod
    def get_connection_abilities() -> list[dict[str, str]]:
        return [dict(a) for a in H.ABILITIES]

    @defer.inlineCallbacks
    def get_connection_hints(self) -> Any:
        """Start listening (once) and return our hints as dicts."""
        if self._my_hints is None:
            hints: list[H.Hint] = []
            if not self._no_listen:
                factory = _Factory(self, False, "")
                self._listening_port, families = yield listen_tcp(self._reactor, factory)
                port = self._listening_port.getHost().port
                for addr in direct_addresses(families, self._listen_addresses):
                    hints.append(H.DirectTCPV1Hint(addr, port, 0.0))
            hints.extend(self._relays)
            self._my_hints = [H.encode_hint(h) for h in hints]
        return self._my_hints

    def add_connection_hints(self, hints: Any) -> None:
        for hint in H.parse_hints(hints):
            if isinstance(hint, H.DirectTCPV1Hint):
                self._their_direct.append(hint)
            elif isinstance(hint, H.RelayV1Hint):
                if hint not in self._relays:
                    self._relays.append(hint)
            else:
                log.info("skipping %s: Tor is not supported here", H.describe(hint))

    def set_transit_key(self, key: bytes) -> None:
        self._key = key

    # --- connecting ---

    def connect(self) -> defer.Deferred:
        """Fire with the winning TransitConnection, or fail with TransitError."""
        assert self._key is not None, "set_transit_key() first"
        if self._result is not None:
            return self._result
        self._result = defer.Deferred()
        delay = 0.0
        for hint in self._their_direct:
            self._dial(hint, relay=False)
            delay = RELAY_DELAY
        for relay in self._relays:
            for hint in relay.hints:
                if isinstance(hint, H.DirectTCPV1Hint):
                    call = self._reactor.callLater(delay, self._dial, hint, True)
                    self._pending.append(call)
        if not self._their_direct and not self._relays and self._listening_port is None:
            self._fail("no way to reach the peer: neither side offered a usable hint")
        else:
            self._timer = self._reactor.callLater(self._timeout, self._timed_out)
        return self._result

    def _dial(self, hint: H.DirectTCPV1Hint, relay: bool) -> None:
        if self._winner is not None or self._result is None or self._result.called:
            return
        desc = H.describe(hint, relay)
        self._attempts.append(desc)
        ep = endpoints.HostnameEndpoint(self._reactor, hint.hostname, hint.port, timeout=10)
        d = ep.connect(_Factory(self, relay, desc))
        self._pending.append(d)
        d.addErrback(self._dial_failed, desc)

    def _dial_failed(self, failure: Failure, desc: str) -> None:
        log.info("transit %s failed: %s", desc, failure.getErrorMessage())
        self._attempts.append(f"{desc}: {failure.getErrorMessage()}")
        self._maybe_give_up()

    def _build(self, relay: bool, desc: str) -> TransitConnection:
        assert self._key is not None
        core = P.TransitConnectionCore(
            self._key,
            is_sender=self.is_sender,
            relay_side=self._side if relay else None,
            max_record=self._max_record,
        )
        conn = TransitConnection(self, core, ("relay " if relay else "direct ") + desc)
        self._connections.add(conn)
        return conn

    def _claim(self, conn: TransitConnection) -> bool:
        """First connection to negotiate wins; stop everything else."""
        if self._winner is not None or self._result is None or self._result.called:
            return False
        self._winner = conn
        conn.is_winner = True
        self._stop_others()
        return True

    def _won(self, conn: TransitConnection) -> None:
        """The winner negotiated: records may flow, hand it out."""
        log.info("transit connected: %s", conn.description)
        if conn.description.startswith("relay ") and self._their_direct:
            mine = H.parse_hints(self._my_hints or [])
            ours = [H.describe(h) for h in mine if isinstance(h, H.DirectTCPV1Hint)]
            if ours:
                theirs = [H.describe(h) for h in self._their_direct]
                log_relay_fallback("the transit connection", conn.description, ours, theirs)
        assert self._result is not None
        if not self._result.called:
            self._result.callback(conn)

    def _lost(self, conn: TransitConnection) -> None:
        self._connections.discard(conn)
        if conn is not self._winner and conn.core.state == "failed" and conn._error:
            self._attempts.append(f"{conn.description}: {conn._error}")
        self._maybe_give_up()

    def _maybe_give_up(self) -> None:
        """Fail at once when every attempt failed and nothing can still arrive."""
        if self._result is None or self._result.called or self._winner is not None:
            return
        if self._listening_port is not None or self._connections:
            return  # the peer may still dial us, or a handshake is under way
        if any(is_pending(p) for p in self._pending):
            return
        self._timed_out(all_failed=True)

    def _stop_others(self) -> None:
        if self._timer is not None and self._timer.active():
            self._timer.cancel()
        cancel_pending(self._pending)
        for c in list(self._connections):
            if c is not self._winner:
                c.transport.loseConnection()
        if self._listening_port is not None:
            self._listening_port.stopListening()
            self._listening_port = None

    def _timed_out(self, all_failed: bool = False) -> None:
        self._timer = None
        tried = "; ".join(self._attempts) or "nothing"
        when = ": every attempt failed" if all_failed else f" within {self._timeout:g} s"
        self._fail(
            f"could not connect to the other side{when} (tried: {tried}). "
            "If you are on different networks, give both sides a transit relay."
        )

    def _fail(self, message: str) -> None:
        self._stop_others()
        for c in list(self._connections):
            c.transport.abortConnection()
        if self._result is not None and not self._result.called:
            self._result.errback(P.TransitError(message))

    def stop(self) -> None:
        """Abandon connecting and close everything except the winner."""
        if self._result is not None and not self._result.called:
            self._fail("transit was cancelled")
        else:
            self._stop_others()
