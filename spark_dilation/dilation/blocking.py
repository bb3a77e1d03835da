"""Blocking Dilation for threads that are not the reactor (Spark tasks, scripts).

The Twisted API (:func:`~spark_dilation.dilation.dilate`) runs on the
reactor; Spark tasks are plain threads and processes. This module puts a
small blocking layer on top, with the reactor in a crochet-managed thread
(as :mod:`spark_dilation.wormhole.blocking` does for the mailbox)::

    d = BlockingDilation.create(APPID, MAILBOX, relay_url=RELAY, listen=["rows"])
    print(d.code)                                # tell the other side
    ch = d.accept("rows", timeout=60)            # or: ch = d.open("rows")
    while (message := ch.receive(timeout=30)) is not None:
        ...                                      # one send() is one message
    d.close()

or wrap a reactor-side :class:`~spark_dilation.dilation.api.DilatedWormhole`
(``BlockingDilation(dw, listen=[...])``). Every method may be called from any
thread but the reactor's; objects are thread-safe.

Flow control, both ways bounded:

* ``send()`` blocks while Dilation's back-pressure says pause (the un-ACKed
  L4 queue or the TCP buffer is full) and while ``send_buffer`` bytes are
  already on their way to the reactor, so nothing piles up there.
* Each subchannel buffers at most about ``receive_buffer`` bytes (plus one
  message and one socket read) that ``receive()`` has not taken yet; past
  that, reading of the *whole* Dilation connection pauses (a Dilation limit:
  there is no per-subchannel credit) until the buffer drains to half. So a
  subchannel nobody reads from stalls its siblings: read every subchannel
  you accept.

Errors are typed: :class:`DilationTimeout` (also a ``TimeoutError``),
:class:`SubchannelClosed`,
:class:`~spark_dilation.dilation.manager.DilationReconnectFailed` (no
Dilation connection for ``peer_timeout`` seconds despite retries; it says
what was tried), :class:`PeerGone` (the same, for a wrapped connection whose
own ``reconnect_timeout`` is longer), :class:`DilationClosed`; ``open()``
may also raise :class:`~spark_dilation.dilation.manager.DilationFailed`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from twisted.internet import defer, protocol, task
from twisted.internet.interfaces import IPushProducer
from twisted.python import threadable
from zope.interface import implementer

from ..errors import DilationError
from ..wormhole.blocking import call_soon, ensure_reactor, run_and_wait
from .api import DilatedWormhole, dilate

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT = 120.0
DEFAULT_PEER_TIMEOUT = 60.0
DEFAULT_SEND_BUFFER = 4 * 1024 * 1024
DEFAULT_RECEIVE_BUFFER = 4 * 1024 * 1024
# Our peers refuse frames above 64 MiB (framing.DEFAULT_MAX_FRAME), so a
# bigger message would only break the connection on the other side.
MAX_MESSAGE_SIZE = 64 * 1024 * 1024
_WATCH_INTERVAL = 0.25


# --- errors ---------------------------------------------------------------------


class BlockingDilationError(DilationError):
    """Base class of the errors raised by the blocking Dilation API."""


class DilationTimeout(BlockingDilationError, TimeoutError):
    """A blocking call waited longer than its timeout."""

    def __init__(self, what: str, timeout: float) -> None:
        self.timeout = timeout
        super().__init__(f"{what} did not happen within {timeout:g} seconds")


class SubchannelClosed(BlockingDilationError):
    """The subchannel was closed (by us, or by the peer for sending)."""


class PeerGone(BlockingDilationError):
    """The other side has been unreachable for longer than ``peer_timeout``."""


class DilationClosed(BlockingDilationError):
    """:meth:`BlockingDilation.close` was called (or the wormhole under it was closed)."""

    def __init__(self, message: str = "this Dilation connection was closed locally") -> None:
        super().__init__(message)


class MessageTooLarge(BlockingDilationError, ValueError):
    def __init__(self, size: int) -> None:
        self.size = size
        super().__init__(
            f"a message of {size} bytes is larger than the {MAX_MESSAGE_SIZE} bytes a "
            "Dilation peer accepts; split it into smaller messages"
        )


# --- helpers ----------------------------------------------------------------------


def _reactor() -> Any:
    from twisted.internet import reactor

    return reactor


def _not_in_reactor(what: str) -> None:
    if threadable.isInIOThread():
        raise RuntimeError(
            f"{what} blocks, so it cannot run in the reactor thread; use the Twisted API "
            "(spark_dilation.dilation.dilate) there"
        )


def _run(fn: Callable[[], Any], timeout: float, what: str) -> Any:
    """Run ``fn`` in the reactor, wait for its (Deferred) result."""
    _not_in_reactor(what)
    return run_and_wait(fn, timeout=timeout, on_timeout=lambda: DilationTimeout(what, timeout))


class _Deadline:
    def __init__(self, timeout: float | None) -> None:
        self.at = None if timeout is None else time.monotonic() + timeout

    def left(self) -> float | None:
        return None if self.at is None else max(0.0, self.at - time.monotonic())

    def expired(self) -> bool:
        return self.at is not None and time.monotonic() >= self.at


# --- one subchannel -----------------------------------------------------------------


@dataclass(frozen=True)
class SubchannelStats:
    """A snapshot of one subchannel's buffers (for tests and monitoring)."""

    buffered_bytes: int  # received, not yet taken by receive()
    buffered_messages: int
    peak_buffered_bytes: int
    inflight_bytes: int  # given to send(), not yet handed to Dilation by the reactor
    peak_inflight_bytes: int
    reading_paused: bool  # this subchannel is holding the Dilation connection's reading
    writable: bool  # Dilation's back-pressure lets us write


class BlockingSubchannel:
    """One subchannel, message by message; made by ``open()`` or ``accept()``."""

    def __init__(self, owner: BlockingDilation, subprotocol: str) -> None:
        self.subprotocol = subprotocol
        self._owner = owner
        self._cond = threading.Condition()
        self._proto: _Protocol | None = None  # reactor side
        # Receiving (appended by the reactor, taken by receive()).
        self._inbox: deque[bytes] = deque()
        self._inbox_bytes = 0
        self._peak_inbox = 0
        self._reading_paused = False
        self._resume_scheduled = False
        # Sending.
        self._writable = True
        self._inflight = 0
        self._peak_inflight = 0
        # Ends.
        self._eof = False  # the subchannel is gone (the peer closed it, or we did)
        self._closed = False  # close() was called
        self._error: BaseException | None = None

    @property
    def scid(self) -> int | None:
        proto = self._proto
        return None if proto is None or proto.transport is None else proto.transport.scid

    def __repr__(self) -> str:
        return f"<BlockingSubchannel {self.subprotocol!r} scid={self.scid}>"

    # --- thread side ------------------------------------------------------------

    def send(self, message: bytes | bytearray | memoryview, timeout: float | None = None) -> None:
        """Queue one message (one ``receive()`` on the other side).

        Blocks while Dilation asks writers to pause; ``timeout`` (default:
        the owner's) bounds that wait. Returning means the message is queued
        in order, not that it was delivered; :meth:`close` keeps the order.
        """
        _not_in_reactor("send()")
        data = bytes(message)  # the caller may reuse its buffer; bytes are not copied
        if len(data) > MAX_MESSAGE_SIZE:
            raise MessageTooLarge(len(data))
        deadline = _Deadline(self._owner.timeout if timeout is None else timeout)
        budget = self._owner.send_buffer
        with self._cond:
            while True:
                self._check_sendable()
                # One message at a time may exceed the budget, never more.
                if self._writable and (self._inflight == 0 or self._inflight + len(data) <= budget):
                    break
                if deadline.expired() or not self._cond.wait(deadline.left()):
                    if deadline.expired():
                        raise DilationTimeout(
                            f"sending on subchannel {self.subprotocol!r} (the peer is not "
                            "reading, or the connection is down)",
                            self._owner.timeout if timeout is None else timeout,
                        )
            self._inflight += len(data)
            self._peak_inflight = max(self._peak_inflight, self._inflight)
        _reactor().callFromThread(self._write, data)

    def receive(self, timeout: float | None = None) -> bytes | None:
        """The next message, or None once the peer closed the subchannel (EOF).

        Raises :class:`DilationTimeout` if nothing arrives within ``timeout``
        (default: the owner's), :class:`SubchannelClosed` after our own
        :meth:`close`, ``DilationReconnectFailed`` (or :class:`PeerGone`) if
        the connection stayed down.
        """
        _not_in_reactor("receive()")
        deadline = _Deadline(self._owner.timeout if timeout is None else timeout)
        with self._cond:
            while not self._inbox:
                if self._closed:
                    raise SubchannelClosed(f"subchannel {self.subprotocol!r} was closed by us")
                if self._eof:
                    return None
                if self._error is not None:
                    raise self._error
                if deadline.expired() or not self._cond.wait(deadline.left()):
                    if deadline.expired() and not self._inbox:
                        raise DilationTimeout(
                            f"a message on subchannel {self.subprotocol!r}",
                            self._owner.timeout if timeout is None else timeout,
                        )
            data = self._inbox.popleft()
            self._inbox_bytes -= len(data)
            resume = (
                self._reading_paused
                and not self._resume_scheduled
                and self._inbox_bytes <= self._owner.receive_buffer // 2
            )
            if resume:
                self._resume_scheduled = True
        if resume:
            _reactor().callFromThread(self._owner._sync_reading, self)
        return data

    def close(self, timeout: float | None = None) -> None:
        """Close the subchannel after every message sent so far (idempotent).

        Waits until the CLOSE is queued behind them; messages not received
        yet are dropped, and ``send``/``receive`` raise :class:`SubchannelClosed`.
        """
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._inbox.clear()
            self._inbox_bytes = 0
            self._cond.notify_all()
        if threadable.isInIOThread():
            self._lose()
            return
        try:
            _run(self._lose, self._owner.timeout if timeout is None else timeout, "close()")
        except DilationTimeout:
            log.warning("closing subchannel %r timed out", self.subprotocol)

    def stats(self) -> SubchannelStats:
        with self._cond:
            return SubchannelStats(
                buffered_bytes=self._inbox_bytes,
                buffered_messages=len(self._inbox),
                peak_buffered_bytes=self._peak_inbox,
                inflight_bytes=self._inflight,
                peak_inflight_bytes=self._peak_inflight,
                reading_paused=self._reading_paused,
                writable=self._writable,
            )

    def __enter__(self) -> BlockingSubchannel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_sendable(self) -> None:
        if self._closed:
            raise SubchannelClosed(f"cannot send: subchannel {self.subprotocol!r} was closed by us")
        if self._error is not None:
            raise self._error
        if self._eof:
            raise SubchannelClosed(
                f"cannot send: the other side closed subchannel {self.subprotocol!r}"
            )

    # --- reactor side -----------------------------------------------------------

    def _write(self, data: bytes) -> None:
        try:
            proto = self._proto
            # Not checking _closed: close() comes after the sends it follows.
            if proto is not None and not self._eof:
                proto.transport.write(data)
        except DilationError as e:  # e.g. the peer's CLOSE arrived meanwhile
            log.info("dropping a message for subchannel %r: %s", self.subprotocol, e)
        except Exception as e:  # a bug below us: make the sending thread see it
            log.exception("writing on subchannel %r failed", self.subprotocol)
            self._fail(e)
        finally:
            with self._cond:
                self._inflight -= len(data)
                self._cond.notify_all()

    def _lose(self) -> None:
        self._owner._sync_reading(self)  # a closed subchannel holds nothing paused
        proto = self._proto
        if proto is not None and not self._eof:
            proto.transport.loseConnection()

    def _data(self, data: bytes) -> None:
        with self._cond:
            if self._closed:
                return
            self._inbox.append(data)
            self._inbox_bytes += len(data)
            self._peak_inbox = max(self._peak_inbox, self._inbox_bytes)
            self._cond.notify_all()
            pause = not self._reading_paused and self._inbox_bytes > self._owner.receive_buffer
        if pause:
            self._owner._sync_reading(self)

    def _set_writable(self, writable: bool) -> None:
        with self._cond:
            self._writable = writable
            self._cond.notify_all()

    def _lost(self, error: BaseException | None = None) -> None:
        with self._cond:
            if error is None:
                self._eof = True
            elif self._error is None:
                self._error = error
            self._cond.notify_all()
        self._owner._sync_reading(self)
        self._owner._forget(self)

    def _fail(self, error: BaseException) -> None:
        with self._cond:
            if self._error is None:
                self._error = error
            self._cond.notify_all()


@implementer(IPushProducer)
class _Protocol(protocol.Protocol):
    """The reactor-side protocol on a subchannel; also its (push) producer."""

    def __init__(self, channel: BlockingSubchannel, on_made: Callable[[BlockingSubchannel], None]):
        self.channel = channel
        self._on_made = on_made

    def connectionMade(self) -> None:
        self.channel._proto = self
        self.transport.registerProducer(self, True)  # pauses us at once if Dilation is full
        self._on_made(self.channel)

    def dataReceived(self, data: bytes) -> None:
        self.channel._data(data)

    def connectionLost(self, reason: Any = None) -> None:
        error = getattr(reason, "value", None)
        # A given-up Dilation connection is an error, not the peer's EOF.
        self.channel._lost(error if isinstance(error, DilationError) else None)

    # IPushProducer: Dilation's write back-pressure.
    def pauseProducing(self) -> None:
        self.channel._set_writable(False)

    def resumeProducing(self) -> None:
        self.channel._set_writable(True)

    def stopProducing(self) -> None:
        pass


class _Factory(protocol.Factory):
    def __init__(self, make: Callable[[], _Protocol]) -> None:
        self._make = make

    def buildProtocol(self, addr: Any) -> _Protocol:
        return self._make()


# --- the connection -------------------------------------------------------------------


class BlockingDilation:
    """Blocking access to one dilated wormhole (see the module docstring).

    ``dilated``: a :class:`DilatedWormhole` (use :meth:`create` to make the
    wormhole as well). ``listen``: subprotocols to accept from the start
    (subchannels the peer opens for other names are refused unless
    :meth:`accept` registered them first). ``timeout``: the default wait of
    every blocking call. ``peer_timeout``: how long the Dilation connection
    may stay down (it reconnects and retries by itself) before waits fail:
    :meth:`create` makes it the Dilation ``reconnect_timeout`` (the error is
    then ``DilationReconnectFailed``); a wrapped connection with a longer one
    fails with :class:`PeerGone` instead. ``send_buffer``/``receive_buffer``: the per-subchannel
    bounds described in the module docstring.
    """

    def __init__(
        self,
        dilated: DilatedWormhole,
        *,
        listen: Iterable[str] = (),
        timeout: float = DEFAULT_TIMEOUT,
        peer_timeout: float = DEFAULT_PEER_TIMEOUT,
        send_buffer: int = DEFAULT_SEND_BUFFER,
        receive_buffer: int = DEFAULT_RECEIVE_BUFFER,
        wormhole: Any = None,
        code: str | None = None,
    ) -> None:
        ensure_reactor()
        self.timeout = timeout
        self.peer_timeout = peer_timeout
        self.send_buffer = send_buffer
        self.receive_buffer = receive_buffer
        self.code = code
        self._dw = dilated
        self._wormhole = wormhole  # closed by close() if we made it
        self._cond = threading.Condition()
        self._accepted: dict[str, deque[BlockingSubchannel]] = {}
        self._channels: set[BlockingSubchannel] = set()
        self._error: BaseException | None = None
        self._closed = False
        # Reactor-side state.
        self._holding_reading: set[BlockingSubchannel] = set()
        self._down_since: float | None = None
        self._ever_up = False
        self._watch: task.LoopingCall | None = None
        self._in_reactor(self._start)
        for name in listen:
            self.listen(name)

    @classmethod
    def create(
        cls,
        appid: str,
        mailbox_url: str,
        *,
        code: str | None = None,
        code_length: int = 2,
        relay_url: str | None = None,
        no_listen: bool = False,
        listen_addresses: list[str] | None = None,
        listen: Iterable[str] = (),
        app_versions: dict[str, Any] | None = None,
        **options: Any,
    ) -> BlockingDilation:
        """Make a wormhole (allocating a code unless ``code`` is given) and dilate it.

        Returns at once with :attr:`code` set; the other side may join later
        (``open``/``accept``/``wait_dilated`` wait for it). ``options`` go to
        the constructor (``timeout``, ``peer_timeout``, buffers).
        """
        from ..wormhole.client import Wormhole

        ensure_reactor()
        names = tuple(listen)
        timeout = options.get("timeout", DEFAULT_TIMEOUT)

        def make() -> Any:
            w = Wormhole(appid, mailbox_url, _reactor(), dilation=True, app_versions=app_versions)
            if code is None:
                w.allocate_code(code_length)
            else:
                w.set_code(code)
            dw = dilate(
                w,
                relay_url=relay_url,
                no_listen=no_listen,
                listen_addresses=listen_addresses,
                expected_subprotocols=names,  # OPENs that race our listen() are held
                # One deadline for "down too long": the manager's error says what it tried.
                reconnect_timeout=options.get("peer_timeout", DEFAULT_PEER_TIMEOUT),
            )
            return w, dw

        w, dw = _run(make, timeout, "creating the wormhole")
        try:
            got = _run(w.get_code, timeout, "getting a wormhole code")
            return cls(dw, listen=names, wormhole=w, code=got, **options)
        except BaseException:
            call_soon(w.close)  # do not leave it running; its error is ours
            raise

    # --- API --------------------------------------------------------------------

    def wait_dilated(self, timeout: float | None = None) -> None:
        """Block until the first Dilation connection is up."""
        self._check()
        _run(self._dw.when_dilated, self._timeout(timeout), "the Dilation connection")

    def open(self, subprotocol: str, timeout: float | None = None) -> BlockingSubchannel:
        """Open a subchannel to the peer's listener for ``subprotocol`` (waits for dilation)."""
        self._check()
        channel = BlockingSubchannel(self, subprotocol)
        factory = _Factory(lambda: _Protocol(channel, self._adopt))
        _run(
            lambda: self._dw.connector_for(subprotocol).connect(factory),
            self._timeout(timeout),
            f"opening subchannel {subprotocol!r}",
        )
        return channel

    def listen(self, subprotocol: str) -> None:
        """Accept subchannels the peer opens for ``subprotocol`` (idempotent)."""
        self._check()
        with self._cond:
            if subprotocol in self._accepted:
                return
            self._accepted[subprotocol] = deque()

        def build() -> _Protocol:
            return _Protocol(BlockingSubchannel(self, subprotocol), self._incoming)

        def register() -> None:
            d = self._dw.listener_for(subprotocol).listen(_Factory(build))
            d.addErrback(self._dilation_failed)

        self._in_reactor(register)

    def accept(self, subprotocol: str, timeout: float | None = None) -> BlockingSubchannel:
        """The next subchannel the peer opened for ``subprotocol`` (listening if need be)."""
        _not_in_reactor("accept()")
        self._check()
        self.listen(subprotocol)
        wait = self._timeout(timeout)
        deadline = _Deadline(wait)
        with self._cond:
            queue = self._accepted[subprotocol]
            while not queue:
                self._check()
                if deadline.expired() or not self._cond.wait(deadline.left()):
                    if deadline.expired() and not queue:
                        raise DilationTimeout(f"the peer opening subchannel {subprotocol!r}", wait)
            return queue.popleft()

    def status(self) -> Any:
        """The :class:`~spark_dilation.dilation.manager.DilationStatus` snapshot."""
        return self._in_reactor(self._dw.status)

    def close(self, timeout: float | None = None, linger: float = 5.0) -> None:
        """Close every subchannel, stop Dilation and (if :meth:`create` made it) the wormhole.

        Waits up to ``linger`` seconds for the peer to answer the subchannels'
        CLOSEs (which proves it received everything sent before them), then
        stops. Blocked calls on this connection fail with :class:`DilationClosed`.
        Never raises for problems of the teardown itself (they are logged).
        """
        _not_in_reactor("BlockingDilation.close()")
        with self._cond:
            if self._closed:
                return
            self._closed = True
            channels = list(self._channels)
        for channel in channels:
            channel.close(timeout)
        deadline = _Deadline(linger)
        for channel in channels:
            with channel._cond:
                while not channel._eof and channel._error is None and not deadline.expired():
                    channel._cond.wait(deadline.left())
        self._fail_all(DilationClosed())

        def stop() -> Any:
            if self._watch is not None and self._watch.running:
                self._watch.stop()
            if self._wormhole is not None:
                return self._wormhole.close()  # stops Dilation too
            return self._dw.stop()

        try:
            _run(stop, self._timeout(timeout), "closing the wormhole")
        except Exception as e:  # teardown: report, do not raise
            log.info("closing the dilated wormhole: %s", e)

    def __enter__(self) -> BlockingDilation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- internals ----------------------------------------------------------------

    def _timeout(self, timeout: float | None) -> float:
        return self.timeout if timeout is None else timeout

    def _check(self) -> None:
        if self._closed:
            raise DilationClosed()
        if self._error is not None:
            raise self._error

    def _in_reactor(self, fn: Callable[[], Any]) -> Any:
        if threadable.isInIOThread():
            return fn()
        return _run(fn, self.timeout, "a reactor call")

    def _adopt(self, channel: BlockingSubchannel) -> None:
        with self._cond:
            self._channels.add(channel)

    def _incoming(self, channel: BlockingSubchannel) -> None:
        with self._cond:
            self._channels.add(channel)
            self._accepted.setdefault(channel.subprotocol, deque()).append(channel)
            self._cond.notify_all()

    def _forget(self, channel: BlockingSubchannel) -> None:
        with self._cond:
            self._channels.discard(channel)

    def _fail_all(self, error: BaseException) -> None:
        with self._cond:
            if self._error is None:
                self._error = error
            channels = list(self._channels)
            self._cond.notify_all()
        for channel in channels:
            channel._fail(error)

    # reactor side

    def _start(self) -> None:
        self._watch = task.LoopingCall(self._check_connection)
        self._watch.clock = _reactor()
        self._watch.start(_WATCH_INTERVAL, now=False)
        self._dw.when_dilated().addCallbacks(self._dilated, self._dilation_failed)

    def _dilated(self, _: Any) -> None:
        self._ever_up = True

    def _dilation_failed(self, failure: Any) -> None:
        if not failure.check(defer.CancelledError):
            self._fail_all(failure.value)

    def _check_connection(self) -> None:
        """Fail everything if the Dilation connection stays down past ``peer_timeout``."""
        failure = self._dw.failure()
        if failure is not None:
            if self._error is None:
                self._fail_all(failure)
            return
        status = self._dw.status()
        if status.state == "STOPPED":
            if not self._closed:
                self._fail_all(
                    DilationClosed("the wormhole under this Dilation connection was closed")
                )
            return
        if status.connection is not None or not self._ever_up:
            # Up, or never up yet (then open/accept/wait_dilated time out instead).
            self._ever_up = self._ever_up or status.connection is not None
            self._down_since = None
            return
        now = time.monotonic()
        if self._down_since is None:
            self._down_since = now
        elif (
            now - self._down_since > self.peer_timeout
            and self._error is None
            # A manager with the same or a shorter deadline gives the better error.
            and self.peer_timeout < self._dw.reconnect_timeout
        ):
            self._fail_all(
                PeerGone(
                    f"the other side has been unreachable for {self.peer_timeout:g} seconds "
                    "(its process may have ended); the Dilation connection is given up"
                )
            )

    def _sync_reading(self, channel: BlockingSubchannel) -> None:
        """Pause or resume reading of the whole connection for ``channel``'s buffer."""
        with channel._cond:
            channel._resume_scheduled = False
            gone = channel._closed or channel._eof
            if channel._reading_paused:
                hold = not gone and channel._inbox_bytes > self.receive_buffer // 2
            else:
                hold = not gone and channel._inbox_bytes > self.receive_buffer
            channel._reading_paused = hold
        was_paused = bool(self._holding_reading)
        if hold:
            self._holding_reading.add(channel)
        else:
            self._holding_reading.discard(channel)
        proto = channel._proto
        if proto is None or proto.transport is None:
            return
        # SubChannel.pause/resumeProducing act on the whole L2 connection.
        if self._holding_reading and not was_paused:
            proto.transport.pauseProducing()
        elif was_paused and not self._holding_reading:
            proto.transport.resumeProducing()


__all__ = [
    "BlockingDilation",
    "BlockingDilationError",
    "BlockingSubchannel",
    "DilationClosed",
    "DilationTimeout",
    "MessageTooLarge",
    "PeerGone",
    "SubchannelClosed",
    "SubchannelStats",
]
