"""Sans-IO classic Transit: handshakes, the go/nevermind decision, records.

One :class:`TransitConnectionCore` per TCP connection (direct or through the
relay). Feed it bytes with :meth:`data_received`; it returns events. It never
touches a socket.

Wire facts (magic-wormhole 0.24 ``wormhole/transit.py``, the tie-breaker
where the Transit seed differs):

* relay first (outbound to a relay only):
  ``please relay HEX(HKDF(key, "transit_relay_token")) for side SIDE\\n``,
  answered by ``ok\\n``;
* then both send ``transit sender|receiver HEX(HKDF(key, "transit_sender|
  receiver")) ready\\n\\n``; the sender answers the receiver's handshake with
  ``go\\n`` on the first connection to get there and ``nevermind\\n`` on the
  others;
* records: a 4-byte big-endian length, then SecretBox ciphertext with the
  24-byte nonce prepended. The nonce is a counter from 0 encoded
  **big-endian** (the seed says little-endian; the reference code, which real
  peers run, is big-endian). A record with any other nonce kills the
  connection.
"""

from __future__ import annotations

from dataclasses import dataclass

from nacl.exceptions import CryptoError
from nacl.secret import SecretBox

from ..errors import DilationError
from ..wormhole.keys import hkdf

TRANSIT_KEY_LENGTH = SecretBox.KEY_SIZE
NONCE_SIZE = SecretBox.NONCE_SIZE
# SecretBox adds 24 bytes of nonce and a 16-byte MAC to every record.
RECORD_OVERHEAD = NONCE_SIZE + SecretBox.MACBYTES
# The reference sends file data in small records; anything far bigger than
# this is an attack or a bug, and we refuse to buffer it.
DEFAULT_MAX_RECORD = 16 * 1024 * 1024

GO = b"go\n"
NEVERMIND = b"nevermind\n"
RELAY_OK = b"ok\n"


class TransitError(DilationError):
    """A Transit connection failed."""


class BadHandshake(TransitError):
    """The peer's handshake was not what the shared key predicts."""


class BadRecord(TransitError):
    """A record was corrupted, replayed, reordered or too large.

    ``records`` holds the good records decoded before the bad one, so they
    are still delivered (as the reference does) before the connection dies.
    """

    records: list[bytes] = []


def sender_handshake(key: bytes) -> bytes:
    return b"transit sender " + hkdf(key, 32, b"transit_sender").hex().encode() + b" ready\n\n"


def receiver_handshake(key: bytes) -> bytes:
    return b"transit receiver " + hkdf(key, 32, b"transit_receiver").hex().encode() + b" ready\n\n"


def relay_handshake(key: bytes, side: str) -> bytes:
    token = hkdf(key, 32, b"transit_relay_token").hex()
    return f"please relay {token} for side {side}\n".encode()


def record_keys(key: bytes, is_sender: bool) -> tuple[bytes, bytes]:
    """(key we encrypt with, key we decrypt with)."""
    sender_key = hkdf(key, SecretBox.KEY_SIZE, b"transit_record_sender_key")
    receiver_key = hkdf(key, SecretBox.KEY_SIZE, b"transit_record_receiver_key")
    return (sender_key, receiver_key) if is_sender else (receiver_key, sender_key)


# --- events -------------------------------------------------------------------


@dataclass(frozen=True)
class Send:
    data: bytes


@dataclass(frozen=True)
class ReadyForDecision:
    """(sender only) The receiver's handshake checked out: call decide()."""


@dataclass(frozen=True)
class Negotiated:
    """Records may flow now."""


@dataclass(frozen=True)
class RecordReceived:
    record: bytes


@dataclass(frozen=True)
class Failed:
    """Hang up: ``error`` says why. Nothing more will be emitted."""

    error: TransitError


Event = Send | ReadyForDecision | Negotiated | RecordReceived | Failed


class RecordEncoder:
    """SecretBox records with a big-endian counter nonce."""

    def __init__(self, key: bytes) -> None:
        self._box = SecretBox(key)
        self._nonce = 0

    def encode(self, record: bytes) -> bytes:
        nonce = self._nonce.to_bytes(NONCE_SIZE, "big")
        self._nonce += 1
        encrypted = self._box.encrypt(record, nonce)
        return len(encrypted).to_bytes(4, "big") + bytes(encrypted)


class RecordDecoder:
    """Frames, checks the nonce sequence and decrypts; raises :class:`BadRecord`."""

    def __init__(self, key: bytes, max_record: int = DEFAULT_MAX_RECORD) -> None:
        self._box = SecretBox(key)
        self._next_nonce = 0
        self._max = max_record + RECORD_OVERHEAD
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        self._buf += data
        records: list[bytes] = []
        try:
            while len(self._buf) >= 4:
                length = int.from_bytes(self._buf[:4], "big")
                if length > self._max or length < RECORD_OVERHEAD:
                    raise BadRecord(
                        f"the peer sent a record of {length} bytes (limit {self._max}); "
                        "the connection is corrupt or hostile"
                    )
                if len(self._buf) < 4 + length:
                    break
                encrypted = bytes(self._buf[4 : 4 + length])
                del self._buf[: 4 + length]
                records.append(self._decrypt(encrypted))
        except BadRecord as e:
            e.records = records
            raise
        return records

    @property
    def buffered(self) -> int:
        return len(self._buf)

    def _decrypt(self, encrypted: bytes) -> bytes:
        nonce = int.from_bytes(encrypted[:NONCE_SIZE], "big")
        if nonce != self._next_nonce:
            raise BadRecord(
                f"received an out-of-order record (nonce {nonce}, expected {self._next_nonce})"
            )
        try:
            record = self._box.decrypt(encrypted)
        except CryptoError:
            raise BadRecord(
                "a record failed authentication: it was corrupted, or the peer uses another key"
            ) from None
        self._next_nonce += 1
        return record


class TransitConnectionCore:
    """The state of one Transit TCP connection, sans I/O.

    States: ``relay`` (waiting for the relay's ok) -> ``handshake`` ->
    (sender) ``deciding`` / (receiver) ``waiting-for-go`` -> ``records``;
    any violation -> ``failed``.
    """

    def __init__(
        self,
        transit_key: bytes,
        *,
        is_sender: bool,
        relay_side: str | None = None,
        max_record: int = DEFAULT_MAX_RECORD,
    ) -> None:
        self.is_sender = is_sender
        self._send_hs = (
            sender_handshake(transit_key) if is_sender else receiver_handshake(transit_key)
        )
        self._expect_hs = (
            receiver_handshake(transit_key) if is_sender else sender_handshake(transit_key)
        )
        self._relay_hs = relay_handshake(transit_key, relay_side) if relay_side else None
        out_key, in_key = record_keys(transit_key, is_sender)
        self._encoder = RecordEncoder(out_key)
        self._decoder = RecordDecoder(in_key, max_record)
        self._buf = b""
        self.state = "new"

    def connection_made(self) -> list[Event]:
        if self._relay_hs is not None:
            self.state = "relay"
            return [Send(self._relay_hs)]
        self.state = "handshake"
        return [Send(self._send_hs)]

    def decide(self, go: bool) -> list[Event]:
        """(sender) Use this connection (go) or abandon it (nevermind)."""
        assert self.is_sender and self.state == "deciding", self.state
        if not go:
            self.state = "failed"
            return [Send(NEVERMIND), Failed(TransitError("another connection won"))]
        self.state = "records"
        events: list[Event] = [Send(GO), Negotiated()]
        return events + self._records(b"")

    def encode_record(self, record: bytes) -> bytes:
        assert self.state == "records", self.state
        return self._encoder.encode(record)

    def data_received(self, data: bytes) -> list[Event]:
        if self.state == "failed":
            return []
        if self.state == "records":
            return self._records(data)
        self._buf += data
        events: list[Event] = []
        try:
            if self.state == "relay":
                if not self._take(RELAY_OK, "the transit relay"):
                    return events
                self.state = "handshake"
                events.append(Send(self._send_hs))
            if self.state == "handshake":
                if not self._take(self._expect_hs, "the peer"):
                    return events
                if self.is_sender:
                    self.state = "deciding"
                    events.append(ReadyForDecision())
                    return events
                self.state = "waiting-for-go"
            if self.state == "waiting-for-go":
                if not self._take(GO, "the sender"):
                    return events
                self.state = "records"
                events.append(Negotiated())
                rest, self._buf = self._buf, b""
                events.extend(self._records(rest))
        except BadHandshake as e:
            self.state = "failed"
            events.append(Failed(e))
        return events

    def _take(self, expected: bytes, who: str) -> bool:
        """Consume ``expected`` from the buffer; any divergence is fatal."""
        got = self._buf[: len(expected)]
        if not expected.startswith(got):
            if self.state == "waiting-for-go" and NEVERMIND.startswith(got[: len(NEVERMIND)]):
                raise BadHandshake("the sender chose another connection")
            raise BadHandshake(
                f"{who} sent an unexpected handshake ({got[:60]!r}): a different code, "
                "or not a wormhole peer"
            )
        if len(self._buf) < len(expected):
            return False
        self._buf = self._buf[len(expected) :]
        return True

    def _records(self, data: bytes) -> list[Event]:
        if self.state == "deciding":
            self._buf += data
            return []
        if self._buf:
            data, self._buf = self._buf + data, b""
        try:
            return [RecordReceived(r) for r in self._decoder.feed(data)]
        except BadRecord as e:
            self.state = "failed"
            return [*(RecordReceived(r) for r in e.records), Failed(e)]
