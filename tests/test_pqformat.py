"""The ``parquet`` partition format: exact round trips, framing, negotiation, a real transfer."""

from __future__ import annotations

import datetime
import decimal
import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from spark_dilation.transfer import receive_dataset, send_in_background
from spark_dilation.transfer.receive.lane import _ParquetStaging
from spark_dilation.transfer.receive.staging import read_staged
from spark_dilation.transfer.rules import pqformat
from spark_dilation.transfer.rules.errors import ProtocolError
from spark_dilation.transfer.rules.options import TransferOptions
from spark_dilation.transfer.rules.protocol import (
    TAG_DATA,
    TAG_HEADER,
    Accept,
    Offer,
    PartitionEncoder,
    decode_message,
)
from spark_dilation.transfer.rules.spec import TransferSpec
from spark_dilation.transfer.send.stream import PartitionStream


def rich(rows: int = 3000) -> pa.Table:
    """Every type the format claims to keep, with nulls, NaN, -0.0 and nesting."""
    rng = np.random.default_rng(7)
    x = rng.random(rows)
    x[: min(3, rows)] = [np.nan, np.inf, -0.0][: min(3, rows)]
    cols = {
        "b": pa.array([None if i % 5 == 0 else i % 2 == 0 for i in range(rows)]),
        "i8": pa.array(np.arange(rows) % 100, pa.int8()),
        "i32": pa.array(np.arange(rows), pa.int32()),
        "i64": pa.array(np.arange(rows) * -7, pa.int64()),
        "u64": pa.array(np.arange(rows), pa.uint64()),
        "f32": pa.array(rng.random(rows).astype("float32")),
        "f64": pa.array(x),
        "s": pa.array([None if i % 7 == 0 else f"x{i}" for i in range(rows)]),
        "ls": pa.array([f"y{i}" for i in range(rows)], pa.large_string()),
        "bin": pa.array([bytes([i % 256]) * (i % 4) for i in range(rows)]),
        "d": pa.array([datetime.date(2020, 1, 1) + datetime.timedelta(i) for i in range(rows)]),
        "ts": pa.array(
            [datetime.datetime(2020, 1, 1, 1, 2, 3, i) for i in range(rows)],
            pa.timestamp("us", tz="UTC"),
        ),
        "tsn": pa.array(np.arange(rows), pa.timestamp("ns")),
        "dec": pa.array([decimal.Decimal(f"{i}.45") for i in range(rows)], pa.decimal128(23, 2)),
        "lst": pa.array([[i, None] if i % 3 else None for i in range(rows)], pa.list_(pa.int64())),
        "st": pa.array([{"a": i, "b": str(i)} for i in range(rows)]),
        "m": pa.array([[("k", i * 0.5)] for i in range(rows)], pa.map_(pa.string(), pa.float64())),
    }
    t = pa.table(cols)
    schema = pa.schema([pa.field(f.name, f.type, nullable=f.name != "i32") for f in t.schema])
    return t.cast(schema)


def same(a: pa.Table, b: pa.Table) -> None:
    """Equal schemas and values; floats bit for bit (NaN == NaN, -0.0 != 0.0)."""
    assert a.schema.equals(b.schema), (a.schema, b.schema)
    for name in a.column_names:
        x, y = a.column(name).combine_chunks(), b.column(name).combine_chunks()
        if pa.types.is_floating(x.type):
            assert x.null_count == y.null_count == 0
            assert x.to_numpy().tobytes() == y.to_numpy().tobytes(), name
        else:
            assert x.equals(y), name


def frames_of(t: pa.Table, batch_rows: int) -> bytes:
    encoder = pqformat.ChunkEncoder(t.schema)
    out = [encoder.add(b) for b in t.to_batches(batch_rows)]
    out.append(encoder.finish())
    return b"".join(f for f in out if f)


def test_every_supported_type_round_trips_exactly_in_pieces_of_any_size() -> None:
    t = rich()
    assert pqformat.supports(t.schema)
    data = frames_of(t, 250)
    decoder = pqformat.ChunkDecoder(t.schema)
    got = [x for i in range(0, len(data), 777) for x in decoder.feed(data[i : i + 777])]
    decoder.finish()
    same(pa.concat_tables(got), t)


def test_rows_are_gathered_into_frames_of_a_few_megabytes(monkeypatch: pytest.MonkeyPatch) -> None:
    t = rich(20_000)
    monkeypatch.setattr(pqformat, "CHUNK_RAW_BYTES", t.nbytes // 8)
    encoder = pqformat.ChunkEncoder(t.schema)
    frames = [f for b in t.to_batches(200) if (f := encoder.add(b))]
    last = encoder.finish()
    assert len(frames) in (7, 8) and last is not None
    decoder = pqformat.ChunkDecoder(t.schema)
    same(pa.concat_tables([x for f in [*frames, last] for x in decoder.feed(f)]), t)


def test_an_empty_partition_is_one_frame_with_the_schema() -> None:
    schema = rich(3).schema
    frame = pqformat.ChunkEncoder(schema).finish()
    assert frame is not None
    (table,) = pqformat.ChunkDecoder(schema).feed(frame)
    assert table.num_rows == 0 and table.schema.equals(schema)


def test_decoding_a_frame_does_not_import_pandas(tmp_path: Path) -> None:
    """A lane host decodes without pandas: pq.read_table imports it through
    pyarrow.dataset (0.3 CPU-s idle, seconds under load, on the first frame while
    the link waited)."""
    import subprocess
    import sys

    table = pa.table({"id": pa.array(range(1000)), "s": pa.array([f"{i:x}" for i in range(1000)])})
    frame = tmp_path / "frame"
    frame.write_bytes(pqformat.encode_chunk(table))
    child = (
        "import sys, pyarrow as pa\n"
        "from spark_dilation.transfer.rules.pqformat import ChunkDecoder\n"
        "schema = pa.schema([('id', pa.int64()), ('s', pa.string())])\n"
        f"(got,) = ChunkDecoder(schema).feed(open({str(frame)!r}, 'rb').read())\n"
        "assert got.num_rows == 1000, got.num_rows\n"
        "print('pandas' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_a_cut_frame_or_another_schema_is_refused() -> None:
    t = rich(100)
    data = frames_of(t, 100)
    decoder = pqformat.ChunkDecoder(t.schema)
    assert list(decoder.feed(data[:-10])) == []
    with pytest.raises(ValueError, match="ends inside a Parquet frame"):
        decoder.finish()
    other = pa.schema([("id", pa.int64())])
    with pytest.raises(ValueError, match="not id: int64"):
        list(pqformat.ChunkDecoder(other).feed(data))


@pytest.mark.parametrize(
    "column",
    [
        pa.array([datetime.time(1, 2)]),
        pa.array([datetime.timedelta(1)]),
        pa.array([None], pa.null()),
        pa.array(["a"]).dictionary_encode(),
        pa.array([[datetime.time(1)]]),
        pa.array([1.5], pa.float16()) if hasattr(pa, "float16") else pa.array([None], pa.null()),
    ],
)
def test_types_parquet_would_change_are_not_sent_as_parquet(column: pa.Array) -> None:
    assert not pqformat.supports(pa.schema([("ok", pa.int64()), ("c", column.type)]))


def test_the_format_is_much_smaller_than_zstd_ipc_on_the_benchmarks_data() -> None:
    rng = np.random.default_rng(3)
    rows = 200_000
    t = pa.table(
        {
            "id": np.arange(rows, dtype=np.int64),
            "x": rng.random(rows),
            "s": [f"{v:016x}" for v in rng.integers(0, 2**63, rows)],
        }
    )
    zstd = PartitionEncoder(t.schema, "zstd")
    ipc_bytes = sum(len(m) for b in t.to_batches(10_000) for m in zstd.encode(b))
    ipc_bytes += sum(len(m) for m in zstd.finish()[:-1])
    parquet = len(frames_of(t, 10_000))
    assert parquet < 0.85 * ipc_bytes, (parquet, ipc_bytes)


# --- the lane and the negotiation -----------------------------------------------------------


def spec_for(schema: pa.Schema, compression: str, formats: tuple[str, ...]) -> TransferSpec:
    from spark_dilation.transfer.rules.protocol import schema_bytes

    return TransferSpec(
        "ab" * 16, b"s" * 32, 1, schema_bytes(schema), compression, TransferOptions(),
        formats=formats,
    )  # fmt: skip


def test_the_lane_stages_parquet_partitions_as_arrow_ipc(tmp_path: Path) -> None:
    t = rich()
    stream = PartitionStream(spec_for(t.schema, "parquet", ("parquet",)), 0, 0)
    messages = list(stream.messages(t.to_batches(500)))
    tag, header = decode_message(messages[0])
    assert tag == TAG_HEADER and header["compression"] == "parquet"
    path = tmp_path / "part-0.arrow"
    staging = _ParquetStaging(open(path, "wb"), t.schema)
    for m in messages[1:-1]:
        assert m[:1] == TAG_DATA
        staging.write(m[1:])
    staging.check(0, stream.rows)
    staging.close()
    same(pa.Table.from_batches(list(read_staged(path)), schema=t.schema), t)
    with pytest.raises(ProtocolError, match="decoded to 3000 rows, the sender sent 3001"):
        staging.check(0, 3001)


def test_parquet_goes_only_to_receivers_that_list_it_and_schemas_it_keeps() -> None:
    t = rich(10)
    to_older = PartitionStream(spec_for(t.schema, "parquet", ()), 0, 0)
    assert decode_message(next(iter(to_older.messages([]))))[1]["compression"] == "zstd"
    odd = pa.schema([("t", pa.time64("us"))])
    assert not spec_for(odd, "parquet", ("parquet",)).parquet_ok
    assert spec_for(t.schema, "parquet", ("parquet",)).parquet_ok
    # Why not, for the report.
    assert "older version" in spec_for(t.schema, "parquet", ()).parquet_refused()
    refused = spec_for(odd, "parquet", ("parquet",)).parquet_refused()
    assert refused == "column t (time64[us]) would not round-trip exactly through Parquet"
    assert spec_for(t.schema, "parquet", ("parquet",)).parquet_refused() == ""
    # The answer's formats are optional both ways: an older receiver sends none.
    assert Accept.decode(json.loads(Accept(2, ("parquet",)).encode())["dataset-accept"]) == Accept(
        2, ("parquet",)
    )
    assert Accept.decode({"lanes": 2, "rendezvous": 2}) == Accept(2, ())
    assert Accept.decode({"lanes": 2, "rendezvous": 2, "formats": "parquet"}) == Accept(2, ())
    # The offer: older receivers see zstd, ours see parquet.
    body = json.loads(Offer("t", t.schema, "parquet").encode())["dataset-offer"]
    assert body["compression"] == "zstd" and Offer.decode(body).compression == "parquet"


def _transfer_exactly(t: pa.Table, mailbox_url: str, tmp: Path) -> Any:
    """Send ``t`` with compression=parquet to a receiver here; the sender's report."""
    opts = {"mailbox": mailbox_url, "relay": "none", "compression": "parquet"}
    sender, thread, box = send_in_background(t, staging_dir=str(tmp / "s"), **opts)
    got = receive_dataset(sender.code, lanes=2, staging_dir=str(tmp / "r"), **opts)
    thread.join(120)
    assert not thread.is_alive() and "error" not in box, box.get("error")
    assert got.table is not None
    same(got.table.sort_by("i32"), t)
    return box["report"]


def test_an_explicit_parquet_transfer_is_exact(mailbox_url: str, tmp_path: Path) -> None:
    t = rich(50_000)
    report = _transfer_exactly(t, mailbox_url, tmp_path / "rich")
    assert report.compression == "parquet" and report.bytes < t.nbytes
    assert report.compression_detail == ""

    # A column Parquet would change: the partitions go as zstd, and the report says so.
    odd = t.append_column("t", pa.array([i * 1000 for i in range(t.num_rows)], pa.time64("us")))
    report = _transfer_exactly(odd, mailbox_url, tmp_path / "odd")
    assert report.compression_detail.startswith("zstd for "), report
    assert "column t (time64[us]) would not round-trip" in report.compression_detail
    assert "; compression parquet: zstd for " in report.summary()
