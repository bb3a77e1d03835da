"""The composed L2 connection (sans-IO) against itself and the reference stack."""

from __future__ import annotations

import pytest
from test_dilation_l2 import KEY, SIDE, RefEnd, pump, to_ref
from wormhole._dilation import connection as ref_conn
from wormhole._dilation.connector import build_sided_relay_handshake

from spark_dilation.dilation import connection as C
from spark_dilation.dilation.framing import RELAY_OK, FramingError
from spark_dilation.dilation.noise import DecryptError, HandshakeError
from spark_dilation.dilation.records import KCM, Ack, Close, Data, Open, Ping, RecordError


class End:
    """Our L2Connection with a byte outbox; the Leader selects on the Follower's KCM."""

    def __init__(self, key: bytes, leader: bool, relay_side: str | None = None) -> None:
        self.conn = C.L2Connection(key, leader=leader, relay_side=relay_side)
        self.out = bytearray()
        self.events: list[C.Event] = []
        self._apply(self.conn.connection_made())

    def _apply(self, events: list[C.Event]) -> None:
        for e in events:
            if isinstance(e, C.Write):
                self.out += e.data
            else:
                self.events.append(e)
                if isinstance(e, C.PeerKCM) and self.conn.leader:
                    self.out += self.conn.select()

    def receive(self, data: bytes) -> None:
        self._apply(self.conn.data_received(data))

    def send(self, record) -> None:
        self.out += self.conn.encode(record)

    def take(self) -> bytes:
        data, self.out = bytes(self.out), bytearray()
        return data

    def of(self, kind: type) -> list:
        return [e for e in self.events if isinstance(e, kind)]

    def records(self) -> list:
        return [e.record for e in self.of(C.RecordReceived)]


@pytest.mark.parametrize("relay", [False, True], ids=["direct", "relay"])
def test_ours_to_ours_handshake_kcm_and_records(relay):
    leader = End(KEY, True, SIDE if relay else None)
    follower = End(KEY, False, "fedcba9876543210" if relay else None)
    if relay:
        assert leader.take().startswith(b"please relay ") and follower.take().endswith(b"\n")
        leader.receive(RELAY_OK)
        follower.receive(RELAY_OK)
    pump(leader, follower)
    for end in (leader, follower):
        assert end.conn.ready and end.conn.kcm_received and end.conn.kcm_sent
        assert len(end.of(C.HandshakeComplete)) == 1 and len(end.of(C.PeerKCM)) == 1
    sent = [Open(1, 0, "p"), Data(1, 1, b"x" * 200_000), Close(1, 2), Ack(7), Ping(b"abcd")]
    for r in sent:
        leader.send(r)
    pump(leader, follower)
    assert follower.records() == sent


@pytest.mark.parametrize("our_leader", [True, False], ids=["our-leader", "our-follower"])
@pytest.mark.parametrize("relay", [False, True], ids=["direct", "relay"])
def test_against_the_reference_stack(our_leader, relay):
    ours = End(KEY, our_leader, SIDE if relay else None)
    ref = RefEnd(KEY, not our_leader, build_sided_relay_handshake(KEY, SIDE) if relay else None)
    if relay:
        assert len(ours.take()) == 104 and len(ref.take()) == 104
        ours.receive(RELAY_OK)
        ref.receive(RELAY_OK)
    pump(ours, ref)
    assert len(ours.of(C.PeerKCM)) == 1
    assert [type(t).__name__ for t in ref.tokens] == ["Handshake", "KCM"]
    ref.tokens.clear()
    sent = [Open(3, 0, "spark-dilation/partition/v1"), Data(3, 1, b"y" * 70_000), Close(3, 2)]
    for r in sent:
        ours.send(r)
        ref.record.send_record(to_ref(r))
    pump(ours, ref)
    assert ours.records() == sent
    assert [type(t).__name__ for t in ref.tokens] == ["Open", "Data", "Close"]


def test_the_leader_sends_no_kcm_until_it_selects():
    leader, follower = End(KEY, True), End(KEY, False)
    leader._apply = lambda events, _orig=leader._apply: _orig(  # never select
        [e for e in events if not isinstance(e, C.PeerKCM)]
    )
    pump(leader, follower)
    assert follower.conn.kcm_sent and not follower.of(C.PeerKCM)
    assert not leader.conn.kcm_sent


def _failure(end: End) -> Exception:
    (failed,) = end.of(C.Failed)
    return failed.error


def test_a_peer_with_another_code_fails_the_handshake():
    leader, follower = End(KEY, True), End(bytes(32), False)
    pump(leader, follower)
    error = _failure(follower)
    assert isinstance(error, HandshakeError) and "different code" in str(error)
    assert not follower.conn.ready


def test_wrong_prologue_fails_at_once_and_stays_failed():
    leader = End(KEY, True)
    leader.receive(b"GET / HTTP/1.1\r\n\r\n")
    assert isinstance(_failure(leader), FramingError)
    assert leader.conn.data_received(b"more") == []


def test_garbage_frame_after_the_handshake_fails():
    leader, follower = End(KEY, True), End(KEY, False)
    pump(leader, follower)
    follower.receive(b"\x00\x00\x00\x20" + b"\x01" * 32)
    assert isinstance(_failure(follower), DecryptError)


def test_unknown_record_tag_fails():
    leader, follower = End(KEY, True), End(KEY, False)
    pump(leader, follower)
    transport = leader.conn._transport
    follower.receive(bytes(transport.encrypt_frame(b"\x09hello")))
    assert isinstance(_failure(follower), RecordError)


def test_good_records_before_a_bad_frame_are_delivered():
    leader, follower = End(KEY, True), End(KEY, False)
    pump(leader, follower)
    good = bytes(leader.conn.encode(Ack(1)))
    huge = (2**32 - 1).to_bytes(4, "big")
    follower.receive(good + huge)
    assert follower.records() == [Ack(1)]
    assert isinstance(_failure(follower), FramingError)


def test_a_second_kcm_is_ignored():
    leader, follower = End(KEY, True), End(KEY, False)
    pump(leader, follower)
    follower.receive(bytes(leader.conn.encode(KCM())))
    assert len(follower.of(C.PeerKCM)) == 1 and not follower.of(C.Failed)


def test_reference_kcm_then_records_reach_us_in_order():
    ours = End(KEY, False)
    ref = RefEnd(KEY, True)
    pump(ours, ref)
    ref.record.send_record(ref_conn.Ack(5))
    ref.record.send_record(ref_conn.Ping(b"\x00\x01\x02\x03"))
    pump(ours, ref)
    assert ours.records() == [Ack(5), Ping(b"\x00\x01\x02\x03")]
