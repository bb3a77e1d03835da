"""Reading a slow link in fewer, bigger pieces: the L2 connection's read nap.

A record that arrives a packet at a time costs a reactor wake-up per packet.
After a small read in the middle of a record, the selected connection stops
reading for a nap (``READ_NAP`` at first, then as long as the link takes to
bring two small reads' worth); the manager's back-pressure pause is kept
apart from it. Real L2 connections (Noise handshake done in process), a
``StringTransport`` and a ``Clock``: no sockets, no wall-clock timing.
"""

from __future__ import annotations

from typing import Any

import pytest
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport

from spark_dilation.dilation import connection as C
from spark_dilation.dilation.connector import (
    READ_NAP,
    READ_NAP_MAX,
    SMALL_READ,
    L2Protocol,
    next_nap,
)
from spark_dilation.dilation.framing import FRAME_HEADER_SIZE, Framer, encode_frame
from spark_dilation.dilation.records import Data

KEY = bytes(range(32))


def _writes(events: list[C.Event]) -> bytes:
    return b"".join(bytes(e.data) for e in events if isinstance(e, C.Write))


def connected_pair() -> tuple[C.L2Connection, C.L2Connection]:
    """A leader and a follower with the Noise handshake and the KCM exchanged."""
    a, b = C.L2Connection(KEY, leader=True), C.L2Connection(KEY, leader=False)
    to_b, to_a = _writes(a.connection_made()), _writes(b.connection_made())
    for _ in range(10):
        if not to_a and not to_b:
            break
        from_b = _writes(b.data_received(to_b)) if to_b else b""
        from_a = _writes(a.data_received(to_a)) if to_a else b""
        to_a, to_b = from_b, from_a
    assert a.ready and b.ready and a.kcm_received
    return a, b


class _TCP(StringTransport):
    def setTcpNoDelay(self, enabled: bool) -> None:
        pass


class _Connector:
    def __init__(self) -> None:
        self._reactor = Clock()
        self.lost: list[Any] = []

    def _lost(self, p: Any) -> None:
        self.lost.append(p)


class _Owner:
    """The manager's side of a selected connection: records and ACK flushes."""

    def __init__(self) -> None:
        self.records: list[Any] = []

    def _traffic(self, p: Any) -> None:
        pass

    def _record_received(self, p: Any, record: Any) -> None:
        self.records.append(record)

    def _flush_ack(self, p: Any) -> None:
        pass

    def _connection_lost(self, p: Any) -> None:
        pass


@pytest.fixture
def link() -> tuple[L2Protocol, C.L2Connection, _Connector, _Owner]:
    """Our follower side as a selected L2Protocol; the leader's connection writes to it."""
    leader, follower = connected_pair()
    connector = _Connector()
    p = L2Protocol(connector, follower, "test")  # type: ignore[arg-type]
    p.makeConnection(_TCP())
    owner = _Owner()
    p.attach(owner)
    return p, leader, connector, owner


def _reading(p: L2Protocol) -> bool:
    return p.transport.producerState == "producing"


def test_the_framer_knows_how_much_of_a_record_is_still_to_come() -> None:
    framer = Framer(b"ours", b"theirs")
    framer.data_received(b"theirs")
    frame = encode_frame(b"x" * 1000)
    assert framer.missing == 0
    framer.data_received(frame[:2])  # half of the length prefix
    assert framer.missing == FRAME_HEADER_SIZE - 2
    framer.data_received(frame[2:100])
    assert framer.missing == len(frame) - 100
    events = framer.data_received(frame[100:])
    assert len(events) == 1 and framer.missing == 0


def test_a_small_read_inside_a_big_record_naps_then_reads_again(link: Any) -> None:
    p, leader, connector, owner = link
    record = leader.encode(Data(1, 0, b"r" * 60_000))
    p.dataReceived(record[:1500])  # one packet of a 60 KB record
    assert not _reading(p)
    assert [c.getTime() for c in connector._reactor.getDelayedCalls()] == [READ_NAP]
    connector._reactor.advance(READ_NAP)
    assert _reading(p)
    p.dataReceived(record[1500:])  # the rest, in one big read: no nap
    assert _reading(p) and not connector._reactor.getDelayedCalls()
    assert [r.data for r in owner.records] == [b"r" * 60_000]


@pytest.mark.parametrize("why", ["read is big", "record complete", "little left", "not selected"])
def test_no_nap_when_it_cannot_help(link: Any, why: str) -> None:
    p, leader, connector, _ = link
    record = leader.encode(Data(1, 0, b"r" * 60_000))
    if why == "read is big":
        p.dataReceived(record[:SMALL_READ])
    elif why == "record complete":
        p.dataReceived(leader.encode(Data(1, 0, b"small")))
    elif why == "little left":
        p.dataReceived(record[: len(record) - SMALL_READ + 1])
    else:
        p.owner = None
        p.dataReceived(record[:1500])
    assert _reading(p) and not connector._reactor.getDelayedCalls()


def test_back_pressure_outlasts_a_nap_and_a_nap_outlasts_back_pressure(link: Any) -> None:
    p, leader, connector, _ = link
    record = leader.encode(Data(1, 0, b"r" * 60_000))
    p.dataReceived(record[:1500])
    p.set_flow_paused(True)  # a subchannel's reader is full
    connector._reactor.advance(READ_NAP)
    assert not _reading(p), "the nap's end resumed a connection the manager paused"
    p.set_flow_paused(False)
    assert _reading(p)
    p.dataReceived(record[1500:3000])
    p.set_flow_paused(True)
    p.set_flow_paused(False)
    assert not _reading(p), "back-pressure's end cut the nap short"
    connector._reactor.advance(READ_NAP_MAX)  # 1.5 KB after a nap: a slow link, a long nap
    assert _reading(p)


def test_a_connection_lost_while_napping_leaves_no_timer(link: Any) -> None:
    p, leader, connector, _ = link
    p.dataReceived(leader.encode(Data(1, 0, b"r" * 60_000))[:1500])
    assert connector._reactor.getDelayedCalls()
    p.connectionLost()
    assert not connector._reactor.getDelayedCalls()
    assert connector.lost == [p]


@pytest.mark.parametrize(
    ("nap", "read", "expected"),
    [
        (READ_NAP, 4 * 1024, 8 * READ_NAP),  # 4 KB in 5 ms: 32 KB take 40 ms
        (READ_NAP, 2 * SMALL_READ, READ_NAP),  # the link keeps up: the shortest nap
        (READ_NAP, 64 * 1024, READ_NAP),  # faster still: never below the shortest
        (READ_NAP_MAX, 100, READ_NAP_MAX),  # a trickle: a record's tail waits no longer
        (0.02, 16 * 1024, 0.04),
    ],
)
def test_the_next_nap_follows_the_rate_of_the_last(nap: float, read: int, expected: float) -> None:
    assert next_nap(nap, read) == pytest.approx(expected)


def test_a_slow_link_gets_longer_naps_and_a_faster_one_shorter_again(link: Any) -> None:
    p, leader, connector, owner = link
    clock = connector._reactor
    record = leader.encode(Data(1, 0, b"r" * 60_000))
    p.dataReceived(record[:1500])
    clock.advance(READ_NAP)
    p.dataReceived(record[1500:5596])  # 4 KB came during the 5 ms nap
    assert [c.getTime() - clock.seconds() for c in clock.getDelayedCalls()] == [
        pytest.approx(8 * READ_NAP)
    ]
    clock.advance(8 * READ_NAP)
    rest = record[5596:]
    p.dataReceived(rest)  # 54 KB during the 40 ms nap: the link sped up
    assert _reading(p) and owner.records
    p.dataReceived(leader.encode(Data(1, 1, b"s" * 60_000))[:1500])
    shorter = next_nap(8 * READ_NAP, len(rest))
    assert READ_NAP < shorter < 8 * READ_NAP
    assert [c.getTime() - clock.seconds() for c in clock.getDelayedCalls()] == [
        pytest.approx(shorter)
    ]
