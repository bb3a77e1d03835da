"""Runs of a stream meet again with no code: the real mailbox server and relay, real Dilation.

A first pairing over a human code gives both sides their records (from the
confirmed wormhole key). Then runs start from the records alone: each pair of
runs dilates and moves bytes over a subchannel; the receiving run is killed
(its connections dropped, nothing released) and restarted twice, the sending
one once, and every new pair moves bytes again. No assertion depends on how
fast anything happened; ``reactor_test`` only bounds a hang.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from reactor_helpers import reactor, reactor_test, sleep
from twisted.internet import defer, protocol

from spark_dilation.transfer.meet.record import load_record
from spark_dilation.transfer.meet.resume import StreamLink, pair_over_code
from spark_dilation.transfer.rules.pairing import RECEIVER, SENDER, Pair, PairingError

SCHEMA = "c2NoZW1hIGJ5dGVz"  # base64 of the sender's Arrow schema (opaque here)
SUBPROTOCOL = "spark-dilation-test/stream"


class Collect(protocol.Protocol):
    def __init__(self, got: defer.Deferred, size: int) -> None:
        self.got, self.size, self.data = got, size, b""

    def dataReceived(self, data: bytes) -> None:
        self.data += data
        if len(self.data) >= self.size and not self.got.called:
            self.got.callback(self.data)


class Run:
    """One run of one side: its StreamLink and the pairs it saw."""

    def __init__(self, path: Path, relay_url: str) -> None:
        self.pairs: list[Pair] = []
        self.paired: defer.Deferred = defer.Deferred()
        self.ended: defer.Deferred = defer.Deferred()
        self.link = StreamLink(
            path,
            reactor(),
            self._paired,
            self.ended.callback,
            relay_url=relay_url,
            no_listen=True,
        )

    def _paired(self, pair: Pair, dilated: Any) -> None:
        self.pairs.append(pair)
        d, self.paired = self.paired, defer.Deferred()
        d.callback(dilated)

    async def until_pair(self, pair: Pair) -> Any:
        while self.link.pair != pair or self.link.dilated is None:
            await self.paired
        return self.link.dilated

    def kill(self) -> None:
        """A run that dies: its connections drop, nothing is released or closed."""
        if self.link.dilated is not None:
            self.link.dilated.stop()
        self.link.client.stop()


async def exchange(sender: Run, receiver: Run, pair: Pair, payload: bytes) -> bytes:
    """The receiver listens, the sender connects and writes; what the receiver got."""
    rdw = await receiver.until_pair(pair)
    sdw = await sender.until_pair(pair)
    got: defer.Deferred = defer.Deferred()
    factory = protocol.Factory.forProtocol(lambda: Collect(got, len(payload)))
    await rdw.listener_for(SUBPROTOCOL).listen(factory)
    proto = await sdw.connector_for(SUBPROTOCOL).connect(
        protocol.Factory.forProtocol(protocol.Protocol)
    )
    proto.transport.write(payload)
    return await got


async def first_pairing(mailbox_url: str, folder: Path) -> tuple[Path, Path]:
    """The first run pairs over a code; each side keeps its record from the key."""
    paths = folder / "sender.pairing", folder / "receiver.pairing"
    code: defer.Deferred = defer.Deferred()
    sender = defer.ensureDeferred(
        pair_over_code(
            reactor(), SENDER, mailbox_url, paths[0], schema=SCHEMA, on_code=code.callback
        )
    )
    receiver = pair_over_code(reactor(), RECEIVER, mailbox_url, paths[1], code=await code)
    s, r = await defer.gatherResults([sender, defer.ensureDeferred(receiver)])
    assert s.secret == r.secret and s.side != r.side and r.schema == SCHEMA
    with pytest.raises(PairingError, match="already pairs this side of stream"):
        await pair_over_code(reactor(), SENDER, mailbox_url, paths[0])  # never overwritten
    return paths


@reactor_test(timeout=240)
async def test_runs_resume_with_no_code_after_kills_of_either_side(
    mailbox_url: str, relay_url: str, tmp_path: Path
) -> None:
    s_path, r_path = await first_pairing(mailbox_url, tmp_path)
    sender, receiver = Run(s_path, relay_url), Run(r_path, relay_url)
    assert await exchange(sender, receiver, Pair(1, 1), b"a" * 100_000) == b"a" * 100_000

    for n in (2, 3):  # the receiving run is killed and started again from its record
        receiver.kill()
        await sleep(0.5)
        receiver = Run(r_path, relay_url)
        data = bytes([n]) * 200_000
        assert await exchange(sender, receiver, Pair(1, n), data) == data

    sender.kill()  # and the sending one
    sender = Run(s_path, relay_url)
    assert await exchange(sender, receiver, Pair(2, 3), b"z" * 1000) == b"z" * 1000
    assert receiver.pairs == [Pair(1, 3), Pair(2, 3)]
    assert load_record(s_path).incarnation == 2 and load_record(r_path).incarnation == 3

    # Revoked by the sender: the receiver's live run ends, and its next run cannot resume.
    await sender.link.revoke("rotating keys")
    ended = await receiver.ended
    assert "the sender revoked this stream's pairing: rotating keys" in str(ended)
    with pytest.raises(PairingError, match=r"revoked \(rotating keys\)"):
        Run(s_path, relay_url)
    receiver.kill()


@reactor_test(timeout=120)
async def test_two_receivers_on_one_code_are_told_in_one_line(
    mailbox_url: str, tmp_path: Path
) -> None:
    code: defer.Deferred = defer.Deferred()
    first = defer.ensureDeferred(
        pair_over_code(reactor(), RECEIVER, mailbox_url, tmp_path / "a", on_code=code.callback)
    )
    second = defer.ensureDeferred(
        pair_over_code(reactor(), RECEIVER, mailbox_url, tmp_path / "b", code=await code)
    )
    for d in (first, second):
        with pytest.raises(PairingError) as e:
            await d
        assert "is another stream receiver: two receivers used one code" in str(e.value)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
