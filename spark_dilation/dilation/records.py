"""L3 records: the plaintext inside each Noise transport frame.

Layouts (magic-wormhole 0.24 ``_dilation/connection.py``; on the wire the
scid comes before the seqnum, whatever the reference's tuple order):

=====  ====  =========================================================
KCM    0x00  (nothing)
PING   0x01  ping_id (4 opaque bytes)
PONG   0x02  ping_id (the same 4 bytes)
OPEN   0x03  be4 scid, be4 seqnum, subprotocol name (UTF-8, the rest)
DATA   0x04  be4 scid, be4 seqnum, payload (the rest)
CLOSE  0x05  be4 scid, be4 seqnum
ACK    0x06  be4 resp_seqnum
=====  ====  =========================================================

Decoding is strict: a record with a wrong length for its type, an unknown
tag or a name that is not UTF-8 raises :class:`RecordError` (the reference
raises on unknown tags too, which drops the connection).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from ..errors import DilationError

T_KCM, T_PING, T_PONG, T_OPEN, T_DATA, T_CLOSE, T_ACK = range(7)
MAX_BE4 = 2**32 - 1

_BE4 = struct.Struct(">L")
_BE4x2 = struct.Struct(">LL")


class RecordError(DilationError):
    """A record that cannot be decoded: the connection must be dropped."""


@dataclass(frozen=True, slots=True)
class KCM:
    """Key confirmation message: the first record each side sends."""


@dataclass(frozen=True, slots=True)
class Ping:
    ping_id: bytes


@dataclass(frozen=True, slots=True)
class Pong:
    ping_id: bytes


@dataclass(frozen=True, slots=True)
class Open:
    scid: int
    seqnum: int
    subprotocol: str


@dataclass(frozen=True, slots=True)
class Data:
    scid: int
    seqnum: int
    data: bytes


@dataclass(frozen=True, slots=True)
class Close:
    scid: int
    seqnum: int


@dataclass(frozen=True, slots=True)
class Ack:
    resp_seqnum: int


Record = KCM | Ping | Pong | Open | Data | Close | Ack
# Records that carry a seqnum, are queued until ACKed and replayed on reconnect.
Sequenced = Open | Data | Close


def _be4(value: int) -> bytes:
    if not 0 <= value <= MAX_BE4:
        raise ValueError(f"{value} does not fit in 4 bytes")
    return _BE4.pack(value)


def encode_record(r: Record) -> bytes:
    match r:
        case Data(scid, seqnum, data):
            return bytes((T_DATA,)) + _be4(scid) + _be4(seqnum) + data
        case Ack(resp_seqnum):
            return bytes((T_ACK,)) + _be4(resp_seqnum)
        case Open(scid, seqnum, subprotocol):
            return bytes((T_OPEN,)) + _be4(scid) + _be4(seqnum) + subprotocol.encode("utf-8")
        case Close(scid, seqnum):
            return bytes((T_CLOSE,)) + _be4(scid) + _be4(seqnum)
        case Ping(ping_id) | Pong(ping_id):
            if len(ping_id) != 4:
                raise ValueError("ping_id must be 4 bytes")
            return bytes((T_PING if isinstance(r, Ping) else T_PONG,)) + ping_id
        case KCM():
            return bytes((T_KCM,))
    raise TypeError(f"not a record: {r!r}")


def encode_data_header(scid: int, seqnum: int) -> bytes:
    """The 9 bytes before a DATA payload (lets callers avoid copying payloads)."""
    return bytes((T_DATA,)) + _BE4x2.pack(scid, seqnum)


def decode_record(plaintext: bytes | memoryview) -> Record:
    """Parse one record; raises :class:`RecordError` for anything malformed."""
    if len(plaintext) == 0:
        raise RecordError("empty record")
    tag = plaintext[0]
    size = len(plaintext)
    if tag == T_DATA:
        if size < 9:
            raise RecordError("truncated DATA record")
        scid, seqnum = _BE4x2.unpack_from(plaintext, 1)
        return Data(scid, seqnum, bytes(plaintext[9:]))
    if tag == T_ACK:
        if size != 5:
            raise RecordError(f"ACK record of {size} bytes (want 5)")
        return Ack(_BE4.unpack_from(plaintext, 1)[0])
    if tag in (T_PING, T_PONG):
        if size != 5:
            raise RecordError(f"PING/PONG record of {size} bytes (want 5)")
        ping_id = bytes(plaintext[1:5])
        return Ping(ping_id) if tag == T_PING else Pong(ping_id)
    if tag == T_OPEN:
        if size < 9:
            raise RecordError("truncated OPEN record")
        scid, seqnum = _BE4x2.unpack_from(plaintext, 1)
        try:
            name = bytes(plaintext[9:]).decode("utf-8")
        except UnicodeDecodeError:
            raise RecordError("OPEN record with a subprotocol name that is not UTF-8") from None
        return Open(scid, seqnum, name)
    if tag == T_CLOSE:
        if size != 9:
            raise RecordError(f"CLOSE record of {size} bytes (want 9)")
        scid, seqnum = _BE4x2.unpack_from(plaintext, 1)
        return Close(scid, seqnum)
    if tag == T_KCM:
        if size != 1:
            raise RecordError(f"KCM record of {size} bytes (want 1)")
        return KCM()
    raise RecordError(f"unknown record type 0x{tag:02x}")
