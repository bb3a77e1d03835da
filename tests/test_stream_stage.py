"""The stream subchannel's frames, and the receiving side's stage on disk (no network)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from spark_dilation.transfer.receive.streamstage import StreamStage
from spark_dilation.transfer.rules import streamwire as wire
from spark_dilation.transfer.rules.errors import ProtocolError
from spark_dilation.transfer.rules.pairing import PairingError


@pytest.mark.parametrize("seed", range(20))
def test_frames_come_out_whole_however_the_bytes_are_cut(seed: int) -> None:
    rng = random.Random(seed)
    big = rng.randbytes(wire.CHUNK * 2 + 17)
    frames = [
        *wire.part("q", 3, 0, "0", big),
        *wire.part("q", 3, 1, "1", b""),
        wire.message(wire.MANIFEST, query="q", batch=3, attempts={"0": "0", "1": "1"}),
    ]
    stream = b"".join(frames)
    incoming, events, at = wire.Incoming(), [], 0
    while at < len(stream):
        step = rng.randint(1, 300_000)
        events += incoming.feed(stream[at : at + step])
        at += step
    chunks = [e for e in events if isinstance(e, wire.Chunk)]
    assert b"".join(c.data for c in chunks if c.header["partition"] == 0) == big
    assert [c.last for c in chunks] == [False, False, True, True]
    assert chunks[-1].data == b"" and chunks[-1].header["partition"] == 1
    assert isinstance(events[-1], wire.Message) and events[-1].t == wire.MANIFEST


def test_bytes_no_header_announced_are_refused() -> None:
    with pytest.raises(ProtocolError, match="no header announced"):
        wire.Incoming().feed(wire.part("q", 0, 0, "0", b"abc")[1])
    with pytest.raises(ProtocolError, match="a stream frame of"):
        wire.Incoming().feed(b"\xff\xff\xff\xff")
    header = wire.part("q", 0, 0, "0", b"abc")[0]
    with pytest.raises(ProtocolError, match="inside a partition"):
        wire.Incoming().feed(header + wire.message(wire.MANIFEST))


def _arrive(stage: StreamStage, key: tuple[int, int, str], data: bytes) -> None:
    f = stage.open_part(key)
    f.write(data)
    stage.close_part(key, f)


def test_a_stage_restarted_anywhere_keeps_exactly_what_its_ledger_says(tmp_path: Path) -> None:
    stage = StreamStage(tmp_path)
    _arrive(stage, (0, 0, "0"), b"a")
    _arrive(stage, (0, 0, "1"), b"loser")
    _arrive(stage, (0, 1, "0"), b"b")
    assert stage.manifest("q", 0, {0: "0", 1: "0"}, 2, 2).have
    assert sorted(p.name for p in (tmp_path / "batches").iterdir()) == [
        "0-0-0.arrow",
        "0-1-0.arrow",
    ]
    # Batch 1 arrives, but the run dies before any manifest: its ledger on disk never
    # said it was kept, so the restarted stage drops it (the sender sends it again).
    _arrive(stage, (1, 0, "0"), b"c")
    half = stage.open_part((1, 1, "0"))
    half.write(b"half")
    half.close()
    again = StreamStage(tmp_path)
    assert sorted(p.name for p in (tmp_path / "batches").iterdir()) == [
        "0-0-0.arrow",
        "0-1-0.arrow",
    ]
    assert again.latest == 1
    assert [(b, [p.read_bytes() for p in ps]) for b, ps in again.files(0, 1)] == [(0, [b"a", b"b"])]
    # A re-run of batch 0 (the sender restarted from its checkpoint) is dropped whole.
    assert not again.accepting(0)
    assert again.manifest("q", 0, {0: "7"}, 1, 1).seq == 0
    # Another sending query's batches are refused, with what to do.
    with pytest.raises(PairingError, match=r"reset or rolled back.*start a new stream"):
        again.manifest("other", 5, {}, 0, 0)
    again.commit(1)
    assert list((tmp_path / "batches").iterdir()) == []
    assert json.loads((tmp_path / "ledger.json").read_text())["freed_below"] == 1


def test_a_full_stage_refuses_the_batch_and_ends_the_receiving_run(tmp_path: Path) -> None:
    """ENOSPC while a partition arrives: the sender is told the cause (its commit fails
    with it) and the receiving query ends with it once it read what was staged."""
    import errno
    from types import SimpleNamespace

    from spark_dilation.transfer.receive.streamreceiver import StreamReceiver, _Conversation
    from spark_dilation.transfer.rules.pairing import Pair

    receiver = StreamReceiver(tmp_path / "pairing.json", tmp_path)

    def full(key: tuple[int, int, str]) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    receiver.stage.open_part = full  # type: ignore[method-assign]
    said: list[bytes] = []
    talk = _Conversation(receiver, Pair(1, 1))
    talk.transport = SimpleNamespace(write=said.append, loseConnection=lambda: None)
    talk.dataReceived(b"".join(wire.part("q", 0, 0, "0", b"rows")))
    refused = [e for e in wire.Incoming().feed(b"".join(said)) if isinstance(e, wire.Message)]
    assert [m.t for m in refused] == [wire.REFUSED]
    assert f"stage at {tmp_path} is full (no space left on device)" in refused[0].body["error"]
    with pytest.raises(PairingError, match=r"is full .* read every micro-batch staged before"):
        receiver.finished(0)
    assert not list((tmp_path / "batches").iterdir())  # nothing half-written stays
