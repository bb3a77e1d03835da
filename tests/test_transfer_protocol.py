"""Unit tests of the pure dataset-transfer layer: no sockets, no Spark."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.ipc as ipc
import pytest

from spark_dilation.transfer.rules.errors import ProtocolError
from spark_dilation.transfer.rules.options import TransferOptionError, TransferOptions
from spark_dilation.transfer.rules.protocol import (
    TAG_DATA,
    TAG_TRAILER,
    Accept,
    CommittedPartition,
    LaneBook,
    Manifest,
    Offer,
    PartitionAssembler,
    PartitionEncoder,
    PartitionHeader,
    Trailer,
    decode_message,
    decode_session_message,
    ipc_rows,
    lane_of,
    schema_fingerprint,
    split_batch,
)
from spark_dilation.transfer.rules.report import ConnectionStats, merge_stats

SECRET = bytes(range(32))


def table(rows: int = 1000) -> pa.Table:
    return pa.table(
        {
            "id": pa.array(range(rows), pa.int64()),
            "x": pa.array([i * 0.5 for i in range(rows)]),
            "s": pa.array([f"s{i:014d}" for i in range(rows)]),
        }
    )


# --- derivations -------------------------------------------------------------------------


def test_lane_of() -> None:
    assert [lane_of(p, 3) for p in range(7)] == [0, 1, 2, 0, 1, 2, 0]


# --- session messages ----------------------------------------------------------------------


def test_offer_and_accept_round_trip() -> None:
    schema = table().schema
    kind, offer = decode_session_message(Offer("abc", schema, "zstd", "spark").encode())
    assert kind == "offer" and offer.transfer_id == "abc" and offer.schema.equals(schema)
    assert offer.compression == "zstd" and offer.source == "spark"
    kind, accept = decode_session_message(Accept(4).encode())
    assert kind == "accept" and accept.lanes == 4
    assert decode_session_message(b'{"error": "no"}') == ("error", "no")
    assert decode_session_message(b'{"offer": {}}')[0] == "other"


def test_private_doors_only_when_both_ends_say_so() -> None:
    """The offer says "doors": "secret-appid"; the answer agrees only to an offer that
    said it; a peer that says nothing (an older spark-dilation) keeps the public appid."""
    from spark_dilation.transfer.rules.directory import rendezvous_appid
    from spark_dilation.transfer.rules.protocol import DOORS_PRIVATE, RENDEZVOUS_APPID

    body = json.loads(Offer("abc", table().schema).encode())["dataset-offer"]
    assert body["doors"] == DOORS_PRIVATE
    assert decode_session_message(json.dumps({"dataset-offer": body}).encode())[1].private_doors
    del body["doors"]  # an older sender
    assert not decode_session_message(json.dumps({"dataset-offer": body}).encode())[1].private_doors
    agreed = json.loads(Accept(2, (), True).encode())["dataset-accept"]
    assert agreed["doors"] == DOORS_PRIVATE and Accept.decode(agreed).private_doors
    assert "doors" not in json.loads(Accept(2).encode())["dataset-accept"]
    assert not Accept.decode({"lanes": 2, "rendezvous": 2}).private_doors  # an older receiver
    # The appids: public without agreement; per secret with it, never the public one.
    assert rendezvous_appid(b"a" * 32, False) == rendezvous_appid(b"b" * 32, False)
    assert rendezvous_appid(b"a" * 32, False) == RENDEZVOUS_APPID
    mine, theirs = rendezvous_appid(b"a" * 32, True), rendezvous_appid(b"b" * 32, True)
    assert mine != theirs and mine.startswith(RENDEZVOUS_APPID + "/") and len(mine) > 40


def test_a_peer_whose_workers_probe_shared_slots_is_refused_in_one_line() -> None:
    """Rendezvous 1 (slots) and 2 (introduction) cannot meet: both sides say so."""
    offer = json.loads(Offer("abc", table().schema).encode())
    assert offer["dataset-offer"]["rendezvous"] == 2
    del offer["dataset-offer"]["rendezvous"]  # an older sender
    with pytest.raises(ProtocolError, match=r"the sender runs an older spark-dilation .* 1, we"):
        decode_session_message(json.dumps(offer).encode())
    with pytest.raises(ProtocolError, match=r"the receiver runs an older spark-dilation"):
        decode_session_message(b'{"dataset-accept": {"lanes": 2}}')


@pytest.mark.parametrize(
    "data",
    [
        b"not json",
        b"[1]",
        b'{"dataset-offer": {"version": 1}}',
        b'{"dataset-offer": {"version": 2, "transfer": "t", "schema": ""}}',
        b'{"dataset-accept": {"lanes": 0}}',
        b'{"dataset-accept": {}}',
    ],
)
def test_malformed_session_messages(data: bytes) -> None:
    with pytest.raises(ProtocolError):
        decode_session_message(data)


# --- partition streams ---------------------------------------------------------------------


@pytest.mark.parametrize("compression", ["none", "lz4", "zstd"])
def test_encoder_output_is_one_ipc_stream(compression: str) -> None:
    t = table(50_000)
    enc = PartitionEncoder(t.schema, compression, max_bytes=64 * 1024)
    messages = [m for b in t.to_batches(max_chunksize=20_000) for m in enc.encode(b)]
    *last, trailer_msg = enc.finish()
    messages += last
    assert all(m[:1] == TAG_DATA for m in messages)
    stream = b"".join(m[1:] for m in messages)
    got = ipc.open_stream(pa.py_buffer(stream)).read_all()
    assert got.equals(t)
    tag, body = decode_message(trailer_msg)
    trailer = Trailer.from_body(body)
    assert tag == TAG_TRAILER and trailer.rows == 50_000 and trailer.bytes == len(stream)
    # A lane checking the same bytes agrees.
    asm = PartitionAssembler(PartitionHeader("t", 0, 0, "f"))
    for m in messages:
        asm.data(m[1:])
    asm.finish(trailer)


def test_big_batches_are_split_to_about_the_message_size() -> None:
    t = table(200_000)
    batch = t.combine_chunks().to_batches()[0]
    pieces = list(split_batch(batch, 1024 * 1024))
    assert len(pieces) > 1
    assert sum(p.num_rows for p in pieces) == batch.num_rows
    enc = PartitionEncoder(t.schema)
    sizes = [len(m) for m in enc.encode(batch)]
    assert max(sizes[1:]) <= 1024 * 1024 + 64 * 1024  # batch metadata on top
    assert len(sizes) == len(pieces)


def test_a_small_slice_of_a_big_table_is_one_message() -> None:
    # A slice shares the table's buffers; its size is what it references
    # (before, every 10,000-row slice of a 45 MB table became ~40 messages).
    t = pa.table({"id": pa.array(range(1_000_000), pa.int64())})
    small = t.slice(5_000, 10_000).to_batches()[0]
    assert small.get_total_buffer_size() > 1024 * 1024
    assert len(list(split_batch(small, 1024 * 1024))) == 1
    enc = PartitionEncoder(t.schema)
    assert len(list(enc.encode(small))) == 1
    big = t.slice(0, 400_000).to_batches()[0]  # 3.2 MB referenced
    assert len(list(split_batch(big, 1024 * 1024))) == 4


def test_one_huge_row_is_still_one_message() -> None:
    t = pa.table({"b": pa.array([b"x" * (3 * 1024 * 1024)])})
    assert len(list(split_batch(t.to_batches()[0]))) == 1


def test_assembler_detects_damage_and_truncation() -> None:
    t = table(10_000)
    enc = PartitionEncoder(t.schema)
    messages = list(enc.encode(t.to_batches()[0])) + enc.finish()
    trailer = Trailer.from_body(decode_message(messages[-1])[1])
    data = [m[1:] for m in messages[:-1]]

    damaged = PartitionAssembler(PartitionHeader("t", 3, 1, "f"))
    for i, d in enumerate(data):
        damaged.data(d if i else d[:-1] + b"\x00")
    with pytest.raises(ProtocolError, match="partition 3 attempt 1 arrived damaged"):
        damaged.finish(trailer)

    truncated = PartitionAssembler(PartitionHeader("t", 3, 1, "f"))
    for d in data[:-1]:
        truncated.data(d)
    with pytest.raises(ProtocolError, match="damaged"):
        truncated.finish(trailer)

    limited = PartitionAssembler(PartitionHeader("t", 3, 1, "f"), max_bytes=10)
    with pytest.raises(ProtocolError, match="exceeds"):
        limited.data(b"x" * 11)


@pytest.mark.parametrize("message", [b"", b"Z{}", b"H[1]", b"Hnot json"])
def test_bad_subchannel_messages(message: bytes) -> None:
    with pytest.raises(ProtocolError):
        decode_message(message)


def test_schema_fingerprint_ignores_metadata_but_not_nullability() -> None:
    s = table().schema
    assert schema_fingerprint(s) == schema_fingerprint(s.with_metadata({b"k": b"v"}))
    nonnull = pa.schema([pa.field("id", pa.int64(), nullable=False), *list(s)[1:]])
    assert schema_fingerprint(s) != schema_fingerprint(nonnull)


# --- the lane's book -----------------------------------------------------------------------


def header(p: int, attempt: int = 0, schema: str = "F", transfer: str = "T") -> PartitionHeader:
    return PartitionHeader(transfer, p, attempt, schema)


def test_lane_book_rules() -> None:
    book = LaneBook("T", lane=1, lanes=3, schema="F")
    assert book.begin(header(1)).action == "receive"
    assert book.begin(header(2)).action == "refuse"  # lane 2's
    assert "different schema" in book.begin(header(4, schema="G")).reason
    assert book.begin(header(4, transfer="U")).action == "refuse"
    assert book.completed(1, 0, 10)
    # A retried or speculative attempt of a held partition is discarded, never kept twice.
    assert book.begin(header(1, attempt=1)).action == "discard"
    assert not book.completed(1, 1, 10)
    assert not book.done()
    book.got_manifest(
        Manifest(
            "T",
            (
                CommittedPartition(1, 1, 1, "i", 10, 100),
                CommittedPartition(4, 0, 1, "i", 5, 50),
                CommittedPartition(0, 0, 0, "i", 7, 70),
            ),
        )
    )
    assert [c.partition for c in book.missing()] == [4]
    assert book.completed(4, 0, 5)
    assert book.done()
    book.check_rows()
    assert book.committed_partitions() == [1, 4]
    book.aborted = "the sender aborted the transfer: boom"
    refused = book.begin(header(7))
    assert (
        refused.action == "refuse"
        and refused.ended
        and "aborted the transfer: boom" in refused.reason
    )


def test_lane_book_row_mismatch_and_duplicate_manifest() -> None:
    book = LaneBook("T", 0, 1, "F")
    book.completed(0, 0, 10)
    book.got_manifest(Manifest("T", (CommittedPartition(0, 1, 0, "i", 11, 1),)))
    with pytest.raises(ProtocolError, match="not deterministic"):
        book.check_rows()
    with pytest.raises(ProtocolError, match="twice"):
        book.got_manifest(Manifest("T", (CommittedPartition(0, 0, 0, "i", 1, 1),) * 2))
    with pytest.raises(ProtocolError, match="another transfer"):
        book.got_manifest(Manifest("U", ()))


def test_manifest_json_round_trip() -> None:
    m = Manifest("T", (CommittedPartition(0, 1, 0, "inc", 5, 6),))
    assert Manifest.from_json(m.to_json()) == m
    assert m.rows == 5
    with pytest.raises(ProtocolError):
        Manifest.from_body({"transfer": "T", "partitions": [{"partition": 1}]})


# --- options and report --------------------------------------------------------------------


def test_options_from_strings() -> None:
    o = TransferOptions.from_strings(
        {"lanes": "4", "compression": "ZSTD", "peer_timeout": "2.5", "no_listen": "true"}
    )
    assert (o.lanes, o.compression, o.peer_timeout, o.no_listen) == (4, "zstd", 2.5, True)
    assert TransferOptions.from_strings({"code": "1-a"}, ignore=("code",)).lanes == 2


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"lanes": "x"}, "lanes='x' must be a whole number"),
        ({"lanes": "0"}, "lanes=0 must be between 1 and 4096"),
        ({"compression": "gzip"}, "compression='gzip' is not one of auto, none, lz4, zstd"),
        ({"peer_timeout": "-1"}, "peer_timeout=-1.0 must be a positive number"),
        ({"lane_start_timeout": "soon"}, "lane_start_timeout='soon' must be a number"),
        ({"no_listen": "maybe"}, "no_listen='maybe' must be true or false"),
        ({"colour": "red"}, "unknown option 'colour'"),
    ],
)
def test_bad_options(options: dict[str, str], message: str) -> None:
    with pytest.raises(TransferOptionError, match=message.replace("(", r"\(")):
        TransferOptions.from_strings(options)


def test_merge_stats_keeps_the_latest_per_process() -> None:
    stats = [
        ConnectionStats("a:1", 1, 0, ("direct",)),
        ConnectionStats("a:1", 2, 1, ("direct", "relay")),
        ConnectionStats("b:2", 2, 0, ("direct",)),
    ]
    assert merge_stats(stats) == (4, 1, "direct+relay")
    # A process's last snapshot after its connections closed still has the path seen before.
    closed = [*stats[:1], ConnectionStats("a:1", 1, 0, ("unknown",))]
    assert merge_stats(closed) == (1, 0, "direct")


def test_abort_either_way_names_its_side_and_reads_an_older_peer() -> None:
    from spark_dilation.transfer.rules.protocol import TAG_ABORT, Abort

    cancel = Abort("Ctrl-C", cancelled=True)
    tag, body = decode_message(cancel.encode())
    assert tag == TAG_ABORT and Abort.from_body(body) == cancel
    assert cancel.text("receiver") == "the receiver cancelled the transfer (Ctrl-C)"
    assert cancel.text("sender") == "the sender cancelled the transfer (Ctrl-C)"
    failed = Abort("disk full on /data")
    assert failed.text("receiver") == "the receiver aborted the transfer: disk full on /data"
    # An older sender's abort: {"reason": ...} alone, or an empty reason.
    assert Abort.from_body({"reason": "job failed"}) == Abort("job failed", False)
    assert Abort.from_body({"reason": ""}).text("sender").endswith(": no reason given")


@pytest.mark.parametrize("compression", ["none", "lz4", "zstd"])
def test_ipc_rows_counts_each_message_without_decoding_it(compression: str) -> None:
    t = table(10_000)
    encoder = PartitionEncoder(t.schema, compression)
    counts = [ipc_rows(m[1:]) for b in t.to_batches(3_000) for m in encoder.encode(b)]
    *last, trailer = encoder.finish()
    counts += [ipc_rows(m[1:]) for m in last]
    assert counts == [3_000, 3_000, 3_000, 1_000, 0]  # the first also holds the schema
    assert decode_message(trailer)[1]["rows"] == sum(counts)
    with pytest.raises(ProtocolError, match="not an Arrow IPC message"):
        ipc_rows(b"\x00" * 16)
