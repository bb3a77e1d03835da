"""compression=auto: the pure rule, mixed codecs on the receiving side, real transfers.

The real transfers: a Python API sender and receiver over the relay only
(``no_listen``) through a rate-limited proxy must choose a compressing codec
and deliver the exact table; on a direct loopback path the choice is none.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from spark_dilation.testing import TcpProxy
from spark_dilation.transfer import receive_dataset, send_in_background
from spark_dilation.transfer.receive.staging import read_staged
from spark_dilation.transfer.rules import codec
from spark_dilation.transfer.rules.codec import Choice, CpuCost, Link, choose
from spark_dilation.transfer.rules.options import TransferOptionError, TransferOptions
from spark_dilation.transfer.rules.protocol import TAG_DATA, Offer, PartitionEncoder

COSTS = (
    CpuCost("lz4", None, 600.0, 0.9),
    CpuCost("zstd", 1, 300.0, 0.53),
    CpuCost("zstd", 3, 120.0, 0.5),
)


def table(rows: int, seed: int = 5) -> pa.Table:
    """id, rand() as x, a 16-hex-character string s: the benchmark's shape."""
    rng = np.random.default_rng(seed)
    hexes = [f"{v:016x}" for v in rng.integers(0, 2**63, rows)]
    return pa.table({"id": np.arange(rows, dtype=np.int64), "x": rng.random(rows), "s": hexes})


# --- the rule -----------------------------------------------------------------------------


def test_fast_or_direct_paths_choose_none() -> None:
    assert choose(COSTS, codec.prior_link("direct")).codec == "none"
    assert choose(COSTS, Link(5000.0, "relay", measured=True)).codec == "none"
    # A direct path measured at loopback speeds counts as fast (our own crypto bounds it).
    assert choose(COSTS, codec.observed_link("direct", 180.0)).codec == "none"
    assert choose((), Link(1.0, "relay")).codec == "none"  # nothing measured: nothing paid


def test_slow_links_choose_a_compressing_codec() -> None:
    slow = choose(COSTS, codec.prior_link("relay"))  # assumed 40 Mbit/s
    assert (slow.codec, slow.level) == ("zstd", 1), slow
    assert "relay (assumed)" in slow.why and "zstd(1) 300 MB/s ratio 0.53" in slow.why
    # Where the receiver takes Parquet, a relay's first partitions (nothing measured
    # yet) send the fewest bytes at this box's Parquet speed; a measured 100 Mbit/s
    # link takes zstd(1), which keeps up with it at a fraction of the CPU.
    with_parquet = (*COSTS, CpuCost("parquet", None, 20.0, 0.42))
    assert choose(with_parquet, codec.prior_link("relay")).codec == "parquet"
    assert choose(with_parquet, codec.observed_link("relay", 12.0)).label == "zstd(1)"
    measured = choose(COSTS, codec.observed_link("relay", 11.8))
    assert measured.label == "zstd(1)" and measured.why.startswith("link 11.8 MB/s relay,")
    # A slow direct link (a WAN) measured slow compresses too.
    assert choose(COSTS, codec.observed_link("direct", 10.0)).codec == "zstd"


def test_cpu_slower_than_the_link_chooses_none_or_lz4() -> None:
    slow_cpu = (CpuCost("lz4", None, 150.0, 0.9), CpuCost("zstd", 1, 40.0, 0.5))
    # 200 MB/s link: zstd's 40 MB/s would halve the rate, lz4 barely saves wire.
    assert choose(slow_cpu, Link(200.0, "relay", True)).codec == "none"
    # 100 MB/s: lz4 (150 MB/s, 0.9) wins 10% over none; zstd would be CPU-bound at 40.
    assert choose(slow_cpu, Link(100.0, "relay", True)).codec in ("none", "lz4")
    fast_lz4 = (CpuCost("lz4", None, 800.0, 0.6), CpuCost("zstd", 1, 40.0, 0.4))
    assert choose(fast_lz4, Link(100.0, "relay", True)).codec == "lz4"


def test_the_wire_meter_takes_the_link_rate_from_acks_while_backlogged() -> None:
    meter = codec.WireMeter(window=4.0)
    a, b = object(), object()  # two lanes' connections: one link
    backlog = {a: 8_000_000, b: 8_000_000}
    for i in range(9):  # every 0.5 s each connection gets 3 MB acknowledged
        meter.sample(i * 0.5, {a: 3_000_000 * i, b: 3_000_000 * i}, backlog)
    assert meter.estimate == (pytest.approx(12.0), True)  # both together: 6 MB per 0.5 s
    assert codec.observed_link("relay", *meter.estimate).text() == "link 12.0 MB/s relay"


def test_the_wire_meter_gives_a_lower_bound_when_the_senders_set_the_pace() -> None:
    meter = codec.WireMeter(window=4.0)
    conn = object()
    for i in range(9):
        meter.sample(i * 0.5, {conn: 8_000_000 * i}, {conn: 100_000})  # no backlog
    rate, exact = meter.estimate
    assert (rate, exact) == (pytest.approx(16.0), False)
    link = codec.observed_link("relay", rate, exact)
    assert link.text() == "link at least 16.0 MB/s relay"
    assert choose(COSTS, link).codec == "zstd"  # still slow enough to compress for
    # A lower bound under the assumption says nothing against it; on a direct
    # path, nothing against "fast".
    assert codec.observed_link("relay", 4.0, False) == codec.prior_link("relay")
    assert codec.observed_link("direct", 4.0, False) == codec.prior_link("direct")
    assert codec.observed_link("direct", 4.0, True).mb_per_s == 4.0  # measured slow


def test_the_wire_meter_survives_a_new_connection_and_needs_enough_to_go_on() -> None:
    meter = codec.WireMeter(window=4.0)
    old, new = object(), object()
    meter.sample(0.0, {old: 50_000_000}, {old: 0})
    meter.sample(1.0, {old: 50_000_010}, {old: 0})
    assert meter.estimate is None  # 10 bytes in 1 s: nothing to go on
    # The connection is replaced: its counter starts again at 0, no negative rate.
    for i in range(1, 6):
        meter.sample(1.0 + i, {new: 1_000_000 * i}, {new: 2_000_000})
    assert meter.estimate == (pytest.approx(1.0), True)


def test_description() -> None:
    choices = [Choice("zstd", 1, "link 11.8 MB/s relay")] * 7 + [Choice("none", None, "x")]
    assert codec.describe(choices) == (
        "zstd(1) for 7 of 8 partitions, none for 1 (link 11.8 MB/s relay)"
    )


def test_option_and_offer_stay_compatible() -> None:
    assert TransferOptions().compression == "auto"
    with pytest.raises(TransferOptionError, match="auto, none, lz4, zstd, parquet"):
        TransferOptions(compression="brotli")
    schema = pa.schema([("id", pa.int64())])
    import json

    body = json.loads(Offer("t", schema, "auto").encode())["dataset-offer"]
    # Older receivers check compression against none|lz4|zstd: they see zstd.
    assert body["compression"] == "zstd" and body["compression_auto"] is True
    assert Offer.decode(body).compression == "auto"
    del body["compression_auto"]  # an older sender's zstd offer
    assert Offer.decode(body).compression == "zstd"


def test_partitions_with_different_codecs_read_by_the_receiver(tmp_path: Path) -> None:
    """Arrow IPC says per message which codec its body used: no protocol change needed."""
    t = table(30_000)
    codecs: list[Any] = ["none", "lz4", pa.Codec("zstd", compression_level=1), "zstd"]
    sizes = []
    for i, compression in enumerate(codecs):
        part = t.slice(i * 7_500, 7_500)
        encoder = PartitionEncoder(t.schema, compression)
        data = [m for b in part.to_batches() for m in encoder.encode(b)]
        data.append(encoder.finish()[0])
        assert all(m[:1] == TAG_DATA for m in data)
        path = tmp_path / f"part-{i}.arrow"
        path.write_bytes(b"".join(m[1:] for m in data))  # what the lane stages
        sizes.append(path.stat().st_size)
        got = pa.Table.from_batches(list(read_staged(path)), schema=t.schema)
        assert got.equals(part)
    assert sizes[2] < 0.75 * sizes[0] and sizes[1] < sizes[0], sizes


# --- real transfers -------------------------------------------------------------------------


def join(thread: threading.Thread, box: dict[str, Any], timeout: float = 120) -> Any:
    thread.join(timeout)
    assert not thread.is_alive(), "the sender did not finish"
    if "error" in box:
        raise box["error"]
    return box["report"]


@pytest.fixture
def slow_relay(wormhole_servers: Any) -> Iterator[str]:
    with TcpProxy("127.0.0.1", wormhole_servers.relay_port) as proxy:
        proxy.limit_rate(4e6)  # 32 Mbit/s: a link slower than compressing
        yield f"tcp:127.0.0.1:{proxy.port}"


def test_auto_over_a_slow_relay_compresses_exactly(
    mailbox_url: str, slow_relay: str, tmp_path: Path
) -> None:
    t = table(200_000)  # about 6 MB raw
    opts = {"mailbox": mailbox_url, "relay": slow_relay, "no_listen": True}
    started = time.monotonic()
    sender, thread, box = send_in_background(t, staging_dir=str(tmp_path / "s"), **opts)
    got = receive_dataset(sender.code, lanes=2, staging_dir=str(tmp_path / "r"), **opts)
    received = time.monotonic() - started
    report = join(thread, box)
    sent = time.monotonic() - started
    print(f"sender ended after {sent:.1f} s, receiver after {received:.1f} s: {report.summary()}")
    assert got.table is not None and got.table.equals(t)
    assert report.path == "relay" and report.compression == "auto"
    # Our receiver decodes Parquet frames, the fewest bytes for this data.
    assert report.compression_detail.startswith("parquet for 2 of 2 partitions"), report
    assert "relay" in report.compression_detail
    assert "compression auto: " in report.summary()
    assert report.bytes < 0.6 * t.nbytes, (report.bytes, t.nbytes)
    assert got.report.compression == "auto"  # the offer said so


def test_auto_to_a_receiver_without_parquet_uses_arrow_ipc(
    mailbox_url: str, slow_relay: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A receiver whose answer lists no formats (an older one) gets zstd Arrow IPC."""
    from spark_dilation.transfer.meet import session

    monkeypatch.setattr(session, "RECEIVER_FORMATS", ())
    t = table(100_000)
    opts = {"mailbox": mailbox_url, "relay": slow_relay, "no_listen": True}
    sender, thread, box = send_in_background(t, staging_dir=str(tmp_path / "s"), **opts)
    got = receive_dataset(sender.code, lanes=1, staging_dir=str(tmp_path / "r"), **opts)
    report = join(thread, box)
    assert got.table is not None and got.table.equals(t)
    assert report.compression_detail.split()[0] in ("zstd(1)", "zstd(3)"), report


def test_auto_on_a_direct_loopback_path_is_none(mailbox_url: str, tmp_path: Path) -> None:
    t = table(100_000)
    opts = {"mailbox": mailbox_url, "relay": "none", "staging_dir": str(tmp_path / "s")}
    started = time.monotonic()
    sender, thread, box = send_in_background(t, **opts)
    got = receive_dataset(sender.code, lanes=2, **opts)
    report = join(thread, box)
    print(f"ended after {time.monotonic() - started:.1f} s: {report.summary()}")
    assert got.table is not None and got.table.equals(t)
    assert report.path == "direct"
    assert report.compression_detail.startswith("none for "), report.compression_detail
    assert "direct" in report.compression_detail
    assert report.bytes >= t.nbytes * 0.9  # sent as is
