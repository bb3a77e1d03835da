"""Length-prefixed frames between this package's own processes, over two transports.

Every frame on either transport is ``len(4, big-endian) body``; :class:`FrameLink`
holds that framing (exact reads, a size limit, one sender at a time, JSON
helpers; every failure is a :class:`LinkError`). The transports differ in
what guards a frame's body:

- **TCP between machines** (:class:`BoxLink`). The lane registry (driver
  machine), the lane hosts (executor machines) and the copies between them,
  and the writing end's hub, talk over plain TCP inside a cluster, as Spark's
  executors do. Every body is a NaCl ``SecretBox`` under a key derived from the
  transfer secret (:func:`link_key`), so only processes that hold the
  transfer's spec can talk or read the staged rows they copy: a frame that
  does not open closes the link::

      frame: len(4) nonce(24) ciphertext       (plaintext at most MAX_FRAME)

- **A Unix socket on one machine** (:class:`LocalLink`): Spark tasks and their
  machine's sender host (:mod:`.send.hostlink`). Partition data flows through
  it as fast as the tasks encode it, so bodies go in the clear: the socket
  lies in a 0700 folder, and the client proves once, as it connects, that it
  holds the transfer's token (an HMAC of the transfer secret)::

      client hello: "SDH1" token(32) tag(1)    then frames both ways
      frame: len(4) body                       (at most MAX_LOCAL_FRAME)
"""

from __future__ import annotations

import hashlib
import hmac
import json
import socket
import struct
import threading
import time
from typing import Any

from .rules.errors import LinkError

_LEN = struct.Struct(">I")
MAX_FRAME = 8 * 1024 * 1024
MAX_LOCAL_FRAME = 64 * 1024 * 1024  # a manifest of many partitions is still far below
CHUNK = 1024 * 1024  # staged files travel in chunks of this size
_NOSIGNAL = getattr(socket, "MSG_NOSIGNAL", 0)  # EPIPE, not SIGPIPE, if the other end is gone
_JOIN = 64 * 1024  # a body up to this size goes out joined to its length, in one write
_HELLO = b"SDH1"  # a local link's first bytes, before the token
KEEP: Any = object()
"""``recv``'s default timeout: the socket's as it is (:meth:`FrameLink.settimeout`)."""


def link_key(secret: bytes, purpose: str) -> bytes:
    return hmac.new(secret, f"spark-dilation {purpose} v1".encode(), hashlib.sha256).digest()


class FrameTooLarge(LinkError):
    """A frame's length is over the link's limit (the stream is not this protocol's)."""

    def __init__(self, size: int) -> None:
        super().__init__(f"a frame of {size} bytes")
        self.size = size


class FrameLink:
    """One stream socket carrying length-prefixed frames; ``send`` is safe from several threads.

    A transport says what a frame's body is: :meth:`_seal` makes it of the
    data sent, :meth:`_open` gives back the data (here: the body itself).
    """

    def __init__(self, sock: socket.socket, max_body: int) -> None:
        self.sock = sock
        self.max_body = max_body
        self._send_lock = threading.Lock()

    def _seal(self, data: bytes | bytearray | memoryview) -> bytes | bytearray | memoryview:
        return data

    def _open(self, body: bytearray) -> bytes | bytearray:
        return body

    def settimeout(self, timeout: float | None) -> None:
        """How long a send or a ``recv`` (with no timeout of its own) may block."""
        self.sock.settimeout(timeout)

    def send(self, data: bytes | bytearray | memoryview) -> None:
        body = self._seal(data)
        head = _LEN.pack(len(body))
        try:
            with self._send_lock:
                if len(body) <= _JOIN:
                    self.sock.sendall(head + body, _NOSIGNAL)
                else:  # not copied to join it to its length
                    self.sock.sendall(head, _NOSIGNAL)
                    self.sock.sendall(body, _NOSIGNAL)
        except OSError as e:
            raise LinkError(f"the connection closed while sending: {e}") from e

    def send_json(self, obj: dict[str, Any]) -> None:
        self.send(json.dumps(obj).encode())

    def recv(self, timeout: float | None = KEEP) -> bytes | bytearray:
        """The next frame's data, in a buffer of its own; LinkError on close, silence
        past ``timeout`` (else the socket's), a frame over the limit or tampering."""
        if timeout is not KEEP:
            self.sock.settimeout(timeout)
        try:
            (n,) = _LEN.unpack(self._exactly(_LEN.size))
            if n > self.max_body:
                raise FrameTooLarge(n)
            return self._open(self._exactly(n))
        except TimeoutError as e:
            waited = self.sock.gettimeout()
            raise LinkError(f"nothing heard for {waited or 0:g} s") from e
        except OSError as e:
            raise LinkError(f"the connection failed: {e}") from e

    def recv_json(self, timeout: float | None = KEEP) -> dict[str, Any]:
        return json.loads(self.recv(timeout))

    def _exactly(self, n: int) -> bytearray:
        buf = bytearray(n)
        view = memoryview(buf)
        got = 0
        while got < n:
            k = self.sock.recv_into(view[got:])
            if k == 0:
                raise LinkError("the other side closed the connection")
            got += k
        return buf

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()

    def __enter__(self) -> FrameLink:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


class BoxLink(FrameLink):
    """A TCP connection whose frames are boxed under ``key`` (:func:`link_key`)."""

    def __init__(self, sock: socket.socket, key: bytes) -> None:
        # Imported here: a task's local link has no use for the crypto library.
        from nacl.exceptions import CryptoError
        from nacl.secret import SecretBox

        super().__init__(sock, MAX_FRAME + SecretBox.NONCE_SIZE + SecretBox.MACBYTES)
        self._box = SecretBox(key)
        self._tampered = CryptoError
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def _seal(self, data: bytes | bytearray | memoryview) -> bytes:
        return self._box.encrypt(bytes(data))

    def _open(self, body: bytearray) -> bytes:
        try:
            return self._box.decrypt(bytes(body))
        except self._tampered as e:
            raise LinkError("a frame that does not open (not this transfer's key)") from e


class LocalLink(FrameLink):
    """A Unix socket on this machine, frames in the clear; its client proved, once,
    that it holds the token (:meth:`open`, :meth:`accept`)."""

    def __init__(self, sock: socket.socket) -> None:
        super().__init__(sock, MAX_LOCAL_FRAME)

    @classmethod
    def open(cls, address: str, token: bytes, tag: bytes) -> LocalLink:
        """A link to the Unix socket ``address`` (the name to ``connect`` it by), its
        hello sent: ``token`` and the one-byte ``tag`` (what the client wants)."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(address)
            sock.sendall(_HELLO + token + tag, _NOSIGNAL)
        except OSError as e:  # nobody listens (refused, no such file), or gone meanwhile
            sock.close()
            raise LinkError(f"the local socket did not take a connection: {e}") from e
        return cls(sock)

    @classmethod
    def accept(cls, sock: socket.socket, token: bytes) -> tuple[LocalLink, bytes]:
        """Server side: the link of an accepted connection and its hello's tag;
        LinkError if the client does not hold ``token`` (the caller closes ``sock``)."""
        link = cls(sock)
        try:
            head = link._exactly(len(_HELLO) + len(token) + 1)
        except OSError as e:
            raise LinkError(f"the connection failed: {e}") from e
        if head[: len(_HELLO)] != _HELLO or not hmac.compare_digest(
            bytes(head[len(_HELLO) : -1]), token
        ):
            raise LinkError("not a connection of this transfer (no valid token)")
        return link, bytes(head[-1:])


def keep_alive(link: FrameLink, every: float, stop: threading.Event) -> None:
    """Send ``{"ping": 1}`` on ``link`` every ``every`` seconds (a daemon thread) until
    ``stop`` is set or the link fails: the other end's silence deadline sees it live."""

    def run() -> None:
        while not stop.wait(every):
            try:
                link.send_json({"ping": 1})
            except LinkError:
                return

    threading.Thread(target=run, daemon=True).start()


def serve_connections(server: socket.socket, handle: Any) -> None:
    """Accept on ``server`` (a daemon thread) until it is closed; each connection
    is handled by ``handle(sock)`` in a thread of its own."""

    def run() -> None:
        while True:
            try:
                sock, _ = server.accept()
            except OSError:
                return
            threading.Thread(target=handle, args=(sock,), daemon=True).start()

    threading.Thread(target=run, daemon=True).start()


def connect(
    addresses: list[str] | tuple[str, ...], port: int, key: bytes, timeout: float
) -> BoxLink:
    """A link to the first of ``addresses`` that answers on ``port`` within ``timeout`` in all."""
    deadline = time.monotonic() + timeout
    errors = []
    for address in addresses:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        try:
            sock = socket.create_connection((address, port), timeout=min(left, 3.0))
        except OSError as e:
            errors.append(f"{address}: {e}")
            continue
        return BoxLink(sock, key)
    raise LinkError(
        f"none of {', '.join(f'{a}:{port}' for a in addresses)} answered within "
        f"{timeout:g} s ({'; '.join(errors) or 'timed out'})"
    )


def listen() -> socket.socket:
    """A listening socket on every interface, on a port the system picks."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("0.0.0.0", 0))
    sock.listen(64)
    return sock


def advertised_addresses() -> list[str]:
    """Where other machines of this cluster (and this one) can reach a listener here."""
    from ..transit.addresses import family_of, local_addresses

    # The listener is IPv4.
    addresses = [a for a in local_addresses() if family_of(a) == socket.AF_INET]
    return [*addresses, "127.0.0.1"] if "127.0.0.1" not in addresses else addresses


PING = 2.0  # both ends of a registry link send a ping this often


SILENCE = 10.0  # a link silent this long is dead (its machine is lost)
