"""What a stream's sender and receiver say on their pair's subchannel (pure).

The sending run opens one subchannel, ``spark-dilation/stream/v1``, on each
pair's Dilation (:mod:`..meet.resume`), and both ends speak frames::

    frame: len(4, big-endian) kind(1) body       len counts kind and body
    kind J: a JSON message                        kind D: a chunk of a partition

sender -> receiver:

* ``{"t": "part", "query", "batch", "partition", "attempt", "size"}``, then
  ``size`` bytes of Arrow IPC in D chunks of at most :data:`CHUNK`: one
  attempt of one write task of micro-batch ``batch``;
* ``{"t": "manifest", "query", "batch", "attempts": {partition: attempt},
  "rows", "nbytes", "checkpoint"}``: the sink committed ``batch`` with these
  attempts; ``query`` is Spark's id of the sending query (its checkpoint's),
  ``checkpoint`` its location where the sink knows it (for messages only);

receiver -> sender:

* ``{"t": "have", "batch", "seq"}``: ``batch`` is staged durably (its sequence number);
* ``{"t": "missing", "batch", "partitions"}``: the manifest names attempts not kept
  (sent again, then the manifest again);
* ``{"t": "refused", "batch", "error"}``: the receiving side cannot take it
  (a reset sending checkpoint, a full stage); the sink's commit fails with it,
  and the receiving query ends with the same cause;
* ``{"t": "consumed", "below"}``: the receiving query committed every staged
  batch below sequence number ``below`` (progress only).

The batches' rules (exactly once) are :mod:`.ledger`'s.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Any

from .errors import ProtocolError

SUBPROTOCOL = "spark-dilation/stream/v1"
CHUNK = 1024 * 1024
MAX_FRAME = CHUNK + 64 * 1024  # a chunk, or a JSON message (a manifest of many partitions)
_LEN = struct.Struct(">I")
_JSON, _DATA = b"J", b"D"
PART, MANIFEST = "part", "manifest"
HAVE, MISSING, REFUSED, CONSUMED = "have", "missing", "refused", "consumed"


def message(t: str, **fields: Any) -> bytes:
    """One JSON message, framed."""
    body = _JSON + json.dumps({"t": t, **fields}, separators=(",", ":")).encode()
    if len(body) > MAX_FRAME:
        raise ProtocolError(f"a stream message of {len(body)} bytes is over {MAX_FRAME}")
    return _LEN.pack(len(body)) + body


def part(query: str, batch: int, partition: int, attempt: str, data: bytes) -> list[bytes]:
    """A partition's frames: its header, then its Arrow IPC bytes in chunks."""
    frames = [
        message(
            PART, query=query, batch=batch, partition=partition, attempt=attempt, size=len(data)
        )
    ]
    view = memoryview(data)
    for at in range(0, len(data), CHUNK):
        chunk = view[at : at + CHUNK]
        frames.append(_LEN.pack(len(chunk) + 1) + _DATA + bytes(chunk))
    return frames


@dataclass(frozen=True)
class Message:
    """A JSON message."""

    body: dict[str, Any]

    @property
    def t(self) -> str:
        return str(self.body.get("t"))


@dataclass(frozen=True)
class Chunk:
    """Bytes of the partition ``header`` announced; ``last`` on its final chunk."""

    header: dict[str, Any]
    data: bytes
    last: bool


class Incoming:
    """Bytes from the subchannel in, :class:`Message` and :class:`Chunk` events out.

    A partition's header is followed by exactly its ``size`` in chunks; a
    header of size 0 yields one empty last chunk. Anything else is a
    :class:`ProtocolError` (the other end is not this protocol's).
    """

    def __init__(self) -> None:
        self._buf = bytearray()
        self._part: dict[str, Any] | None = None
        self._left = 0

    def feed(self, data: bytes) -> list[Message | Chunk]:
        self._buf += data
        events: list[Message | Chunk] = []
        while len(self._buf) >= _LEN.size:
            (size,) = _LEN.unpack_from(self._buf)
            if size < 1 or size > MAX_FRAME:
                raise ProtocolError(f"a stream frame of {size} bytes")
            if len(self._buf) < _LEN.size + size:
                break
            kind = bytes(self._buf[4:5])
            body = bytes(self._buf[5 : 4 + size])
            del self._buf[: 4 + size]
            events += self._frame(kind, body)
        return events

    def _frame(self, kind: bytes, body: bytes) -> list[Message | Chunk]:
        if kind == _DATA:
            if self._part is None or len(body) > self._left:
                raise ProtocolError("a partition's bytes that no header announced")
            self._left -= len(body)
            header = self._part
            if self._left == 0:
                self._part = None
            return [Chunk(header, body, self._part is None)]
        if kind != _JSON:
            raise ProtocolError(f"a stream frame of kind {kind!r}")
        if self._part is not None:
            raise ProtocolError("a message inside a partition's bytes")
        try:
            value = json.loads(body)
        except ValueError as e:
            raise ProtocolError(f"a stream message that is not JSON: {e}") from None
        if not isinstance(value, dict) or not isinstance(value.get("t"), str):
            raise ProtocolError("a stream message without a type")
        if value["t"] != PART:
            return [Message(value)]
        size = value.get("size")
        if not isinstance(size, int) or size < 0:
            raise ProtocolError("a partition header without a size")
        if size == 0:
            return [Chunk(value, b"", True)]
        self._part, self._left = value, size
        return []
