"""The ``parquet`` partition format: fewer bytes on a slow link, sans-IO.

Arrow IPC body compression (``lz4``, ``zstd``) compresses each buffer as it
is; Parquet first encodes each column for what it holds: integers as deltas
(``DELTA_BINARY_PACKED``), floating point as byte planes
(``BYTE_STREAM_SPLIT``, so zstd sees the exponent bytes together), strings
with their lengths apart (``DELTA_LENGTH_BYTE_ARRAY``), then zstd. On the
slow-link benchmark's data (``id``, ``rand()``, 16 hex characters) that is
21 % fewer bytes than zstd Arrow IPC, with less CPU to encode and decode
(measured in benchmarks/README.md).

On the wire the partition's ``D`` payloads, concatenated, are a sequence of
frames ``u32 length (big-endian) + one Parquet file`` of about
:data:`CHUNK_RAW_BYTES` of rows each (one frame spans several ``D`` messages).
The lane decodes each frame as it completes and stages Arrow IPC as for
every other format, so nothing after the lane changes. A sender uses it only
when the receiver's answer lists it (:data:`FORMAT`) and the schema
round-trips through Parquet exactly (:func:`supports`).
"""

from __future__ import annotations

import io
import struct
from collections.abc import Iterator

import pyarrow as pa

# pyarrow.parquet is imported where a frame is made or read, not here: every
# process of a transfer imports this module through protocol.py, and a Spark
# read task (which never decodes a frame) would pay its import (~40 ms).

FORMAT = "parquet"
# Rows are gathered into Parquet files of about this many raw bytes: large
# enough that the per-file footer and zstd's warm-up cost under 1 %.
CHUNK_RAW_BYTES = 4 * 1024 * 1024
ZSTD_LEVEL = 1  # higher levels are no smaller on measured data, and slower
_LENGTH = struct.Struct(">I")


def supports(schema: pa.Schema) -> bool:
    """Whether every column round-trips through Parquet exactly (types and values)."""
    return all(_exact(f.type) for f in schema)


def unsupported(schema: pa.Schema) -> str | None:
    """The first column that would not round-trip exactly, as ``name (type)``; None if none."""
    return next((f"{f.name} ({f.type})" for f in schema if not _exact(f.type)), None)


def _exact(t: pa.DataType) -> bool:
    if pa.types.is_struct(t):
        return t.num_fields > 0 and all(_exact(t.field(i).type) for i in range(t.num_fields))
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return _exact(t.value_type)
    if pa.types.is_map(t):
        return _exact(t.key_type) and _exact(t.item_type)
    return (
        pa.types.is_boolean(t)
        or pa.types.is_integer(t)
        or pa.types.is_float32(t)
        or pa.types.is_float64(t)
        or pa.types.is_string(t)
        or pa.types.is_large_string(t)
        or pa.types.is_binary(t)
        or pa.types.is_large_binary(t)
        or pa.types.is_date32(t)
        or pa.types.is_timestamp(t)
        or pa.types.is_decimal128(t)
    )


def _encodings(schema: pa.Schema) -> dict[str, str]:
    """Per top-level column, the encoding that suits what it holds (others: plain)."""
    if len(set(schema.names)) != len(schema.names):
        return {}  # duplicate column names: a name cannot say which column
    chosen = {}
    for f in schema:
        t = f.type
        if pa.types.is_int32(t) or pa.types.is_int64(t):
            chosen[f.name] = "DELTA_BINARY_PACKED"
        elif pa.types.is_float32(t) or pa.types.is_float64(t):
            chosen[f.name] = "BYTE_STREAM_SPLIT"
        elif pa.types.is_string(t) or pa.types.is_binary(t):
            chosen[f.name] = "DELTA_LENGTH_BYTE_ARRAY"
    return chosen


def encode_chunk(table: pa.Table) -> bytes:
    """One frame: the length and a Parquet file of ``table``."""
    import pyarrow.parquet as pq

    sink = io.BytesIO()
    sink.write(b"\0\0\0\0")
    pq.write_table(
        table,
        sink,
        compression="zstd",
        compression_level=ZSTD_LEVEL,
        use_dictionary=False,
        column_encoding=_encodings(table.schema) or None,
        row_group_size=max(1, table.num_rows),
        write_statistics=False,
    )
    data = sink.getbuffer()
    data[:4] = _LENGTH.pack(len(data) - 4)
    return bytes(data)


class ChunkEncoder:
    """Gathers record batches into frames of about :data:`CHUNK_RAW_BYTES` raw bytes."""

    def __init__(self, schema: pa.Schema) -> None:
        self.schema = schema
        self._pending: list[pa.RecordBatch] = []
        self._pending_bytes = 0
        self.frames = 0

    def add(self, batch: pa.RecordBatch) -> bytes | None:
        """A frame once enough rows are gathered, else None."""
        if batch.num_rows:
            self._pending.append(batch)
            self._pending_bytes += batch.nbytes
        if self._pending_bytes < CHUNK_RAW_BYTES:
            return None
        return self._frame()

    def finish(self) -> bytes | None:
        """The last frame (an empty one if the partition has no rows at all)."""
        if self._pending or not self.frames:
            return self._frame()
        return None

    def _frame(self) -> bytes:
        table = pa.Table.from_batches(self._pending, schema=self.schema)
        self._pending, self._pending_bytes = [], 0
        self.frames += 1
        return encode_chunk(table)


class ChunkDecoder:
    """Feeds on the concatenated ``D`` payloads; yields each frame's rows as it completes."""

    def __init__(self, schema: pa.Schema) -> None:
        self.schema = schema
        self._buffer = bytearray()

    def feed(self, data: bytes | memoryview) -> Iterator[pa.Table]:
        self._buffer += data
        while len(self._buffer) >= _LENGTH.size:
            (length,) = _LENGTH.unpack_from(self._buffer)
            end = _LENGTH.size + length
            if len(self._buffer) < end:
                return
            frame = bytes(self._buffer[_LENGTH.size : end])
            del self._buffer[:end]
            yield self._decode(frame)

    def finish(self) -> None:
        """Raise ``ValueError`` if a frame was cut off."""
        if self._buffer:
            raise ValueError(
                f"the partition ends inside a Parquet frame ({len(self._buffer)} bytes)"
            )

    def _decode(self, frame: bytes) -> pa.Table:
        import pyarrow.parquet as pq

        # ParquetFile, not read_table: read_table goes through pyarrow.dataset, which
        # imports pandas (0.3 CPU-s idle, seconds under load): a lane host paid it on
        # its first frame while the link waited.
        table = pq.ParquetFile(pa.BufferReader(frame)).read()
        if not table.schema.equals(self.schema):
            # Parquet keeps the Arrow schema it was written with; a mismatch is a
            # sender bug or a peer we do not understand, never data to keep.
            raise ValueError(f"a Parquet frame has schema {table.schema}, not {self.schema}")
        return table
