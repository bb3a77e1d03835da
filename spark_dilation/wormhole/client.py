"""Twisted adapter around :class:`~spark_dilation.wormhole.core.WormholeCore`.

It owns the WebSocket (autobahn), reconnection, timers and Deferreds; every
protocol decision is the core's. The API mirrors magic-wormhole's
``_DeferredWormhole``: ``get_code()``, ``get_verifier()``, ``get_message()``
and friends return Deferreds, ``send_message()`` queues.
"""

from __future__ import annotations

import itertools
import logging
import os
from collections import deque
from collections.abc import Callable
from typing import Any
from urllib.parse import urlparse

# autobahn's NVX accelerators parse C declarations with cffi when imported: about
# 50 ms of CPU in every process, and every Spark task worker that sends pays it.
# Mailbox frames are small, so the pure-Python UTF-8 check costs nothing there.
# An explicit AUTOBAHN_USE_NVX setting wins.
os.environ.setdefault("AUTOBAHN_USE_NVX", "0")

from autobahn.twisted.websocket import (
    WebSocketClientFactory,
    WebSocketClientProtocol,
)
from twisted.application.internet import ClientService, backoffPolicy
from twisted.internet import defer, endpoints
from twisted.internet.interfaces import IReactorTime
from twisted.python.failure import Failure

from ..errors import (
    NoKeyError,
    PeerTimeoutError,
    ServerConnectionError,
    WormholeClosedError,
    WormholeError,
)
from . import core
from .keys import derive_key, to_bytes

log = logging.getLogger(__name__)

DEFAULT_MAILBOX_URL = "ws://relay.magic-wormhole.io:4000/v1"
# How long close() waits for the server to confirm release/close.
CLOSE_TIMEOUT = 10.0
# Tries at the first connection before a wormhole fails with ServerConnectionError
# (the reference gives up at the first): a dropped connection on a flaky network
# must not end a transfer (all 6 lost at 20 % loss: 1 in 15,000), and an unreachable
# server still fails within about 7 s (backoff 0.2, 0.4, ... 3.2 s). A try that
# connects but closes before the WebSocket opens counts as failed. Once connected,
# it reconnects for as long as it lives. Meetings at doors try until their deadline.
CONNECT_TRIES = 6
# ...and no new try after this many seconds: a server that takes TCP connections but
# never answers costs one WebSocket handshake timeout (30 s), as with a single try.
CONNECT_WINDOW = 30.0


_shutting_down: set[int] = set()  # id() of reactors whose shutdown has begun
_watched: set[int] = set()


def _watch_shutdown(reactor: Any) -> None:
    """Note when ``reactor`` starts shutting down (a process exiting drops every
    connection: that is no lost mailbox connection worth a warning)."""
    if id(reactor) in _watched or not hasattr(reactor, "addSystemEventTrigger"):
        return
    _watched.add(id(reactor))
    reactor.addSystemEventTrigger("before", "shutdown", _shutting_down.add, id(reactor))


class _Result:
    """A value that arrives once; any number of Deferreds may wait for it."""

    def __init__(self, reactor: IReactorTime) -> None:
        self._reactor = reactor
        self._waiters: list[defer.Deferred] = []
        self._outcome: tuple[bool, Any] | None = None

    @property
    def done(self) -> bool:
        return self._outcome is not None

    def when(self) -> defer.Deferred:
        d: defer.Deferred = defer.Deferred(canceller=self._forget)
        if self._outcome is None:
            self._waiters.append(d)
        else:
            self._deliver(d)
        return d

    def _forget(self, d: defer.Deferred) -> None:
        if d in self._waiters:
            self._waiters.remove(d)

    def fire(self, value: Any) -> None:
        self._settle((True, value))

    def fail(self, error: BaseException) -> None:
        self._settle((False, error))

    def _settle(self, outcome: tuple[bool, Any]) -> None:
        if self._outcome is not None:
            return
        self._outcome = outcome
        waiters, self._waiters = self._waiters, []
        for d in waiters:
            self._deliver(d)

    def _deliver(self, d: defer.Deferred) -> None:
        # Fire on a later reactor turn so callbacks never re-enter the core.
        assert self._outcome is not None
        ok, value = self._outcome
        self._reactor.callLater(0, _settle, d, ok, value)


class _Queue:
    """In-order values (received messages); get() waits for the next one."""

    def __init__(self, reactor: IReactorTime) -> None:
        self._reactor = reactor
        self._items: deque[Any] = deque()
        self._waiters: deque[defer.Deferred] = deque()
        self._error: BaseException | None = None

    def put(self, item: Any) -> None:
        if self._waiters:
            self._reactor.callLater(0, _settle, self._waiters.popleft(), True, item)
        else:
            self._items.append(item)

    def fail(self, error: BaseException) -> None:
        self._error = error
        while self._waiters:
            self._reactor.callLater(0, _settle, self._waiters.popleft(), False, error)

    def get(self) -> defer.Deferred:
        # A cancelled get() leaves the queue, so it cannot swallow a message.
        d: defer.Deferred = defer.Deferred(canceller=self._forget)
        if self._items:
            self._reactor.callLater(0, _settle, d, True, self._items.popleft())
        elif self._error is not None:
            self._reactor.callLater(0, _settle, d, False, self._error)
        else:
            self._waiters.append(d)
        return d

    def _forget(self, d: defer.Deferred) -> None:
        if d in self._waiters:
            self._waiters.remove(d)


def _settle(d: defer.Deferred, ok: bool, value: Any) -> None:
    if d.called:  # cancelled meanwhile
        return
    if ok:
        d.callback(value)
    else:
        d.errback(Failure(value))


class _MailboxProtocol(WebSocketClientProtocol):
    def onOpen(self) -> None:
        self.factory.wormhole._ws_open(self)

    def onMessage(self, payload: bytes, isBinary: bool) -> None:
        self.factory.wormhole._ws_frame(payload)

    def onClose(self, wasClean: bool, code: int | None, reason: str | None) -> None:
        self.factory.wormhole._ws_closed(self, reason or f"WebSocket closed (code {code})")


class Wormhole:
    """One side of a wormhole, driven by the Twisted reactor.

    ``versions`` is the full plaintext of our ``version`` phase (callers
    normally pass ``app_versions`` and let us build it). ``timeout`` bounds
    the wait for the other side to use the code and confirm the key; when it
    expires the wormhole closes with :class:`PeerTimeoutError`, whose advice
    names ``timeout_option`` (the caller's spelling: ``--timeout``, ``peer_timeout=``).
    ``guard_door`` (a meeting at a door): release the nameplate only once the key is
    confirmed and never after a wrong code (``core.py``, the guard rule).
    ``connect_tries``: first-connection tries before it fails with
    :class:`ServerConnectionError` (within ``CONNECT_WINDOW`` s); None tries until
    it is closed (a meeting, whose caller holds the deadline).
    """

    def __init__(
        self,
        appid: str,
        mailbox_url: str,
        reactor: Any,
        *,
        app_versions: dict[str, Any] | None = None,
        versions: dict[str, Any] | None = None,
        timeout: float | None = None,
        timeout_option: str = "the timeout",
        side: str | None = None,
        retry_policy: Callable[[int], float] | None = None,
        dilation: bool = False,
        keep_nameplate: bool = False,
        guard_door: bool = False,
        connect_tries: int | None = CONNECT_TRIES,
    ) -> None:
        if connect_tries is not None and connect_tries < 1:
            raise ValueError("connect_tries is at least 1 (None: until closed)")
        if versions is None:
            versions = {}
            if dilation:
                from ..dilation.l1 import dilation_versions_message

                versions.update(dilation_versions_message())
            versions["app_versions"] = dict(app_versions or {})
        self._dilation_enabled = dilation or "can-dilate" in versions
        self._dilator: Any = None
        self._reactor = reactor
        _watch_shutdown(reactor)
        self._url = mailbox_url
        self._core = core.WormholeCore(
            appid,
            versions=versions,
            side=side,
            keep_nameplate=keep_nameplate,
            guard_door=guard_door,
        )
        self._timeout = timeout
        self._timeout_option = timeout_option
        self._ws: _MailboxProtocol | None = None
        self._ever_connected = False
        self._connect_tries = connect_tries
        self._connect_since = reactor.seconds()
        self.failed_tries = 0
        """First-connection tries that failed (counted until the WebSocket first opens)."""
        self.connection_problem: str | None = None
        """Why the last try failed, while the WebSocket never opened (None once it did)."""
        self._stopping = False
        self._timers: dict[str, Any] = {}
        self._pings = itertools.count(1)
        self._pongs: dict[Any, defer.Deferred] = {}

        self._welcome = _Result(reactor)
        self._code = _Result(reactor)
        self._peer = _Result(reactor)
        self._key = _Result(reactor)
        self._verifier = _Result(reactor)
        self._versions = _Result(reactor)
        self._closed = _Result(reactor)
        self._messages = _Queue(reactor)
        self._dilate_records = _Queue(reactor)
        self._nameplate_lists = _Queue(reactor)
        self.on_dilate_record: Callable[[bytes], None] | None = None

        self._service = mailbox_service(
            reactor, mailbox_url, self, retry_policy, on_failed=self._try_failed
        )

    # --- public API -----------------------------------------------------------

    @property
    def side(self) -> str:
        return self._core.side

    @property
    def server_lost_state(self) -> bool:
        """The server lost its state (restarted without its database): our lonely claim,
        made again after a reconnect, found a new mailbox, or a reopened mailbox did not
        replay our phases (``core.py``, the re-claim rule and the replay check)."""
        return self._core.server_lost_state

    def get_welcome(self) -> defer.Deferred:
        """The server's welcome dict (``motd`` etc.)."""
        return self._welcome.when()

    def allocate_code(self, code_length: int = 2) -> None:
        """Have the server pick a nameplate; the code arrives via get_code()."""
        self._feed(self._core.allocate_code(code_length))

    def set_code(self, code: str) -> None:
        """Use a code that was typed in or agreed on."""
        self._feed(self._core.set_code(code))

    def get_code(self) -> defer.Deferred:
        return self._code.when()

    def get_unverified_key(self) -> defer.Deferred:
        """Fires when the PAKE finished (the key is not yet confirmed)."""
        return self._key.when()

    def get_verifier(self) -> defer.Deferred:
        """Fires once the peer proved it has the same key (or fails: wrong code)."""
        return self._verifier.when()

    def get_versions(self) -> defer.Deferred:
        """The peer's ``app_versions`` dict."""
        return self._versions.when().addCallback(lambda v: v.app_versions)

    def get_peer_versions(self) -> defer.Deferred:
        """The peer's whole version message (``can-dilate`` and so on)."""
        return self._versions.when().addCallback(lambda v: v.versions)

    def send_message(self, plaintext: bytes) -> None:
        if not isinstance(plaintext, bytes):
            raise TypeError("send_message() takes bytes")
        self._feed(self._core.send_message(plaintext))

    def get_message(self) -> defer.Deferred:
        """The next application message, in order."""
        return self._messages.get()

    def send_dilate(self, plaintext: bytes) -> None:
        """Send one Dilation L1 record through the mailbox (dropped once closing)."""
        if self._core.closing or self._core.closed:
            log.debug("not sending a dilation message: the wormhole is closing")
            return
        self._feed(self._core.send_dilate(plaintext))

    def get_dilate_record(self) -> defer.Deferred:
        return self._dilate_records.get()

    def _set_dilate_handler(self, handler: Callable[[bytes], None]) -> None:
        """Deliver dilate-N records to ``handler`` (queued ones first, in order)."""
        self.on_dilate_record = handler
        while self._dilate_records._items:
            handler(self._dilate_records._items.popleft())

    @property
    def mailbox_connected(self) -> bool:
        """True while the WebSocket to the mailbox server is open."""
        return self._ws is not None

    def dilate(self, **options: Any) -> Any:
        """Start Dilation (see :func:`spark_dilation.dilation.dilate`); once per wormhole."""
        if not self._dilation_enabled:
            raise NotImplementedError("create the Wormhole with dilation=True to dilate it")
        if self._dilator is not None:
            raise WormholeError("dilate() can be called only once per wormhole")
        from ..dilation.api import DilatedWormhole
        from ..dilation.manager import DilationManager

        manager = DilationManager(self, self._reactor, **options)
        self._dilator = DilatedWormhole(manager)
        manager.start()
        return self._dilator

    def derive_key(self, purpose: str, length: int) -> bytes:
        """A key for ``purpose`` derived from the confirmed wormhole key."""
        if not isinstance(purpose, str):
            raise TypeError("purpose must be str")
        if not self._core.verified or self._core.key is None:
            raise NoKeyError()
        return derive_key(self._core.key, to_bytes(purpose), length)

    @property
    def shared_key(self) -> bytes | None:
        """The SPAKE2 key (confirmed or not), for layers like Dilation."""
        return self._core.key

    def list_nameplates(self) -> defer.Deferred:
        """Nameplates in use on the server (for completion)."""
        d = self._nameplate_lists.get()
        self._feed(self._core.list_nameplates())
        return d

    def ping(self) -> defer.Deferred:
        """Round trip to the mailbox server; fires when the pong arrives."""
        value = next(self._pings)
        d: defer.Deferred = defer.Deferred()
        self._pongs[value] = d
        self._feed(self._core.ping(value))
        return d

    def close(self) -> defer.Deferred:
        """Close and wait until the server confirmed it.

        Fires with None after a happy exchange, or fails with the error that
        ended the wormhole (``WrongCodeError``, ``LonelyError``, ...).
        """
        if self._dilator is not None:
            self._dilator.stop()  # drop the L2 connection; no reconnects after this
        self._feed(self._core.close())
        if not self._core.closed and "close" not in self._timers:
            self._timers["close"] = self._reactor.callLater(CLOSE_TIMEOUT, self._close_timed_out)
        return self._closed.when().addCallback(self._raise_result)

    def when_closed(self) -> defer.Deferred:
        """Fires with the close result (None or the error) without closing."""
        return self._closed.when()

    # --- WebSocket events -------------------------------------------------------

    def _ws_open(self, proto: _MailboxProtocol) -> None:
        if self._stopping:
            proto.sendClose()
            return
        if self._ever_connected:
            log.info("reconnected to the mailbox server at %s", self._url)
        elif self.failed_tries:
            log.info(
                "connected to the mailbox server at %s after %d failed tries",
                self._url, self.failed_tries,
            )  # fmt: skip
        self._ever_connected = True
        self.connection_problem = None
        self._ws = proto
        self._feed(self._core.connection_made())

    def _ws_frame(self, payload: bytes) -> None:
        self._feed(self._core.frame_received(payload))

    def _ws_closed(self, proto: _MailboxProtocol, reason: str) -> None:
        if self._ws is proto:
            self._ws = None
            self._feed(self._core.connection_lost())
            if id(self._reactor) in _shutting_down:
                # Debug: it can come after the command's last line, which must stay last.
                log.debug("the mailbox connection closed as this process exits")
            elif not self._stopping:
                # Info, not a warning: it reconnects on its own, a transfer whose data
                # connections are up no longer needs it, and a wait that does need it
                # fails by its own deadline with the cause (no raw line over the bars).
                log.info("lost the mailbox connection (%s); reconnecting", reason)
        elif not self._ever_connected:
            # The TCP connection worked but it never became a mailbox WebSocket.
            self._try_failed(reason)

    def _try_failed(self, reason: str) -> None:
        """A try at the first connection failed; the service tries again after its
        backoff unless the tries are used up."""
        if self._ever_connected or self._stopping:
            return
        self.failed_tries += 1
        self.connection_problem = reason
        late = self._reactor.seconds() - self._connect_since >= CONNECT_WINDOW
        if self._connect_tries is not None and (self.failed_tries >= self._connect_tries or late):
            tries = f" ({self.failed_tries} tries)" if self.failed_tries > 1 else ""
            self._abort(ServerConnectionError(self._url, reason + tries))
        else:
            log.debug("mailbox connection try %d failed: %s", self.failed_tries, reason)

    # --- plumbing ----------------------------------------------------------------

    def _feed(self, events: list[core.Event]) -> None:
        for event in events:
            self._handle(event)

    def _handle(self, event: core.Event) -> None:
        match event:
            case core.SendFrame(payload):
                assert self._ws is not None
                self._ws.sendMessage(payload, isBinary=False)
            case core.StopConnection():
                self._stop_connection()
            case core.GotWelcome(welcome):
                self._welcome.fire(welcome)
            case core.GotCode(code):
                self._code.fire(code)
                self._start_timeout()
            case core.GotPeer():
                self._peer.fire(None)
            case core.GotUnverifiedKey(key):
                self._key.fire(key)
            case core.GotVerifier(verifier):
                self._cancel_timer("peer")
                self._verifier.fire(verifier)
            case core.GotVersions():
                self._versions.fire(event)
            case core.GotMessage(plaintext):
                self._messages.put(plaintext)
            case core.GotDilate(plaintext):
                if self.on_dilate_record is not None:
                    self.on_dilate_record(plaintext)
                else:
                    self._dilate_records.put(plaintext)
            case core.GotNameplates(nameplates):
                self._nameplate_lists.put(list(nameplates))
            case core.GotPong(value):
                d = self._pongs.pop(value, None)
                if d is not None:
                    d.callback(None)
            case core.Closed(error):
                self._finished(error)

    def _finished(self, error: WormholeError | None) -> None:
        for name in list(self._timers):
            self._cancel_timer(name)
        pending = error or WormholeClosedError()
        for result in (
            self._welcome,
            self._code,
            self._peer,
            self._key,
            self._verifier,
            self._versions,
        ):
            result.fail(pending)
        for queue in (self._messages, self._dilate_records, self._nameplate_lists):
            queue.fail(pending)
        for d in self._pongs.values():
            self._reactor.callLater(0, _settle, d, False, pending)
        self._pongs.clear()
        self._closed.fire(error)

    def _stop_connection(self) -> None:
        self._stopping = True
        if self._ws is not None:
            self._ws.sendClose()
        if self._service.running:
            # Never from inside ClientService's own callbacks (it is not reentrant).
            self._reactor.callLater(0, self._stop_service)

    def _stop_service(self) -> None:
        if self._service.running:
            self._service.stopService()

    def _abort(self, error: WormholeError) -> None:
        """End without the server's cooperation (it is unreachable)."""
        self._stop_connection()
        self._feed(self._core.close(error))
        if not self._core.closed:
            # The core wants to tell the server goodbye; it cannot be reached.
            self._finished(error)

    def _start_timeout(self) -> None:
        if self._timeout is not None and "peer" not in self._timers:
            self._timers["peer"] = self._reactor.callLater(self._timeout, self._peer_timed_out)

    def _peer_timed_out(self) -> None:
        self._timers.pop("peer", None)
        if self._core.their_side is None:
            error: WormholeError = PeerTimeoutError(
                self._core.code, self._timeout or 0, self._timeout_option
            )
        else:
            error = WormholeError(
                f"the other side used the code but did not confirm the key within "
                f"{self._timeout:g} seconds; it may have crashed or lost its connection "
                f"(or raise {self._timeout_option})"
            )
        self._feed(self._core.close(error))

    def _close_timed_out(self) -> None:
        self._timers.pop("close", None)
        if not self._closed.done:
            # Info: the mailbox may be gone for good, and this side is done with it.
            log.info("the mailbox server did not confirm our close; giving up on it")
            self._stop_connection()
            self._finished(self._core.result)

    def _cancel_timer(self, name: str) -> None:
        timer = self._timers.pop(name, None)
        if timer is not None and timer.active():
            timer.cancel()

    @staticmethod
    def _raise_result(error: WormholeError | None) -> None:
        if error is not None:
            raise error


def mailbox_service(
    reactor: Any,
    url: str,
    owner: Any,
    retry_policy: Callable[[int], float] | None = None,
    on_failed: Callable[[str], None] | None = None,
) -> ClientService:
    """A started WebSocket service to the mailbox server at ``url`` that reconnects with
    backoff. ``owner`` gets ``_ws_open(proto)``, ``_ws_frame(payload)`` and
    ``_ws_closed(proto, reason)``; it stops the service when done. ``on_failed(reason)``
    hears every connection try that failed before TCP connected."""
    endpoint = _endpoint_for(reactor, url)  # validates the URL first
    if on_failed is not None:
        endpoint = _TellingEndpoint(endpoint, on_failed)
    factory = WebSocketClientFactory(url)
    factory.protocol = _MailboxProtocol
    factory.wormhole = owner
    factory.setProtocolOptions(autoPingInterval=30, autoPingTimeout=60, openHandshakeTimeout=30)
    service = ClientService(
        endpoint,
        factory,
        retryPolicy=retry_policy or backoffPolicy(initialDelay=0.2, maxDelay=5.0, factor=2.0),
        clock=reactor,
    )
    service.startService()
    return service


class _TellingEndpoint:
    """An endpoint that tells ``on_failed`` why a connection try failed (ClientService
    only tells that to its whenConnected waiters, and only by a count fixed up front)."""

    def __init__(self, endpoint: Any, on_failed: Callable[[str], None]) -> None:
        self._endpoint = endpoint
        self._on_failed = on_failed

    def connect(self, factory: Any) -> defer.Deferred:
        def failed(failure: Failure) -> Failure:
            if not failure.check(defer.CancelledError):  # the service stopping
                self._on_failed(_describe(failure))
            return failure

        return self._endpoint.connect(factory).addErrback(failed)


def _endpoint_for(reactor: Any, url: str) -> Any:
    parsed = urlparse(url)
    if parsed.scheme not in ("ws", "wss") or not parsed.hostname:
        raise ValueError(f"not a mailbox URL: {url!r} (expected ws://HOST:PORT/v1)")
    tls = parsed.scheme == "wss"
    port = parsed.port or (443 if tls else 80)
    if tls:
        return endpoints.clientFromString(reactor, f"tls:{parsed.hostname}:{port}")
    return endpoints.HostnameEndpoint(reactor, parsed.hostname, port)


def _describe(failure: Failure) -> str:
    value = failure.value
    text = str(value).strip() or type(value).__name__
    return text.splitlines()[0].rstrip(".")


def create(
    appid: str,
    mailbox_url: str,
    reactor: Any,
    **kwargs: Any,
) -> Wormhole:
    """Start a wormhole client (connects at once). See :class:`Wormhole`."""
    return Wormhole(appid, mailbox_url, reactor, **kwargs)
