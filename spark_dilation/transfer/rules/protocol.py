"""The dataset transfer protocol, sans-IO: names, derivations, messages, rules.

Nothing here touches a socket, a thread or Spark. The Twisted/blocking glue
(:mod:`..meet.rendezvous`, :mod:`..send.pool`, :mod:`..receive.lane`, :mod:`..meet.session`) feeds
these objects and acts on what they return. ``docs/transfer.md`` describes
the protocol as a whole; this module is its executable form.

Wire summary (every JSON object is UTF-8, keys as shown):

* Session over the human code (mailbox app messages, appid of the ``wormhole``
  CLI so one reader accepts a dataset *or* a plain file):
  sender ``{"dataset-offer": {...}}``, receiver ``{"dataset-accept": {...}}``
  or ``{"error": "..."}``.
* Transfer secret: ``derive_key("spark-dilation/transfer-secret/v1", 32)``.
* Rendezvous by introduction: the directory link and doors, nameplates and
  passwords derived from the secret (:mod:`.directory`).
* Partition subchannel ``spark-dilation/partition/v1``: ``H`` header, ``D``
  Arrow IPC stream bytes (at most about 1 MiB of rows each), ``T`` trailer;
  answered by ``C`` complete or ``E`` error.
* Control subchannel ``spark-dilation/control/v1``: ``M`` manifest or ``A``
  abort; answered by ``K`` or ``E``. Opened by the sender towards a lane, and
  by a lane towards each sender connection it holds for ``A`` alone: the
  receiving side ended the transfer (:class:`Abort`). A sender that does not
  listen for it (an older one) refuses the subchannel; nothing else changes.
"""

from __future__ import annotations

import base64
import hashlib
import json
import struct
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import pyarrow as pa
import pyarrow.ipc as ipc

from .codec import AUTO, offer_compression
from .errors import (
    LaneLostError,
    LaneRefusedError,
    ProtocolError,
    ReceiverFailedError,
    TransferAbortedError,
)
from .options import COMPRESSIONS
from .pqformat import FORMAT as PARQUET
from .pqformat import ChunkEncoder

PROTOCOL = "spark-dilation/dataset"
VERSION = 1
# How worker processes meet, named in the offer and the answer: 2 is meeting by
# introduction (transfer/directory.py); 1 (probing shared slots) is refused.
RENDEZVOUS = 2
# app_versions entry of the session wormhole: names our protocol and version.
SESSION_APP_VERSIONS = {PROTOCOL: {"version": VERSION}}
# Which end of the session a side is ("role" in its app_versions entry): two
# readers that typed the same code meet each other, not the sender, and must
# say so instead of each waiting for an offer the other never sends.
SESSION_SENDER = "sender"
SESSION_RECEIVER = "receiver"


def session_versions(role: str) -> dict[str, Any]:
    """Our session app_versions as ``role`` (``SESSION_SENDER`` or ``SESSION_RECEIVER``)."""
    return {PROTOCOL: {"version": VERSION, "role": role}}


def session_role(versions: dict[str, Any]) -> str | None:
    """The peer's session role from its app_versions (None: not said, an older peer)."""
    entry = versions.get(PROTOCOL)
    return entry.get("role") if isinstance(entry, dict) else None


# The rendezvous wormholes (doors and the directory link, transfer/directory.py)
# live in their own appid, so their nameplates never collide with codes people
# type. v2: meeting by introduction (v1 walked shared slots).
RENDEZVOUS_APPID = "spark-dilation.org/dataset-rendezvous/v2"
# Both ends agree (the offer's and the answer's "doors") to meet in an appid derived
# from the transfer secret (rendezvous_appid): a server's `list` of any appid a
# stranger can name then shows none of the transfer's doors. A peer that does not
# say it keeps the public appid above.
DOORS_PRIVATE = "secret-appid"
PARTITION_SUBPROTOCOL = "spark-dilation/partition/v1"
CONTROL_SUBPROTOCOL = "spark-dilation/control/v1"
SECRET_PURPOSE = "spark-dilation/transfer-secret/v1"

# Rows of one record batch go out in messages of at most about this size.
MAX_MESSAGE_BYTES = 1024 * 1024
NAMEPLATE_DIGITS = 30  # the server allows digits only, at most 40

ROLE_SENDER = "sender"
ROLE_LANE = "lane"


# --- derivations ----------------------------------------------------------------------


def transfer_secret(derive: Any) -> bytes:
    """The 32-byte transfer secret, from a confirmed wormhole's ``derive_key``."""
    return derive(SECRET_PURPOSE, 32)


def lane_of(partition: int, lanes: int) -> int:
    """Sender partition ``p`` goes to lane ``p mod L``."""
    return partition % lanes


# --- schema ----------------------------------------------------------------------------


def schema_bytes(schema: pa.Schema) -> bytes:
    return schema.serialize().to_pybytes()


def schema_from_bytes(data: bytes) -> pa.Schema:
    return ipc.read_schema(pa.py_buffer(data))


def schema_fingerprint(schema: pa.Schema) -> str:
    """Names, types and nullability (not metadata): what must match end to end."""
    text = json.dumps([[f.name, str(f.type), f.nullable] for f in schema])
    return hashlib.sha256(text.encode()).hexdigest()[:32]


# --- session messages (mailbox, over the human code) ------------------------------------


@dataclass(frozen=True)
class Offer:
    """The sender's half of the session: what is coming."""

    transfer_id: str
    schema: pa.Schema
    compression: str = "none"
    source: str = "python"  # "spark" or "python": for messages and reports
    # Totals where the sender knows them (None: unknown; optional on the wire, so
    # peers without them still decode): rows, and estimated bytes (the files'
    # sizes, a table's nbytes). The receiver refuses an offer its disk cannot hold.
    rows: int | None = None
    bytes: int | None = None
    private_doors: bool = True  # offers DOORS_PRIVATE (optional on the wire)

    def encode(self) -> bytes:
        body: dict[str, Any] = {
            "version": VERSION,
            "transfer": self.transfer_id,
            "schema": base64.b64encode(schema_bytes(self.schema)).decode(),
            "compression": offer_compression(self.compression),
            "source": self.source,
            "rendezvous": RENDEZVOUS,
        }
        if self.private_doors:
            body["doors"] = DOORS_PRIVATE
        if self.compression == AUTO:
            # Optional: receivers that know it report "auto"; older ones see
            # "zstd" and decode whatever each partition chose (Arrow IPC says).
            body["compression_auto"] = True
        elif self.compression == PARQUET:
            # Likewise: an older receiver sees "zstd" and gets zstd (its
            # answer lists no formats).
            body["compression_parquet"] = True
        if self.rows is not None:
            body["rows"] = self.rows
        if self.bytes is not None:
            body["bytes"] = self.bytes
        return json.dumps({"dataset-offer": body}).encode()

    @classmethod
    def decode(cls, body: dict[str, Any]) -> Offer:
        try:
            if int(body["version"]) != VERSION:
                raise ProtocolError(
                    f"the sender speaks dataset protocol version {body['version']}, we speak "
                    f"{VERSION}: install the same spark-dilation version on both sides"
                )
            _check_rendezvous(body, "sender")
            compression = str(body.get("compression", "none"))
            if compression not in COMPRESSIONS:
                raise ProtocolError(f"the sender asked for unknown compression {compression!r}")
            if body.get("compression_auto") is True:
                compression = AUTO
            elif body.get("compression_parquet") is True:
                compression = PARQUET
            return cls(
                transfer_id=str(body["transfer"]),
                schema=schema_from_bytes(base64.b64decode(body["schema"])),
                compression=compression,
                source=str(body.get("source", "python")),
                rows=_optional_count(body.get("rows")),
                bytes=_optional_count(body.get("bytes")),
                private_doors=body.get("doors") == DOORS_PRIVATE,
            )
        except (KeyError, TypeError, ValueError, pa.ArrowException) as e:
            raise ProtocolError(f"the sender's dataset offer is malformed: {e}") from e


def _check_rendezvous(body: dict[str, Any], who: str) -> None:
    if body.get("rendezvous") != RENDEZVOUS:
        raise ProtocolError(
            f"the {who} runs an older spark-dilation whose workers meet by probing shared "
            f"slots (rendezvous {body.get('rendezvous', 1)}, we speak {RENDEZVOUS}): install "
            "the same spark-dilation version on both sides"
        )


def _optional_count(value: Any) -> int | None:
    """An optional non-negative total of the offer; anything else is unknown (None)."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    return None


@dataclass(frozen=True)
class Accept:
    """The receiver's half: how many lanes read in parallel, and the partition formats
    besides Arrow IPC its lanes decode (optional on the wire: an older receiver
    sends none, and gets Arrow IPC)."""

    lanes: int
    formats: tuple[str, ...] = ()
    private_doors: bool = False  # agrees to DOORS_PRIVATE (only if the offer had it)

    def encode(self) -> bytes:
        body: dict[str, Any] = {"lanes": self.lanes, "rendezvous": RENDEZVOUS}
        if self.formats:
            body["formats"] = list(self.formats)
        if self.private_doors:
            body["doors"] = DOORS_PRIVATE
        return json.dumps({"dataset-accept": body}).encode()

    @classmethod
    def decode(cls, body: dict[str, Any]) -> Accept:
        try:
            lanes = int(body["lanes"])
        except (KeyError, TypeError, ValueError) as e:
            raise ProtocolError(f"the receiver's answer is malformed: {e}") from e
        if lanes < 1:
            raise ProtocolError(f"the receiver asked for {lanes} lanes")
        _check_rendezvous(body, "receiver")
        formats = body.get("formats")
        known = tuple(f for f in formats if isinstance(f, str)) if isinstance(formats, list) else ()
        return cls(lanes, known, body.get("doors") == DOORS_PRIVATE)


def decode_session_message(data: bytes) -> tuple[str, Any]:
    """``("offer", Offer)``, ``("accept", Accept)``, ``("error", str)`` or ``("other", dict)``."""
    try:
        message = json.loads(data)
    except ValueError as e:
        raise ProtocolError(f"the other side sent a message that is not JSON: {e}") from e
    if not isinstance(message, dict):
        raise ProtocolError("the other side sent a message that is not a JSON object")
    if "dataset-offer" in message:
        return "offer", Offer.decode(message["dataset-offer"])
    if "dataset-accept" in message:
        return "accept", Accept.decode(message["dataset-accept"])
    if "error" in message:
        return "error", str(message["error"])
    return "other", message


def error_message(text: str) -> bytes:
    return json.dumps({"error": text}).encode()


def failure_answer(text: str) -> bytes:
    """The lane's ``E`` when the receiver itself failed (its disk, its output).

    ``"failed": true`` tells the sender that ``text`` is the receiver's whole
    error, to raise as is and never to retry (older senders show it as a refusal).
    """
    return encode_json(TAG_ERROR, {"error": text, "failed": True})


# --- subchannel messages ------------------------------------------------------------------

TAG_HEADER = b"H"
TAG_DATA = b"D"
TAG_TRAILER = b"T"
TAG_COMPLETE = b"C"
TAG_ERROR = b"E"
TAG_MANIFEST = b"M"
TAG_ABORT = b"A"
TAG_OK = b"K"
_JSON_TAGS = (TAG_HEADER, TAG_TRAILER, TAG_COMPLETE, TAG_ERROR, TAG_MANIFEST, TAG_ABORT, TAG_OK)


def encode_json(tag: bytes, body: dict[str, Any]) -> bytes:
    return tag + json.dumps(body, separators=(",", ":")).encode()


def decode_message(message: bytes) -> tuple[bytes, Any]:
    """``(tag, body)``: a dict for JSON messages, a memoryview of the bytes for ``D``."""
    if not message:
        raise ProtocolError("empty message on a dataset subchannel")
    tag = message[:1]
    if tag == TAG_DATA:
        return tag, memoryview(message)[1:]
    if tag not in _JSON_TAGS:
        raise ProtocolError(f"unknown message tag {tag!r} on a dataset subchannel")
    try:
        body = json.loads(message[1:])
    except ValueError as e:
        raise ProtocolError(f"malformed {tag.decode()} message: {e}") from e
    if not isinstance(body, dict):
        raise ProtocolError(f"malformed {tag.decode()} message: not an object")
    return tag, body


ABORT_TIMEOUT = 10.0
"""Seconds a side that ends the transfer tries to tell the other (its ``A``, and the
directory link): a round trip after the data already queued, instant on a fast link."""


@dataclass(frozen=True)
class Abort:
    """``A``: one side ended the whole transfer; the other side stops at once.

    Either way: the sender tells every lane (its task failed, or it was
    cancelled), a lane tells every sender connection it holds (the receiver
    was cancelled, or failed on its side). The rule on receipt is the same
    on both sides: the transfer is over, nothing is retried, and the error
    shown is :meth:`text`. ``reason`` is the cause (``"Ctrl-C"``) when
    ``cancelled``, else what failed.
    """

    reason: str
    cancelled: bool = False

    def encode(self) -> bytes:
        return encode_json(TAG_ABORT, {"reason": self.reason, "cancelled": self.cancelled})

    @classmethod
    def from_body(cls, body: dict[str, Any]) -> Abort:
        # An older sender sent {"reason": ...} alone.
        return cls(str(body.get("reason") or "no reason given"), bool(body.get("cancelled")))

    def text(self, side: str) -> str:
        """The one-line error the other side shows; ``side`` is who sent it ("sender")."""
        if self.cancelled:
            return f"the {side} cancelled the transfer ({self.reason})"
        return f"the {side} aborted the transfer: {self.reason}"


@dataclass(frozen=True)
class PartitionHeader:
    transfer_id: str
    partition: int
    attempt: int
    schema: str  # schema_fingerprint
    compression: str = "none"

    def encode(self) -> bytes:
        return encode_json(
            TAG_HEADER,
            {
                "transfer": self.transfer_id,
                "partition": self.partition,
                "attempt": self.attempt,
                "schema": self.schema,
                "compression": self.compression,
            },
        )

    @classmethod
    def from_body(cls, body: dict[str, Any]) -> PartitionHeader:
        try:
            return cls(
                str(body["transfer"]),
                int(body["partition"]),
                int(body["attempt"]),
                str(body["schema"]),
                str(body.get("compression", "none")),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ProtocolError(f"malformed partition header: {e}") from e


@dataclass(frozen=True)
class Trailer:
    rows: int
    bytes: int
    checksum: str

    def encode(self) -> bytes:
        return encode_json(
            TAG_TRAILER, {"rows": self.rows, "bytes": self.bytes, "checksum": self.checksum}
        )

    @classmethod
    def from_body(cls, body: dict[str, Any]) -> Trailer:
        try:
            return cls(int(body["rows"]), int(body["bytes"]), str(body["checksum"]))
        except (KeyError, TypeError, ValueError) as e:
            raise ProtocolError(f"malformed partition trailer: {e}") from e


@dataclass(frozen=True)
class Complete:
    """The lane's answer: the partition is safely staged (or was already)."""

    partition: int
    attempt: int
    lane: int
    incarnation: str
    rows: int
    duplicate: bool = False

    def encode(self) -> bytes:
        return encode_json(TAG_COMPLETE, asdict(self))

    @classmethod
    def from_body(cls, body: dict[str, Any]) -> Complete:
        try:
            return cls(
                int(body["partition"]),
                int(body["attempt"]),
                int(body["lane"]),
                str(body["incarnation"]),
                int(body["rows"]),
                bool(body.get("duplicate", False)),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ProtocolError(f"malformed complete message: {e}") from e


@dataclass(frozen=True)
class CommittedPartition:
    """One entry of the final manifest (and a sender task's commit message)."""

    partition: int
    attempt: int
    lane: int
    incarnation: str
    rows: int
    bytes: int


@dataclass(frozen=True)
class Manifest:
    transfer_id: str
    partitions: tuple[CommittedPartition, ...]

    @classmethod
    def of(cls, transfer_id: str, partitions: Iterable[CommittedPartition]) -> Manifest:
        """The manifest of these committed partitions, in partition order."""
        return cls(transfer_id, tuple(sorted(partitions, key=lambda c: c.partition)))

    def for_lane(self, lane: int) -> list[CommittedPartition]:
        return sorted((c for c in self.partitions if c.lane == lane), key=lambda c: c.partition)

    @property
    def rows(self) -> int:
        return sum(c.rows for c in self.partitions)

    def encode(self) -> bytes:
        return encode_json(
            TAG_MANIFEST,
            {"transfer": self.transfer_id, "partitions": [asdict(c) for c in self.partitions]},
        )

    @classmethod
    def from_body(cls, body: dict[str, Any]) -> Manifest:
        try:
            parts = tuple(
                CommittedPartition(
                    int(c["partition"]),
                    int(c["attempt"]),
                    int(c["lane"]),
                    str(c["incarnation"]),
                    int(c["rows"]),
                    int(c["bytes"]),
                )
                for c in body["partitions"]
            )
            return cls(str(body["transfer"]), parts)
        except (KeyError, TypeError, ValueError) as e:
            raise ProtocolError(f"malformed manifest: {e}") from e

    def to_json(self) -> str:
        return self.encode()[1:].decode()

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        return cls.from_body(json.loads(text))


def check_manifest(manifest: Manifest) -> None:
    """Each partition committed once (Spark's commit protocol guarantees it; we check)."""
    seen: set[int] = set()
    for c in manifest.partitions:
        if c.partition in seen:
            raise ProtocolError(f"partition {c.partition} appears twice in the manifest")
        seen.add(c.partition)


# --- partition stream: sender side -------------------------------------------------------


class _Capture:
    """A write-only file object that collects what the IPC writer emits."""

    def __init__(self) -> None:
        self.parts: list[bytes] = []
        self.closed = False

    def write(self, data: Any) -> int:
        self.parts.append(bytes(data))
        return len(data)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True

    def take(self, prefix: bytes) -> bytes:
        """``prefix`` and everything written since the last take, in one copy."""
        data = b"".join([prefix, *self.parts])
        self.parts.clear()
        return data


def split_batch(
    batch: pa.RecordBatch, max_bytes: int = MAX_MESSAGE_BYTES
) -> Iterator[pa.RecordBatch]:
    """Slices of ``batch`` of at most about ``max_bytes`` each (by rows; one row minimum)."""
    rows = batch.num_rows
    # nbytes counts what a slice references; get_total_buffer_size() counts
    # whole buffers, so every slice of a big table looked big and was cut
    # into hundreds of tiny messages.
    size = batch.nbytes if rows else 0
    if rows <= 1 or size <= max_bytes:
        yield batch
        return
    per_row = max(1, size // rows)
    step = max(1, max_bytes // per_row)
    for start in range(0, rows, step):
        yield batch.slice(start, step)


class PartitionEncoder:
    """Turns record batches into the ``D`` messages of one partition stream.

    The bytes of all ``D`` messages, concatenated, are one Arrow IPC stream
    (schema message first, end-of-stream marker last), so the lane can write
    them to disk as they come and read them back with ``pyarrow.ipc``.
    Compression is Arrow IPC body compression (``lz4`` = LZ4 frame, ``zstd``).
    With ``compression="parquet"`` the concatenated payloads are Parquet
    frames instead (:mod:`.pqformat`; only to a receiver that listed it).
    """

    def __init__(
        self,
        schema: pa.Schema,
        compression: str | pa.Codec | None = "none",
        max_bytes: int = MAX_MESSAGE_BYTES,
    ) -> None:
        # A codec name, or a pyarrow Codec (a level chosen by compression=auto).
        self.schema = schema
        self.max_bytes = max_bytes
        self._capture = _Capture()
        self._chunks: ChunkEncoder | None = None
        if compression == PARQUET:
            self._chunks = ChunkEncoder(schema)
        else:
            if isinstance(compression, str):
                if compression not in COMPRESSIONS:
                    raise ValueError(f"compression must be one of {', '.join(COMPRESSIONS)}")
                compression = None if compression == "none" else compression
            options = ipc.IpcWriteOptions(compression=compression)
            self._writer = ipc.new_stream(self._capture, schema, options=options)
        self._crc = 0
        self.rows = 0
        self.bytes = 0
        self.messages = 0

    def _emit(self) -> bytes:
        for part in self._capture.parts:
            self._crc = zlib.crc32(part, self._crc)
        message = self._capture.take(TAG_DATA)
        self.bytes += len(message) - 1
        self.messages += 1
        return message

    def _frame_messages(self, frame: bytes | None) -> Iterator[bytes]:
        """A Parquet frame as ``D`` messages of at most ``max_bytes`` each."""
        if frame is None:
            return
        view = memoryview(frame)
        for start in range(0, len(view), self.max_bytes):
            self._capture.write(view[start : start + self.max_bytes])
            yield self._emit()

    def encode(self, batch: pa.RecordBatch) -> Iterator[bytes]:
        """``D`` messages for ``batch`` (already cast to the agreed schema)."""
        if self._chunks is not None:
            self.rows += batch.num_rows
            yield from self._frame_messages(self._chunks.add(batch))
            return
        for piece in split_batch(batch, self.max_bytes):
            if piece.num_rows == 0 and self.messages:
                continue
            self._writer.write_batch(piece)
            self.rows += piece.num_rows
            yield self._emit()

    def finish(self) -> list[bytes]:
        """The last ``D`` message(s) (end of stream, the last frame) and the trailer."""
        if self._chunks is not None:
            last = list(self._frame_messages(self._chunks.finish()))
        else:
            self._writer.close()
            last = [self._emit()]
        return [*last, Trailer(self.rows, self.bytes, f"{self._crc:08x}").encode()]


# --- partition stream: lane side ---------------------------------------------------------


_I32 = struct.Struct("<i")
_U32 = struct.Struct("<I")
_U16 = struct.Struct("<H")
_I64 = struct.Struct("<q")
_RECORD_BATCH = 3  # MessageHeader union: NONE, Schema, DictionaryBatch, RecordBatch, ...


def _table_field(buf: memoryview, table: int, index: int) -> int:
    """Where field ``index`` of the flatbuffer table at ``table`` is, or 0 if absent."""
    vtable = table - _I32.unpack_from(buf, table)[0]
    vtable_size = _U16.unpack_from(buf, vtable)[0]
    if 4 + 2 * index >= vtable_size:
        return 0
    offset = _U16.unpack_from(buf, vtable + 4 + 2 * index)[0]
    return table + offset if offset else 0


def ipc_rows(payload: bytes | memoryview) -> int:
    """The rows of the record batches in ``payload``: whole Arrow IPC stream messages,
    as a ``D`` message of a non-Parquet partition holds. Only the messages' metadata
    (flatbuffers) is read: no body is decoded or decompressed, so the lane counts
    rows as they arrive for the price of a few struct reads."""
    buf = memoryview(payload).cast("B")
    rows, pos = 0, 0
    while pos + 8 <= len(buf):
        if _I32.unpack_from(buf, pos)[0] != -1:
            raise ProtocolError("not an Arrow IPC message")
        size = _I32.unpack_from(buf, pos + 4)[0]
        if size == 0:  # end of stream
            break
        meta = buf[pos + 8 : pos + 8 + size]
        message = _U32.unpack_from(meta, 0)[0]
        kind_at = _table_field(meta, message, 1)
        body_at = _table_field(meta, message, 3)
        body = _I64.unpack_from(meta, body_at)[0] if body_at else 0
        if kind_at and meta[kind_at] == _RECORD_BATCH:
            header_at = _table_field(meta, message, 2)
            batch = header_at + _U32.unpack_from(meta, header_at)[0]
            length_at = _table_field(meta, batch, 0)
            rows += _I64.unpack_from(meta, length_at)[0] if length_at else 0
        pos += 8 + size + body
    return rows


@dataclass
class PartitionAssembler:
    """Checks one incoming partition stream; the glue writes the bytes where it wants.

    Feed the ``D`` payloads to :meth:`data` in order, then the trailer to
    :meth:`finish`, which raises :class:`ProtocolError` if the row count or
    checksum does not match what arrived.
    """

    header: PartitionHeader
    max_bytes: int = 1 << 40
    bytes: int = 0
    crc: int = 0

    def data(self, payload: bytes | memoryview) -> None:
        self.bytes += len(payload)
        if self.bytes > self.max_bytes:
            raise ProtocolError(
                f"partition {self.header.partition} exceeds the {self.max_bytes}-byte limit"
            )
        self.crc = zlib.crc32(payload, self.crc)

    def finish(self, trailer: Trailer) -> None:
        checksum = f"{self.crc:08x}"
        if trailer.bytes != self.bytes or trailer.checksum != checksum:
            raise ProtocolError(
                f"partition {self.header.partition} attempt {self.header.attempt} arrived "
                f"damaged: {self.bytes} bytes with checksum {checksum}, the "
                f"sender sent {trailer.bytes} bytes with checksum {trailer.checksum}"
            )


# --- the lane's book -------------------------------------------------------------------------


@dataclass(frozen=True)
class Decision:
    """What the lane does with an incoming partition stream."""

    action: str  # "receive", "discard" (already have it: answer complete), "refuse"
    reason: str = ""
    ended: bool = False  # refused because the transfer is over (an abort either way)


class LaneBook:
    """Which partitions a lane holds and what the manifest says: the lane's rules.

    * A partition is kept from the first attempt that completes; later
      attempts of the same partition are answered "complete" and discarded,
      so a retried or speculative sender task never duplicates rows.
    * An attempt that stops before its trailer is never kept (nor emitted).
    * With the manifest the lane knows its whole share: it is done when it
      holds every partition the manifest lists for it; a listed partition it
      does not hold was lost with an earlier lane incarnation, which cannot heal.
    """

    def __init__(self, transfer_id: str, lane: int, lanes: int, schema: str) -> None:
        self.transfer_id = transfer_id
        self.lane = lane
        self.lanes = lanes
        self.schema = schema
        self.held: dict[int, tuple[int, int]] = {}  # partition -> (attempt, rows)
        self.manifest: Manifest | None = None
        self.aborted: str | None = None

    def begin(self, header: PartitionHeader) -> Decision:
        if self.aborted is not None:
            return Decision("refuse", self.aborted, ended=True)
        if header.transfer_id != self.transfer_id:
            return Decision("refuse", "this partition belongs to another transfer")
        if header.schema != self.schema:
            return Decision(
                "refuse",
                f"partition {header.partition} has a different schema than the one agreed "
                "when the transfer started; every partition must have the DataFrame's schema",
            )
        if lane_of(header.partition, self.lanes) != self.lane:
            return Decision(
                "refuse",
                f"partition {header.partition} belongs to lane "
                f"{lane_of(header.partition, self.lanes)}, not {self.lane}",
            )
        if header.partition in self.held:
            return Decision("discard", "already held")
        return Decision("receive")

    def completed(self, partition: int, attempt: int, rows: int) -> bool:
        """Record a complete attempt; False if another attempt got there first."""
        if partition in self.held:
            return False
        self.held[partition] = (attempt, rows)
        return True

    def got_manifest(self, manifest: Manifest) -> None:
        if manifest.transfer_id != self.transfer_id:
            raise ProtocolError("the manifest belongs to another transfer")
        check_manifest(manifest)
        self.manifest = manifest

    def missing(self) -> list[CommittedPartition]:
        """Partitions the manifest lists for this lane that are not held yet."""
        if self.manifest is None:
            return []
        return [c for c in self.manifest.for_lane(self.lane) if c.partition not in self.held]

    def done(self) -> bool:
        return self.manifest is not None and not self.missing()

    def check_rows(self) -> None:
        """Held row counts agree with the manifest (a retried attempt must match)."""
        assert self.manifest is not None
        for c in self.manifest.for_lane(self.lane):
            held = self.held.get(c.partition)
            if held is not None and held[1] != c.rows:
                raise ProtocolError(
                    f"partition {c.partition}: the lane holds {held[1]} rows (attempt "
                    f"{held[0]}) but the committed attempt {c.attempt} had {c.rows}; the "
                    "sending DataFrame is not deterministic"
                )

    def committed_partitions(self) -> list[int]:
        assert self.manifest is not None
        return [c.partition for c in self.manifest.for_lane(self.lane)]


def lane_answer(reply: bytes | None, lane: int, expected: bytes, what: str) -> dict:
    """The body of the lane's answer about ``what`` if it is ``expected``; else the error."""
    if reply is None:
        raise LaneLostError(f"lane {lane} closed without confirming {what}")
    tag, body = decode_message(reply)
    if tag == TAG_ERROR and body.get("ended"):
        raise TransferAbortedError(str(body.get("error")))  # the receiving side ended it
    if tag == TAG_ERROR and body.get("failed"):
        raise ReceiverFailedError(str(body.get("error")))
    if tag == TAG_ERROR:
        raise LaneRefusedError(f"lane {lane} refused {what}: {body.get('error')}")
    if tag != expected:
        raise ProtocolError(f"lane {lane} answered {tag!r} about {what}")
    return body
