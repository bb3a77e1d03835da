"""Unit tests of the pure dataset-transfer layer: no sockets, no Spark."""

from __future__ import annotations

import itertools
import random

import pyarrow as pa
import pyarrow.ipc as ipc
import pytest

from spark_dilation.transfer.options import TransferOptionError, TransferOptions
from spark_dilation.transfer.protocol import (
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
    ProtocolError,
    Trailer,
    decode_message,
    decode_session_message,
    lane_of,
    peer_incarnation,
    peer_role,
    rendezvous_versions,
    same_incarnation,
    schema_fingerprint,
    slot_code,
    split_batch,
)
from spark_dilation.transfer.rendezvous import (
    ALONE,
    CROWDED,
    HALF_DEAD,
    PAIRED,
    SAME_INCARNATION,
    SAME_ROLE,
    SlotPolicy,
)
from spark_dilation.transfer.report import ConnectionStats, merge_stats
from spark_dilation.transfer.sender import PROBE_GAP_MAX, REPLACE_AFTER, ReplacementClock
from spark_dilation.wormhole.codes import validate_code

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


def test_slot_codes_are_valid_distinct_and_deterministic() -> None:
    codes = {slot_code(SECRET, lane, slot) for lane in range(4) for slot in range(50)}
    assert len(codes) == 200
    for code in codes:
        nameplate = validate_code(code)
        assert nameplate.isdigit() and len(nameplate) <= 40
    assert slot_code(SECRET, 1, 2) == slot_code(SECRET, 1, 2)
    assert slot_code(SECRET, 1, 2) != slot_code(bytes(32), 1, 2)
    with pytest.raises(ValueError):
        slot_code(SECRET, -1, 0)


def test_peer_role_checks_transfer_and_lane() -> None:
    v = rendezvous_versions("t1", "lane", 3)
    assert peer_role(v, "t1", 3) == "lane"
    assert peer_role(v, "t2", 3) is None
    assert peer_role(v, "t1", 2) is None
    assert peer_role({}, "t1", 3) is None
    assert (
        peer_role({"spark-dilation/dataset": {"transfer": "t1", "lane": 3, "role": "x"}}, "t1", 3)
        is None
    )


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


# --- rendezvous policy ----------------------------------------------------------------------


def test_sender_policy() -> None:
    p = SlotPolicy("sender", random.Random(1))
    assert p.first().slot == 0
    assert p.after(0, CROWDED).slot == 1
    step = p.after(1, ALONE)
    assert step.slot == 0 and step.delay > 0 and step.release
    step = p.after(0, SAME_ROLE)
    assert step.slot == 0 and step.release and step.delay > 0
    step = p.after(2, HALF_DEAD)
    assert step.slot == 3 and not step.release  # burn: keep the dead slot crowded
    assert p.after(3, PAIRED).action == "done"


def test_lane_policy_retries_crowded_then_moves_on() -> None:
    p = SlotPolicy("lane", random.Random(1))
    delays = []
    slot = 0
    for _ in range(3):
        step = p.after(slot, CROWDED)
        assert step.slot == 0
        delays.append(step.delay)
    assert delays == sorted(delays)
    assert p.after(0, CROWDED).slot == 1
    step = p.after(1, SAME_ROLE)
    assert step.slot == 2 and not step.release
    assert p.after(2, HALF_DEAD).slot == 3
    assert p.after(3, PAIRED).slot == 4
    with pytest.raises(ValueError):
        SlotPolicy("boss")


def test_sender_poll_backoff_is_capped() -> None:
    p = SlotPolicy("sender", random.Random(2))
    delays = [p.after(0, ALONE).delay for _ in range(50)]
    assert max(delays) <= 2.0 and delays[-1] > delays[0]


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


def test_a_probe_tells_the_same_lane_incarnation_from_a_replacement() -> None:
    lane = rendezvous_versions("t1", "lane", 0, incarnation="aaa")
    probe_same = rendezvous_versions("t1", "sender", 0, probe="aaa")
    probe_other = rendezvous_versions("t1", "sender", 0, probe="old")
    plain = rendezvous_versions("t1", "sender", 0)
    assert peer_incarnation(lane) == "aaa" and peer_incarnation(plain) == ""
    # Both sides decide the same from the two versions.
    assert same_incarnation(probe_same, lane) and same_incarnation(lane, probe_same)
    assert not same_incarnation(probe_other, lane) and not same_incarnation(lane, probe_other)
    assert not same_incarnation(plain, lane)  # an ordinary sender pairs
    assert not same_incarnation(probe_same, {})
    # The sender stops probing (the lane lives); the lane burns the slot and moves on.
    step = SlotPolicy("sender").after(4, SAME_INCARNATION)
    assert step.action == "alive" and not step.release
    step = SlotPolicy("lane").after(4, SAME_INCARNATION)
    assert step.action == "probe" and step.slot == 5 and not step.release


def test_replacement_probes_start_after_a_while_down_then_back_off() -> None:
    clock = ReplacementClock()
    key = ("t1", 0)
    assert not clock.observe(key, True, 100.0)  # just went down
    assert not clock.observe(key, True, 100.0 + REPLACE_AFTER - 0.1)
    due = [t for t in range(100, 400) if clock.observe(key, True, float(t))]
    gaps = [b - a for a, b in itertools.pairwise(due)]
    assert due[0] == 100 + REPLACE_AFTER and gaps == sorted(gaps) and max(gaps) <= PROBE_GAP_MAX + 1
    assert not clock.observe(key, False, 500.0)  # back up: forgotten
    assert not clock.observe(key, True, 501.0)
    assert clock.observe(key, True, 501.0 + REPLACE_AFTER)


def test_abort_either_way_names_its_side_and_reads_an_older_peer() -> None:
    from spark_dilation.transfer.protocol import TAG_ABORT, Abort

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
