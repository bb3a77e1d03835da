"""Encrypted, authenticated TCP frames between the reading cluster's own processes.

The lane registry (driver machine) and the lane hosts (executor machines)
talk over plain TCP inside the receiving cluster, as Spark's executors do.
Every frame is a NaCl ``SecretBox`` under a key derived from the transfer
secret, so only processes that hold the transfer's spec can talk or read
the staged rows they copy: a frame that does not open closes the link.

    frame: len(4, big-endian) nonce(24) ciphertext    (at most MAX_FRAME)
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

from nacl.exceptions import CryptoError
from nacl.secret import SecretBox

from .rules.errors import LinkError

_LEN = struct.Struct(">I")
MAX_FRAME = 8 * 1024 * 1024
CHUNK = 1024 * 1024  # staged files travel in chunks of this size
_NOSIGNAL = getattr(socket, "MSG_NOSIGNAL", 0)


def link_key(secret: bytes, purpose: str) -> bytes:
    return hmac.new(secret, f"spark-dilation {purpose} v1".encode(), hashlib.sha256).digest()


class BoxLink:
    """One TCP connection carrying boxed frames; ``send`` is safe from several threads."""

    def __init__(self, sock: socket.socket, key: bytes) -> None:
        self.sock = sock
        self._box = SecretBox(key)
        self._send_lock = threading.Lock()
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def send(self, data: bytes) -> None:
        frame = self._box.encrypt(bytes(data))
        try:
            with self._send_lock:
                self.sock.sendall(_LEN.pack(len(frame)) + frame, _NOSIGNAL)
        except OSError as e:
            raise LinkError(f"the connection closed while sending: {e}") from e

    def send_json(self, obj: dict[str, Any]) -> None:
        self.send(json.dumps(obj).encode())

    def recv(self, timeout: float | None) -> bytes:
        """The next frame's plaintext; LinkError on close, silence past ``timeout`` or tampering."""
        self.sock.settimeout(timeout)
        try:
            (n,) = _LEN.unpack(self._exactly(_LEN.size))
            if n > MAX_FRAME + SecretBox.NONCE_SIZE + SecretBox.MACBYTES:
                raise LinkError(f"a frame of {n} bytes")
            return self._box.decrypt(bytes(self._exactly(n)))
        except TimeoutError as e:
            raise LinkError(f"nothing heard for {timeout:g} s") from e
        except CryptoError as e:
            raise LinkError("a frame that does not open (not this transfer's key)") from e
        except OSError as e:
            raise LinkError(f"the connection failed: {e}") from e

    def recv_json(self, timeout: float | None) -> dict[str, Any]:
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


def keep_alive(link: BoxLink, every: float, stop: threading.Event) -> None:
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
