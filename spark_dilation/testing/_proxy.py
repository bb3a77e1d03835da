"""A loopback TCP forwarder that tests can stall, break and refuse."""

from __future__ import annotations

import contextlib
import errno
import logging
import queue
import random
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from types import TracebackType
from typing import Any, TypeVar

log = logging.getLogger(__name__)

RECV_SIZE = 256 * 1024
# Stop reading from one side once this much is waiting for the other side, so
# a slow reader pushes back on the writer instead of growing our memory.
MAX_PENDING = 4 * RECV_SIZE
COMMAND_TIMEOUT = 30.0
# limit_rate(): the least a read waits for (smaller reads would spin), and the
# most one read takes, so ready connections share the tokens: 10 ms of the rate
# within these bounds. A slow link so serves a new connection's handshake
# between a busy one's reads, as a real link interleaves packets.
RATE_CHUNK = 64 * 1024
MIN_RATE_CHUNK = 2 * 1024

_READ = selectors.EVENT_READ
_WRITE = selectors.EVENT_WRITE
_LISTENER = object()
_WAKEUP = object()

T = TypeVar("T")


def _abort_socket(sock: socket.socket) -> None:
    """Close with an RST rather than a FIN."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def _no_delay(sock: socket.socket) -> None:
    # Small WebSocket frames must not sit in Nagle's buffer waiting for an ACK.
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class _Direction:
    """Bytes flowing from ``src`` to ``dst``."""

    __slots__ = ("buf", "dst", "eof", "shut", "src")

    def __init__(self, src: socket.socket, dst: socket.socket) -> None:
        self.src = src
        self.dst = dst
        self.buf = bytearray()
        self.eof = False  # src has sent FIN
        self.shut = False  # we have passed that FIN on to dst


class _Link:
    """One proxied connection: the accepted client socket and our upstream socket."""

    __slots__ = ("client", "closed", "connecting", "down", "masks", "stalled", "up", "upstream")

    def __init__(self, client: socket.socket, upstream: socket.socket, connecting: bool) -> None:
        self.client = client
        self.upstream = upstream
        self.connecting = connecting
        self.up = _Direction(client, upstream)
        self.down = _Direction(upstream, client)
        self.masks: dict[socket.socket, int] = {client: 0, upstream: 0}
        self.closed = False
        self.stalled = False  # held by stall_existing() until release()


class TcpProxy:
    """Forward connections from ``127.0.0.1:<port>`` to ``target_host:target_port``.

    Runs on its own thread with plain sockets, so it works for clients on any
    event loop and in other processes. Each accepted connection gets its own
    upstream connection; if the target refuses, the client gets a reset.
    Control methods take effect before they return.

    Two ways to stall silently (no FIN, no RST, no bytes): :meth:`freeze`
    stalls every connection, including ones accepted while frozen, until
    :meth:`thaw`; :meth:`stall_existing` stalls only the connections open now,
    like a path whose NAT entry or middlebox silently died, while new
    connections flow normally, until :meth:`release`.
    """

    host = "127.0.0.1"

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target_host = target_host
        self.target_port = target_port
        family, _, _, _, sockaddr = socket.getaddrinfo(
            target_host, target_port, type=socket.SOCK_STREAM
        )[0]
        self._target_family = family
        self._target_addr = sockaddr

        self._links: set[_Link] = set()
        self._total = 0
        self._refused = 0
        self._frozen = False
        self._refusing = False
        self._refuse_next = 0
        self._refuse_rng: random.Random | None = None
        self._refuse_probability = 0.0
        self._closing = False
        # Token bucket of limit_rate(): bytes we may still read, refilled at _rate.
        self._rate: float | None = None
        self._chunk = RATE_CHUNK
        self._tokens = 0.0
        self._refilled_at = 0.0
        self._commands: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]]] = (
            queue.SimpleQueue()
        )

        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._listener.bind((self.host, 0))
            self._listener.listen(128)
            self._listener.setblocking(False)
            self.port: int = self._listener.getsockname()[1]
            self._wake_r, self._wake_w = socket.socketpair()
            self._wake_r.setblocking(False)
            self._wake_w.setblocking(False)
            self._selector = selectors.DefaultSelector()
            self._selector.register(self._listener, _READ, _LISTENER)
            self._selector.register(self._wake_r, _READ, _WAKEUP)
        except BaseException:
            self._listener.close()
            raise
        self._thread = threading.Thread(
            target=self._run, name=f"TcpProxy-{self.port}->{target_port}", daemon=True
        )
        self._thread.start()

    def __repr__(self) -> str:
        return f"<TcpProxy {self.host}:{self.port} -> {self.target_host}:{self.target_port}>"

    # --- public API ---------------------------------------------------------

    def url(self, path: str = "/v1") -> str:
        """A WebSocket URL through the proxy, e.g. for a mailbox server."""
        return f"ws://{self.host}:{self.port}{path}"

    def hint(self) -> str:
        """A ``tcp:HOST:PORT`` hint through the proxy, e.g. for a transit relay."""
        return f"tcp:{self.host}:{self.port}"

    @property
    def connection_count(self) -> int:
        """Connections being forwarded right now."""
        return len(self._links)

    @property
    def total_connections(self) -> int:
        """Connections ever accepted, including the ones refused by :meth:`refuse_new`."""
        return self._total

    @property
    def refused_connections(self) -> int:
        """Connections closed on arrival (:meth:`refuse_new`, :meth:`refuse_next`,
        :meth:`refuse_randomly`)."""
        return self._refused

    @property
    def frozen(self) -> bool:
        return self._frozen

    def drop_connections(self) -> int:
        """Reset (RST) both sides of every live connection; returns how many.

        The proxy keeps accepting new connections.
        """
        return self._call(self._drop_all)

    def freeze(self) -> None:
        """Stop moving bytes on every connection without closing any: a silent stall.

        Connections accepted while frozen are stalled too, until :meth:`thaw`.
        """
        self._call(lambda: self._set_frozen(True))

    def thaw(self) -> None:
        """Resume forwarding, delivering whatever piled up while frozen."""
        self._call(lambda: self._set_frozen(False))

    def stall_existing(self) -> int:
        """Stall only the connections open now, silently; returns how many.

        Like :meth:`freeze` for those connections (no FIN, no RST, no bytes),
        but connections accepted afterwards are forwarded normally. They stay
        stalled until :meth:`release`; :meth:`thaw` does not release them.
        """
        return self._call(self._stall_existing)

    def release(self) -> None:
        """Let the connections stalled by :meth:`stall_existing` move again.

        Whatever piled up is delivered (unless the proxy is frozen, in which
        case it is delivered on :meth:`thaw`).
        """
        self._call(self._release)

    def limit_rate(self, bytes_per_second: float | None) -> None:
        """Forward at most ``bytes_per_second`` in all (every connection, both
        directions), or without a limit for ``None``.

        A transfer through a limited proxy lasts at least its size over the rate
        however fast the machine is, so a test can act on it while it runs.
        """
        if bytes_per_second is not None and bytes_per_second <= 0:
            raise ValueError("bytes_per_second must be positive (or None for no limit)")
        self._call(lambda: self._set_rate(bytes_per_second))

    def refuse_new(self, flag: bool = True) -> None:
        """While ``flag`` is true, close new connections as soon as they arrive."""
        self._call(lambda: setattr(self, "_refusing", bool(flag)))

    def refuse_next(self, count: int) -> None:
        """Close the next ``count`` new connections as soon as they arrive."""
        self._call(lambda: setattr(self, "_refuse_next", int(count)))

    def refuse_randomly(self, probability: float, seed: int) -> None:
        """Close each new connection on arrival with ``probability`` (a flaky network),
        drawn from a ``random.Random(seed)``; 0 stops it."""

        def set_it() -> None:
            self._refuse_probability = float(probability)
            self._refuse_rng = random.Random(seed) if probability > 0 else None

        self._call(set_it)

    def close(self) -> None:
        """Reset every connection, stop listening and stop the thread. Idempotent."""
        if self._thread.is_alive():
            with contextlib.suppress(RuntimeError):
                self._call(lambda: setattr(self, "_closing", True))
            self._thread.join(COMMAND_TIMEOUT)

    def __enter__(self) -> TcpProxy:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # --- plumbing -----------------------------------------------------------

    def _call(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the proxy thread and wait for its result."""
        if threading.current_thread() is self._thread:
            return fn()
        if self._closing or not self._thread.is_alive():
            raise RuntimeError(f"{self!r} is closed")
        fut: Future[T] = Future()
        self._commands.put((fn, fut))
        self._wake()
        return fut.result(COMMAND_TIMEOUT)

    def _wake(self) -> None:
        # A full socketpair buffer means a wake-up is already pending.
        with contextlib.suppress(BlockingIOError, OSError):
            self._wake_w.send(b"\0")

    def _run(self) -> None:
        try:
            while not self._closing:
                starved = self._starved()
                events = self._selector.select(self._until_tokens() if starved else None)
                self._refill()
                if starved and not self._starved():
                    for link in list(self._links):
                        self._update(link)
                if self._rate is not None:
                    # Every ready connection gets its turn at the tokens, in a new order
                    # each time: a busy one must not starve a new one's handshake.
                    random.shuffle(events)
                for key, mask in events:
                    if key.data is _LISTENER:
                        self._accept()
                    elif key.data is _WAKEUP:
                        self._run_commands()
                    else:
                        link, sock = key.data
                        if link.closed:
                            continue  # aborted earlier in this same batch
                        try:
                            self._service(link, sock, mask)
                        except Exception:
                            log.exception("%r: error forwarding; resetting the connection", self)
                            self._abort(link)
        except Exception:
            log.exception("%r: proxy thread crashed", self)
        finally:
            self._shutdown()

    def _run_commands(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while self._wake_r.recv(4096):
                pass
        while True:
            try:
                fn, fut = self._commands.get_nowait()
            except queue.Empty:
                return
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn())
            except BaseException as e:
                fut.set_exception(e)

    def _shutdown(self) -> None:
        self._closing = True
        for link in list(self._links):
            self._abort(link)
        self._selector.close()
        self._listener.close()
        self._wake_r.close()
        self._wake_w.close()
        # Anything queued after the loop ended must not wait forever.
        while True:
            try:
                _, fut = self._commands.get_nowait()
            except queue.Empty:
                break
            if fut.set_running_or_notify_cancel():
                fut.set_exception(RuntimeError(f"{self!r} is closed"))

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                # e.g. EMFILE: leave the connection in the backlog for later.
                log.warning("%r: accept failed: %s", self, e)
                return
            self._total += 1
            if self._refusing or self._refuse_next > 0 or self._unlucky():
                self._refuse_next = max(0, self._refuse_next - 1)
                self._refused += 1
                client.close()
                continue
            client.setblocking(False)
            _no_delay(client)
            upstream = socket.socket(self._target_family, socket.SOCK_STREAM)
            upstream.setblocking(False)
            err = upstream.connect_ex(self._target_addr)
            if err not in (0, errno.EINPROGRESS, errno.EWOULDBLOCK):
                _abort_socket(client)
                upstream.close()
                continue
            if err == 0:
                _no_delay(upstream)
            link = _Link(client, upstream, connecting=err != 0)
            self._links.add(link)
            self._update(link)

    def _unlucky(self) -> bool:
        rng = self._refuse_rng
        return rng is not None and rng.random() < self._refuse_probability

    def _service(self, link: _Link, sock: socket.socket, mask: int) -> None:
        if link.connecting:
            err = link.upstream.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if err:
                self._abort(link)  # target refused or unreachable: reset the client
                return
            link.connecting = False
            _no_delay(link.upstream)
        elif self._moving(link):
            outgoing, incoming = (
                (link.up, link.down) if sock is link.client else (link.down, link.up)
            )
            if mask & _READ:
                self._read(link, outgoing)
            if mask & _WRITE and not link.closed:
                self._flush(link, incoming)
        if link.closed:
            return
        if link.up.shut and link.down.shut:
            self._finish(link)
        else:
            self._update(link)

    def _read(self, link: _Link, d: _Direction) -> None:
        if self._starved():
            return
        size = RECV_SIZE if self._rate is None else min(self._chunk, int(self._tokens))
        try:
            data = d.src.recv(size)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._abort(link)  # a reset on one side becomes a reset on the other
            return
        if data:
            d.buf += data
            if self._rate is not None:
                self._tokens -= len(data)
        else:
            d.eof = True
        self._flush(link, d)

    def _flush(self, link: _Link, d: _Direction) -> None:
        while d.buf:
            try:
                sent = d.dst.send(d.buf)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                self._abort(link)
                return
            del d.buf[:sent]
        if d.eof and not d.shut:
            d.shut = True
            with contextlib.suppress(OSError):
                d.dst.shutdown(socket.SHUT_WR)

    def _update(self, link: _Link) -> None:
        """Register interest in exactly the events that can make progress."""
        for sock, outgoing, incoming in (
            (link.client, link.up, link.down),
            (link.upstream, link.down, link.up),
        ):
            mask = 0
            if link.connecting:
                mask = _WRITE if sock is link.upstream else 0
            elif self._moving(link):
                if not outgoing.eof and len(outgoing.buf) < MAX_PENDING and not self._starved():
                    mask |= _READ
                if incoming.buf:
                    mask |= _WRITE
            current = link.masks[sock]
            if mask == current:
                continue
            if current == 0:
                self._selector.register(sock, mask, (link, sock))
            elif mask == 0:
                self._selector.unregister(sock)
            else:
                self._selector.modify(sock, mask, (link, sock))
            link.masks[sock] = mask

    def _forget(self, link: _Link) -> None:
        link.closed = True
        self._links.discard(link)
        for sock, mask in link.masks.items():
            if mask:
                self._selector.unregister(sock)
            link.masks[sock] = 0

    def _finish(self, link: _Link) -> None:
        """Both sides have said FIN and everything was delivered."""
        self._forget(link)
        link.client.close()
        link.upstream.close()

    def _abort(self, link: _Link) -> None:
        if link.closed:
            return
        self._forget(link)
        _abort_socket(link.client)
        _abort_socket(link.upstream)

    def _drop_all(self) -> int:
        links = list(self._links)
        for link in links:
            self._abort(link)
        return len(links)

    def _moving(self, link: _Link) -> bool:
        """Whether bytes may flow on ``link`` (neither frozen nor stalled)."""
        return not self._frozen and not link.stalled

    def _set_frozen(self, frozen: bool) -> None:
        self._frozen = frozen
        self._resume(list(self._links))

    def _set_rate(self, rate: float | None) -> None:
        self._rate = rate
        self._chunk = (
            RATE_CHUNK if rate is None else int(min(RATE_CHUNK, max(MIN_RATE_CHUNK, rate * 0.01)))
        )
        self._tokens = 0.0
        self._refilled_at = time.monotonic()
        self._resume(list(self._links))

    def _refill(self) -> None:
        if self._rate is None:
            return
        now = time.monotonic()
        # A burst of at most 20 ms of the rate (or one read) keeps the pace smooth.
        burst = max(float(RECV_SIZE), self._rate * 0.02)
        self._tokens = min(burst, self._tokens + (now - self._refilled_at) * self._rate)
        self._refilled_at = now

    def _starved(self) -> bool:
        # Wait for a whole chunk, not one byte: reads of a few bytes each would spin.
        return self._rate is not None and self._tokens < self._chunk

    def _until_tokens(self) -> float:
        """Seconds until the bucket holds a chunk again."""
        assert self._rate is not None
        return max(0.001, (self._chunk - self._tokens) / self._rate)

    def _stall_existing(self) -> int:
        links = list(self._links)
        for link in links:
            link.stalled = True
            self._update(link)
        return len(links)

    def _release(self) -> None:
        links = [link for link in self._links if link.stalled]
        for link in links:
            link.stalled = False
        self._resume(links)

    def _resume(self, links: list[_Link]) -> None:
        """After freeze/thaw/release: deliver what piled up if ``links`` may move, re-register."""
        for link in links:
            if link.closed:
                continue
            if self._moving(link) and not link.connecting:
                self._flush(link, link.up)
                if not link.closed:
                    self._flush(link, link.down)
            if link.closed:
                continue
            if link.up.shut and link.down.shut:
                self._finish(link)
            else:
                self._update(link)


@contextlib.contextmanager
def throttled_relay(relay_port: int, rate: float) -> Iterator[str]:
    """A transit relay on loopback ``relay_port`` behind a proxy at ``rate`` bytes/s:
    the relay hint (``tcp:127.0.0.1:PORT``) to give both sides, while the block runs."""
    with TcpProxy("127.0.0.1", relay_port) as proxy:
        proxy.limit_rate(rate)
        yield f"tcp:127.0.0.1:{proxy.port}"
