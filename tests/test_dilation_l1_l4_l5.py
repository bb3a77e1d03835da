"""Unit tests of the pure Dilation layers: L1 mailbox records, the L4 queue, L5 subchannels.

The reference magic-wormhole 0.24 is imported only as an oracle: its
``Manager`` outputs build the L1 bytes and the scids, its ``Outbound`` the
replay order, and we check ours against them.
"""

from __future__ import annotations

import functools
import logging
import types
from collections import deque

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from wormhole._dilation import connection as ref_connection
from wormhole._dilation import manager as ref_manager
from wormhole._dilation.connector import Connector as RefConnector
from wormhole._dilation.outbound import Outbound as RefOutbound
from wormhole._dilation.roles import FOLLOWER as REF_FOLLOWER
from wormhole._dilation.roles import LEADER as REF_LEADER
from wormhole._interfaces import IDilationManager
from wormhole.util import dict_to_bytes
from zope.interface import implementer

from spark_dilation.dilation import l1
from spark_dilation.dilation.inbound import Inbound, SeqnumGapError
from spark_dilation.dilation.outbound import (
    ConnectionInUseError,
    Outbound,
    PauseWriters,
    ResumeWriters,
    SendClose,
    SendData,
    SendOpen,
    SeqnumExhaustedError,
    Transmit,
    record_size,
)
from spark_dilation.dilation.records import Ack, Close, Data, Open
from spark_dilation.dilation.subchannels import (
    Accepted,
    ConnectionLost,
    DataReceived,
    HalfCloseUsedOnNonHalfCloseable,
    InvalidSubprotocolError,
    ListenerExistsError,
    NormalCloseUsedOnHalfCloseable,
    ReadConnectionLost,
    Rejected,
    RoleUnknownError,
    SubchannelClosedError,
    SubchannelState,
    SubchannelTable,
    WriteConnectionLost,
    WriteTooLargeError,
)
from spark_dilation.errors import DilationError

Role = l1.Role


# --- the reference Manager, driven through fakes --------------------------------


def _ref_output(name: str):
    """The plain function behind an automat output of the reference Manager."""
    return ref_manager.Manager.__dict__[name].method


class _RefSend:
    def __init__(self) -> None:
        self.sent: list[tuple[str, bytes]] = []

    def send(self, phase: str, plaintext: bytes) -> None:
        self.sent.append((phase, plaintext))


def _ref_manager(my_side: str = "a" * 16, version: str | None = "ged"):
    fake = types.SimpleNamespace(
        _my_side=my_side,
        _dilation_version=version,
        _next_dilation_generation=0,
        _S=_RefSend(),
    )
    fake.send_dilation_generation = functools.partial(
        ref_manager.Manager.send_dilation_generation, fake
    )
    return fake


# --- L1 ---------------------------------------------------------------------------


def test_versions_message_matches_reference():
    ours = l1.dilation_versions_message()
    ours["app_versions"] = {"spark-dilation": {"v": 1}}
    theirs = {
        "can-dilate": ref_manager.DILATION_VERSIONS,
        "dilation-abilities": RefConnector.get_connection_abilities(),
    }
    theirs["app_versions"] = {"spark-dilation": {"v": 1}}
    assert dict_to_bytes(ours) == dict_to_bytes(theirs)
    assert l1.dilation_versions_message() == {
        "can-dilate": ["ged"],
        "dilation-abilities": [{"type": "direct-tcp-v1"}, {"type": "relay-v1"}],
    }
    assert list(l1.dilation_versions_message()) == ["can-dilate", "dilation-abilities"]
    assert l1.DILATION_VERSIONS == ref_manager.DILATION_VERSIONS


def test_versions_message_is_a_fresh_copy():
    first = l1.dilation_versions_message()
    first["can-dilate"].append("x")
    first["dilation-abilities"][0]["type"] = "x"
    assert l1.dilation_versions_message()["can-dilate"] == ["ged"]
    assert l1.dilation_versions_message()["dilation-abilities"][0] == {"type": "direct-tcp-v1"}


@pytest.mark.parametrize("version", ["ged", None])
def test_please_bytes_match_reference(version):
    side = l1.make_side()
    ref = _ref_manager(side, version)
    _ref_output("send_please")(ref)
    assert ref._S.sent == [("dilate-0", l1.please(side, version))]


def test_please_exact_bytes():
    assert l1.please("0123456789abcdef", "ged") == (
        b'{"type": "please", "side": "0123456789abcdef", "use-version": "ged"}'
    )
    assert l1.please("0123456789abcdef", None) == (
        b'{"type": "please", "side": "0123456789abcdef"}'
    )


def test_hints_reconnect_reconnecting_bytes_match_reference():
    hints = [
        {"type": "direct-tcp-v1", "priority": 0.0, "hostname": "127.0.0.1", "port": 40563},
        {
            "type": "relay-v1",
            "hints": [
                {"type": "direct-tcp-v1", "priority": 0.0, "hostname": "127.0.0.1", "port": 4001}
            ],
        },
    ]
    ref = _ref_manager()
    ref_manager.Manager.send_hints(ref, hints)
    _ref_output("send_reconnect")(ref)
    _ref_output("send_reconnecting")(ref)
    assert ref._S.sent == [
        ("dilate-0", l1.connection_hints(hints)),
        ("dilate-1", l1.reconnect()),
        ("dilate-2", l1.reconnecting()),
    ]
    assert l1.reconnect() == b'{"type": "reconnect"}'
    assert l1.reconnecting() == b'{"type": "reconnecting"}'


def test_parse_l1_round_trips():
    assert l1.parse_l1(l1.please("ab" * 8, "ged")) == l1.PleaseMsg("ab" * 8, "ged")
    assert l1.parse_l1(l1.please("ab" * 8, None)) == l1.PleaseMsg("ab" * 8, None)
    hint = {"type": "direct-tcp-v1", "priority": 0.0, "hostname": "h", "port": 1}
    assert l1.parse_l1(l1.connection_hints([hint])) == l1.HintsMsg((hint,))
    assert l1.parse_l1(l1.reconnect()) == l1.ReconnectMsg()
    assert l1.parse_l1(l1.reconnecting()) == l1.ReconnectingMsg()


def test_parse_l1_unknown_type_is_returned_not_raised():
    msg = l1.parse_l1(b'{"type": "future-thing", "x": 1}')
    assert msg == l1.UnknownMsg("future-thing", {"type": "future-thing", "x": 1})


def test_parse_l1_drops_hints_that_are_not_objects(caplog):
    with caplog.at_level(logging.WARNING):
        msg = l1.parse_l1(b'{"type": "connection-hints", "hints": [{"type": "a"}, 3, "x"]}')
    assert msg == l1.HintsMsg(({"type": "a"},))
    assert "2 connection hints" in caplog.text


@pytest.mark.parametrize(
    "body",
    [
        b"not json",
        b"\xff\xfe",
        b"[1, 2]",
        b'{"side": "x"}',
        b'{"type": 3}',
        b'{"type": "please"}',
        b'{"type": "please", "side": 5}',
        b'{"type": "connection-hints"}',
        b'{"type": "connection-hints", "hints": {}}',
    ],
)
def test_parse_l1_malformed_raises_typed_error(body):
    with pytest.raises(l1.MalformedL1Message) as e:
        l1.parse_l1(body)
    assert isinstance(e.value, DilationError)
    assert "malformed Dilation message" in str(e.value)


def test_make_side_format():
    sides = {l1.make_side() for _ in range(50)}
    assert len(sides) == 50
    for side in sides:
        assert len(side) == 16
        assert side == side.lower()
        int(side, 16)
    # Same shape as the reference's.
    assert len(ref_manager.make_side()) == 16


def _ref_role(my_side: str, their_side: str):
    fake = types.SimpleNamespace(_my_side=my_side)
    _ref_output("choose_role")(fake, {"side": their_side})
    return fake


@given(st.text(min_size=1, max_size=20), st.text(min_size=1, max_size=20))
def test_choose_role_matches_reference(mine, theirs):
    if mine == theirs:
        with pytest.raises(l1.SameSideError):
            l1.choose_role(mine, theirs)
        with pytest.raises(ValueError):
            _ref_role(mine, theirs)
        return
    ref = _ref_role(mine, theirs)
    ours = l1.choose_role(mine, theirs)
    assert ours is (Role.LEADER if ref._my_role is REF_LEADER else Role.FOLLOWER)
    assert l1.choose_role(theirs, mine) is not ours


def test_choose_role_is_plain_string_comparison():
    assert l1.choose_role("b", "a") is Role.LEADER
    assert l1.choose_role("a", "b") is Role.FOLLOWER
    # str comparison, not numeric: "9" > "10"
    assert l1.choose_role("9", "10") is Role.LEADER
    with pytest.raises(l1.SameSideError) as e:
        l1.choose_role("abc", "abc")
    assert isinstance(e.value, ValueError)
    assert "reflected" in str(e.value)


VERSIONS = st.lists(st.sampled_from(["ged", "ogion", "1", "2", "sparrowhawk"]), unique=True)


@given(VERSIONS, VERSIONS)
def test_choose_version_matches_reference(ours, theirs):
    assert l1.choose_version(ours, theirs) == ref_manager._find_shared_versions(ours, theirs)


def test_choose_version_prefers_our_order_and_ignores_junk():
    assert l1.choose_version(["b", "a"], ["a", "b"]) == "b"
    assert l1.choose_version(["ged"], ["1"]) is None
    assert l1.choose_version(["ged"], [1, None, {"x": 1}, "ged"]) == "ged"
    assert l1.choose_version(l1.DILATION_VERSIONS, []) is None


# --- L4 outbound -------------------------------------------------------------------


def transmitted(events) -> list:
    return [e.record for e in events if isinstance(e, Transmit)]


def test_seqnums_one_counter_for_all_kinds_and_subchannels():
    out = Outbound()
    r0, _ = out.queue(SendOpen(1, "proto"))
    r1, _ = out.queue(SendData(1, b"hello"))
    r2, _ = out.queue(SendOpen(3, "other"))
    r3, _ = out.queue(SendData(3, b""))
    r4, _ = out.queue(SendClose(1))
    assert [r0, r1, r2, r3, r4] == [
        Open(1, 0, "proto"),
        Data(1, 1, b"hello"),
        Open(3, 2, "other"),
        Data(3, 3, b""),
        Close(1, 4),
    ]
    assert out.next_seqnum == 5


def test_records_are_only_queued_without_a_connection():
    out = Outbound()
    record, events = out.queue(SendData(1, b"x"))
    assert events == []
    assert out.queued_records == 1
    assert out.use_connection() == [record]
    record2, events = out.queue(SendData(1, b"y"))
    assert events == [Transmit(record2)]


def test_seqnums_continue_across_connections_and_replay_comes_first():
    out = Outbound()
    assert out.use_connection() == []
    a, ev_a = out.queue(SendOpen(1, "p"))
    b, ev_b = out.queue(SendData(1, b"1"))
    assert transmitted(ev_a + ev_b) == [a, b]
    out.handle_ack(a.seqnum)
    out.connection_lost()
    c, ev_c = out.queue(SendData(1, b"2"))  # sent while disconnected: queued only
    assert ev_c == []
    # New connection: every un-ACKed record, in order, before anything new.
    assert out.use_connection() == [b, c]
    d, ev_d = out.queue(SendData(1, b"3"))
    assert transmitted(ev_d) == [d]
    assert [b.seqnum, c.seqnum, d.seqnum] == [1, 2, 3]
    out.connection_lost()
    out.connection_lost()  # idempotent
    assert out.use_connection() == [b, c, d]


def test_ack_is_cumulative_and_old_acks_are_harmless():
    out = Outbound()
    records = [out.queue(SendData(1, bytes(10)))[0] for _ in range(5)]
    assert out.queued_bytes == 5 * 19
    out.handle_ack(2)  # retires 0, 1 and 2 at once
    assert out.use_connection() == records[3:]
    assert (out.queued_bytes, out.acked_bytes) == (2 * 19, 3 * 19)
    out.handle_ack(1)  # an old (duplicate) ACK changes nothing
    assert out.queued_records == 2
    assert out.acked_bytes == 3 * 19
    out.handle_ack(4)
    assert out.queued_records == 0
    assert (out.queued_bytes, out.acked_bytes) == (0, 5 * 19)


def test_ack_for_a_seqnum_never_numbered_is_ignored(caplog):
    out = Outbound()
    out.queue(SendData(1, b"a"))
    with caplog.at_level(logging.WARNING):
        assert out.handle_ack(7) == []
    assert out.queued_records == 1
    assert "ACK for seqnum 7" in caplog.text


def test_use_connection_twice_is_an_error():
    out = Outbound()
    out.use_connection()
    with pytest.raises(ConnectionInUseError):
        out.use_connection()


def test_backpressure_marks_crossed_both_ways_with_exact_events():
    out = Outbound(high_water=100, low_water=50)
    r0, events = out.queue(SendData(1, bytes(41)))  # 50 bytes
    assert events == []
    r1, events = out.queue(SendData(1, bytes(41)))  # 100: at the mark, not above
    assert events == [] and not out.is_full and not out.writers_paused
    out.use_connection()
    r2, events = out.queue(SendClose(1))  # 109 > 100
    assert events == [Transmit(r2), PauseWriters(109)]
    assert out.is_full and out.writers_paused
    r3, events = out.queue(SendData(1, b"more"))  # already paused: no second event
    assert events == [Transmit(r3)]
    assert out.queued_bytes == 122
    assert out.handle_ack(r0.seqnum) == []  # 72 > 50: still paused
    assert out.writers_paused and not out.is_full
    assert out.handle_ack(r1.seqnum) == [ResumeWriters(22)]  # 22 <= 50
    assert not out.writers_paused
    assert out.handle_ack(r3.seqnum) == []  # no second resume
    # And again: the marks work on every cycle, connected or not.
    out.connection_lost()
    _, events = out.queue(SendData(1, bytes(200)))
    assert events == [PauseWriters(209)]


def test_backpressure_resume_exactly_at_low_water():
    out = Outbound(high_water=20, low_water=9)
    a, _ = out.queue(SendData(1, bytes(12)))  # 21
    assert out.writers_paused
    out.queue(SendClose(1))  # 30
    assert out.handle_ack(a.seqnum) == [ResumeWriters(9)]


def test_water_marks_are_validated():
    with pytest.raises(ValueError):
        Outbound(high_water=10, low_water=10)
    with pytest.raises(ValueError):
        Outbound(high_water=10, low_water=-1)
    default = Outbound()
    assert (default.high_water, default.low_water) == (8 * 1024 * 1024, 4 * 1024 * 1024)


def test_seqnum_never_wraps():
    out = Outbound(first_seqnum=2**32 - 2)
    a, _ = out.queue(SendData(1, b"a"))
    b, _ = out.queue(SendClose(1))
    assert (a.seqnum, b.seqnum) == (2**32 - 2, 2**32 - 1)
    with pytest.raises(SeqnumExhaustedError) as e:
        out.queue(SendData(1, b"c"))
    assert isinstance(e.value, DilationError)
    assert "2**32" in str(e.value)
    # The refused record left no trace.
    assert out.queued_records == 2
    assert out.next_seqnum == 2**32
    with pytest.raises(SeqnumExhaustedError):
        out.queue(SendClose(3))


def test_record_size_counts_header_and_payload():
    assert record_size(Data(1, 0, b"abc")) == 12
    assert record_size(Open(1, 0, "é")) == 11
    assert record_size(Close(1, 0)) == 9
    with pytest.raises(TypeError):
        record_size(Ack(1))  # type: ignore[arg-type]


# --- the reference Outbound, as an oracle for replay order ------------------------------


@implementer(IDilationManager)
class _RefManagerStub:
    pass


class _RefTransport:
    def registerProducer(self, producer, streaming):
        pass

    def unregisterProducer(self):
        pass


class _RefConnection:
    def __init__(self) -> None:
        self.transport = _RefTransport()
        self.sent: list = []

    def send_record(self, r) -> None:
        self.sent.append(r)


def _from_ref(r):
    if isinstance(r, ref_connection.Open):
        return Open(r.scid, r.seqnum, r.subprotocol)
    if isinstance(r, ref_connection.Data):
        return Data(r.scid, r.seqnum, r.data)
    return Close(r.scid, r.seqnum)


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("open"), st.integers(1, 5)),
        st.tuples(st.just("data"), st.binary(max_size=8)),
        st.tuples(st.just("close"), st.integers(1, 5)),
        st.tuples(st.just("ack"), st.integers(0, 40)),
        st.tuples(st.just("lost"), st.none()),
        st.tuples(st.just("connect"), st.none()),
    ),
    max_size=40,
)


@settings(max_examples=60, deadline=None)
@given(OPS)
def test_outbound_sends_what_the_reference_sends(ops):
    ref = RefOutbound(_RefManagerStub(), None)
    ours = Outbound()
    ref_wire: list = []
    our_wire: list = []
    ref_conn = None
    for op, arg in ops:
        if op in ("open", "data", "close"):
            if op == "open":
                ref_rec = ref.build_record(ref_connection.Open, arg, "p")
                msg = SendOpen(arg, "p")
            elif op == "data":
                ref_rec = ref.build_record(ref_connection.Data, 1, arg)
                msg = SendData(1, arg)
            else:
                ref_rec = ref.build_record(ref_connection.Close, arg)
                msg = SendClose(arg)
            ref.queue_and_send_record(ref_rec)
            _, events = ours.queue(msg)
            our_wire.extend(transmitted(events))
        elif op == "ack":
            # The reference retires anything <= ack; ours refuses ACKs for
            # seqnums never numbered, which a real peer cannot send.
            if arg < ours.next_seqnum:
                ref.handle_ack(arg)
                ours.handle_ack(arg)
        elif op == "lost" and ref_conn is not None:
            ref_wire.extend(ref_conn.sent)
            ref.stop_using_connection()
            ref_conn = None
            ours.connection_lost()
        elif op == "connect" and ref_conn is None:
            ref_conn = _RefConnection()
            ref.use_connection(ref_conn)
            our_wire.extend(ours.use_connection())
    if ref_conn is not None:
        ref_wire.extend(ref_conn.sent)
    assert [_from_ref(r) for r in ref_wire] == our_wire


# --- L4 inbound -------------------------------------------------------------------


def test_inbound_delivers_once_and_acks_every_record():
    inb = Inbound()
    assert inb.received(Open(1, 0, "p")) == (True, Ack(0))
    assert inb.received(Data(1, 1, b"a")) == (True, Ack(1))
    # Replay after a reconnection: old duplicates are ACKed, not delivered.
    assert inb.received(Open(1, 0, "p")) == (False, Ack(0))
    assert inb.received(Data(1, 1, b"a")) == (False, Ack(1))
    assert inb.received(Close(1, 2)) == (True, Ack(2))
    assert inb.received(Close(1, 2)) == (False, Ack(2))
    assert inb.highest_seqnum == 2


def test_inbound_refuses_a_gap():
    inb = Inbound()
    with pytest.raises(SeqnumGapError) as e:
        inb.received(Data(1, 1, b"skip"))
    assert (e.value.expected, e.value.got) == (0, 1)
    assert isinstance(e.value, DilationError)
    assert inb.received(Data(1, 0, b"x")) == (True, Ack(0))
    with pytest.raises(SeqnumGapError):
        inb.received(Data(1, 5, b"x"))
    with pytest.raises(TypeError):
        inb.received(Ack(0))  # type: ignore[arg-type]


# --- L4 end to end, any interleaving (hypothesis stateful) ------------------------------


class LossyL4(RuleBasedStateMachine):
    """An Outbound and a peer's Inbound joined by a connection that may drop at any time.

    A connection is two FIFOs (records one way, ACKs the other); losing it
    drops everything in flight. At the end we reconnect and drain: every
    queued record must have been delivered exactly once, in order.
    """

    HIGH, LOW = 120, 40

    def __init__(self) -> None:
        super().__init__()
        self.out = Outbound(high_water=self.HIGH, low_water=self.LOW)
        self.inb = Inbound()
        self.wire: deque = deque()
        self.acks: deque = deque()
        self.connected = False
        self.queued: list = []
        self.delivered: list = []
        self.acked = -1
        self.paused = False  # what a writer obeying the events believes

    def _events(self, events, *, from_queue: bool) -> None:
        for ev in events:
            if isinstance(ev, Transmit):
                assert from_queue and self.connected
                self.wire.append(ev.record)
            elif isinstance(ev, PauseWriters):
                assert from_queue and not self.paused
                assert ev.queued_bytes > self.HIGH
                self.paused = True
            else:
                assert isinstance(ev, ResumeWriters)
                assert not from_queue and self.paused
                assert ev.queued_bytes <= self.LOW
                self.paused = False

    @rule(kind=st.sampled_from(["open", "data", "close"]), size=st.integers(0, 50))
    def queue(self, kind, size):
        msg = {
            "open": SendOpen(1, "x" * size),
            "data": SendData(1, bytes(size)),
            "close": SendClose(1),
        }[kind]
        record, events = self.out.queue(msg)
        assert record.seqnum == len(self.queued)
        self.queued.append(record)
        assert (Transmit(record) in events) == self.connected
        self._events(events, from_queue=True)

    @precondition(lambda self: self.wire)
    @rule()
    def deliver(self):
        deliver, ack = self.inb.received(self.wire.popleft())
        if deliver:
            self.delivered.append(self.queued[ack.resp_seqnum])
        self.acks.append(ack)

    @precondition(lambda self: self.acks)
    @rule()
    def ack(self):
        ack = self.acks.popleft()
        self.acked = max(self.acked, ack.resp_seqnum)
        self._events(self.out.handle_ack(ack.resp_seqnum), from_queue=False)

    @precondition(lambda self: self.connected)
    @rule()
    def lose(self):
        self.wire.clear()
        self.acks.clear()
        self.out.connection_lost()
        self.connected = False

    @precondition(lambda self: not self.connected)
    @rule()
    def connect(self):
        self.wire.extend(self.out.use_connection())
        self.connected = True

    @invariant()
    def accounting(self):
        unacked = [r for r in self.queued if r.seqnum > self.acked]
        assert self.out.queued_bytes == sum(record_size(r) for r in unacked) >= 0
        assert self.out.queued_records == len(unacked)
        assert self.out.writers_paused == self.paused
        if self.out.queued_bytes > self.HIGH:
            assert self.paused
        if not self.paused:
            assert self.out.queued_bytes <= self.HIGH

    @invariant()
    def exactly_once_in_order_so_far(self):
        assert self.delivered == self.queued[: len(self.delivered)]

    def teardown(self):
        if not self.connected:
            self.connect()
        while self.wire or self.acks:
            if self.wire:
                self.deliver()
            else:
                self.ack()
        assert self.delivered == self.queued
        assert self.out.queued_records == 0
        assert self.out.queued_bytes == 0
        assert not self.out.writers_paused


TestLossyL4 = LossyL4.TestCase
TestLossyL4.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


# --- L5 subchannels -----------------------------------------------------------------


def _table(role: Role = Role.LEADER, **kwargs) -> SubchannelTable:
    t = SubchannelTable(**kwargs)
    t.set_role(role)
    return t


def _ref_scids(my_side: str, their_side: str, n: int) -> list[int]:
    fake = _ref_role(my_side, their_side)
    return [ref_manager.Manager.allocate_subchannel_id(fake) for _ in range(n)]


@pytest.mark.parametrize(
    ("role", "sides", "expected"),
    [
        (Role.LEADER, ("b" * 16, "a" * 16), [1, 3, 5, 7]),
        (Role.FOLLOWER, ("a" * 16, "b" * 16), [2, 4, 6, 8]),
    ],
)
def test_scid_parity_matches_reference(role, sides, expected):
    assert l1.choose_role(*sides) is role
    ref_role = _ref_role(*sides)._my_role
    assert ref_role is (REF_LEADER if role is Role.LEADER else REF_FOLLOWER)
    t = _table(role)
    scids = []
    for _ in range(4):
        op = t.open("p")
        scids.append(op.scid)
        # Closing never frees an id for reuse.
        t.lose_connection(op.scid)
        t.received(Close(op.scid, 0))
    assert scids == expected == _ref_scids(*sides, 4)
    t.set_role(role)  # a reconnection keeps the role and the counter
    assert t.open("p").scid == expected[-1] + 2


def test_open_needs_a_role_and_a_name():
    t = SubchannelTable()
    with pytest.raises(RoleUnknownError):
        t.open("p")
    t.set_role(Role.FOLLOWER)
    with pytest.raises(ValueError):
        t.set_role(Role.LEADER)
    with pytest.raises(InvalidSubprotocolError):
        t.open("")
    assert t.open("p") == SendOpen(2, "p")


def test_local_full_close_sequence():
    t = _table()
    scid = t.open("p").scid
    assert t.write(scid, b"hi") == SendData(scid, b"hi")
    assert t.lose_connection(scid) == [SendClose(scid)]
    assert t.state_of(scid) is SubchannelState.CLOSING
    with pytest.raises(SubchannelClosedError):
        t.write(scid, b"late")
    with pytest.raises(SubchannelClosedError):
        t.lose_connection(scid)
    # The peer's data still arrives while we wait for its CLOSE.
    assert t.received(Data(scid, 7, b"in flight")) == [DataReceived(scid, b"in flight")]
    assert t.received(Close(scid, 8)) == [ConnectionLost(scid)]
    assert t.state_of(scid) is None
    with pytest.raises(SubchannelClosedError) as e:
        t.write(scid, b"later")
    assert isinstance(e.value, DilationError)
    assert t.lose_connection(scid) == []  # closing a closed subchannel is harmless


def test_remote_full_close_sequence():
    t = _table(Role.FOLLOWER)
    t.register_listener("p")
    assert t.received(Open(1, 0, "p")) == [Accepted(1, "p")]
    assert t.received(Data(1, 1, b"x")) == [DataReceived(1, b"x")]
    assert t.write(1, b"reply") == SendData(1, b"reply")
    # CLOSE while open: answer with our CLOSE, then the subchannel is gone.
    assert t.received(Close(1, 2)) == [SendClose(1), ConnectionLost(1)]
    with pytest.raises(SubchannelClosedError):
        t.write(1, b"late")


def test_local_half_close_sequence():
    t = _table()
    scid = t.open("p", half_closeable=True).scid
    with pytest.raises(NormalCloseUsedOnHalfCloseable):
        t.lose_connection(scid)
    assert t.lose_write_connection(scid) == [SendClose(scid), WriteConnectionLost(scid)]
    assert t.state_of(scid) is SubchannelState.WRITE_CLOSED
    with pytest.raises(SubchannelClosedError):
        t.write(scid, b"x")
    with pytest.raises(SubchannelClosedError):
        t.lose_write_connection(scid)
    assert t.received(Data(scid, 3, b"more")) == [DataReceived(scid, b"more")]
    assert t.received(Close(scid, 4)) == [ReadConnectionLost(scid)]
    assert t.state_of(scid) is None


def test_remote_half_close_sequence():
    t = _table(Role.FOLLOWER)
    t.register_listener("p", half_closeable=True)
    assert t.received(Open(1, 0, "p")) == [Accepted(1, "p")]
    with pytest.raises(NormalCloseUsedOnHalfCloseable):
        t.lose_connection(1)
    # Their CLOSE ends only their writing: no CLOSE answered yet.
    assert t.received(Close(1, 1)) == [ReadConnectionLost(1)]
    assert t.state_of(1) is SubchannelState.READ_CLOSED
    assert t.write(1, b"still writing") == SendData(1, b"still writing")
    assert t.received(Data(1, 2, b"after close")) == []  # a peer bug: ignored
    assert t.lose_write_connection(1) == [SendClose(1), WriteConnectionLost(1)]
    assert t.state_of(1) is None
    with pytest.raises(SubchannelClosedError):
        t.write(1, b"x")


def test_half_close_on_full_protocol_is_an_error():
    t = _table()
    scid = t.open("p").scid
    with pytest.raises(HalfCloseUsedOnNonHalfCloseable):
        t.lose_write_connection(scid)


def test_unknown_subprotocol_is_closed_with_a_reason(caplog):
    t = _table(Role.FOLLOWER)
    with caplog.at_level(logging.WARNING):
        actions = t.received(Open(1, 0, "nobody-listens"))
    assert actions == [
        SendClose(1),
        Rejected(1, "nobody-listens", "no listener for subprotocol 'nobody-listens'"),
    ]
    assert "no listener for subprotocol 'nobody-listens'" in caplog.text
    caplog.clear()
    # Its DATA and the peer's answering CLOSE are expected: dropped quietly.
    with caplog.at_level(logging.WARNING):
        assert t.received(Data(1, 1, b"x")) == []
        assert t.received(Close(1, 2)) == []
    assert caplog.text == ""
    # A listener registered later does not resurrect it.
    assert t.register_listener("nobody-listens") == []
    assert t.status().subchannels == ()


def test_expected_subprotocol_is_held_until_the_listener_registers():
    t = _table(Role.FOLLOWER, expected_subprotocols=["late"])
    assert t.received(Open(1, 0, "late")) == []
    assert t.received(Data(1, 1, b"one")) == []
    assert t.received(Open(3, 2, "late")) == []
    assert t.received(Data(1, 3, b"two")) == []
    assert t.received(Data(3, 4, b"three")) == []
    assert t.received(Close(1, 5)) == []
    assert t.status().pending_bytes == 2 * (9 + 4) + (9 + 3) * 2 + (9 + 5)
    assert t.state_of(1) is SubchannelState.PENDING
    with pytest.raises(SubchannelClosedError):
        t.write(1, b"not yet")
    assert t.register_listener("late") == [
        Accepted(1, "late"),
        DataReceived(1, b"one"),
        DataReceived(1, b"two"),
        SendClose(1),
        ConnectionLost(1),
        Accepted(3, "late"),
        DataReceived(3, b"three"),
    ]
    assert t.status().pending_bytes == 0
    assert t.received(Data(3, 6, b"live")) == [DataReceived(3, b"live")]
    with pytest.raises(ListenerExistsError):
        t.register_listener("late")


def test_expected_half_closeable_replays_a_held_close_as_read_lost():
    t = _table(Role.FOLLOWER, expected_subprotocols=["late"])
    t.received(Open(1, 0, "late"))
    t.received(Close(1, 1))
    assert t.register_listener("late", half_closeable=True) == [
        Accepted(1, "late"),
        ReadConnectionLost(1),
    ]
    assert t.write(1, b"answer") == SendData(1, b"answer")


def test_expected_subprotocol_buffering_is_bounded(caplog):
    t = _table(Role.FOLLOWER, expected_subprotocols=["late"], max_pending_bytes=100)
    assert t.received(Open(1, 0, "late")) == []  # 13 bytes held
    assert t.received(Data(1, 1, bytes(50))) == []  # 72
    assert t.received(Open(3, 2, "late")) == []  # 85
    with caplog.at_level(logging.WARNING):
        actions = t.received(Data(1, 3, bytes(10)))  # 104 > 100: refuse scid 1
    assert actions[0] == SendClose(1)
    assert isinstance(actions[1], Rejected) and actions[1].scid == 1
    assert "more than 100 bytes" in actions[1].reason
    assert "more than 100 bytes" in caplog.text
    assert t.status().pending_bytes == 13  # only scid 3's OPEN is still held
    assert t.received(Data(1, 4, b"x")) == []  # dropped quietly
    assert t.received(Data(3, 5, bytes(70))) == []  # 92
    # An OPEN that does not fit is refused at once.
    actions = t.received(Open(5, 6, "late"))  # 105 > 100
    assert actions[0] == SendClose(5) and "more than 100 bytes" in actions[1].reason
    assert t.status().pending_bytes == 92
    assert t.register_listener("late") == [Accepted(3, "late"), DataReceived(3, bytes(70))]
    assert t.status().pending_bytes == 0


def test_duplicate_open_and_unknown_scids_are_logged_and_ignored(caplog):
    t = _table(Role.FOLLOWER)
    t.register_listener("p")
    assert t.received(Open(1, 0, "p")) == [Accepted(1, "p")]
    with caplog.at_level(logging.WARNING):
        assert t.received(Open(1, 1, "p")) == []
        assert t.received(Data(9, 2, b"x")) == []
        assert t.received(Close(11, 3)) == []
        assert t.received(Open(0, 4, "p")) == []
    assert "duplicate OPEN for subchannel 1" in caplog.text
    assert "DATA for unknown subchannel 9" in caplog.text
    assert "CLOSE for unknown subchannel 11" in caplog.text
    assert "reserved subchannel id 0" in caplog.text
    assert [s.scid for s in t.status().subchannels] == [1]


def test_peer_open_with_our_parity_is_refused_and_never_reused():
    t = _table(Role.LEADER)
    t.register_listener("p")
    actions = t.received(Open(5, 0, "p"))
    assert actions[0] == SendClose(5)
    assert "our range" in actions[1].reason
    assert t.open("p").scid == 7


def test_write_limits():
    t = _table()
    scid = t.open("p").scid

    class Huge:
        def __len__(self) -> int:
            return 2**32

    with pytest.raises(WriteTooLargeError):
        t.write(scid, Huge())  # type: ignore[arg-type]
    with pytest.raises(SubchannelClosedError):
        t.write(12345, b"never opened")


def test_status_lists_subchannels_and_listeners():
    t = _table(expected_subprotocols=["later"])
    t.register_listener("in")
    t.open("out")
    t.received(Open(2, 0, "in"))
    t.received(Open(4, 1, "later"))
    status = t.status()
    assert status.role is Role.LEADER
    assert status.listeners == ("in",)
    assert status.expected_subprotocols == ("later",)
    assert status.names == ("out", "in", "later")
    assert [(s.scid, s.state, s.opened_by_us) for s in status.subchannels] == [
        (1, SubchannelState.OPEN, True),
        (2, SubchannelState.OPEN, False),
        (4, SubchannelState.PENDING, False),
    ]


# --- two peers, all layers wired together -------------------------------------------


class Peer:
    """One side: L5 table over an L4 queue, joined to another Peer in memory."""

    def __init__(self, role: Role) -> None:
        self.table = _table(role)
        self.out = Outbound()
        self.inb = Inbound()
        self.events: list = []
        self.sent_closes: list[int] = []
        self.other: Peer | None = None

    def do(self, actions) -> None:
        for a in actions:
            if isinstance(a, SendOpen | SendData | SendClose):
                if isinstance(a, SendClose):
                    self.sent_closes.append(a.scid)
                _, events = self.out.queue(a)
                for ev in events:
                    if isinstance(ev, Transmit):
                        self.other.arrive(ev.record)
            else:
                self.events.append(a)

    def arrive(self, record) -> None:
        deliver, ack = self.inb.received(record)
        self.other.out.handle_ack(ack.resp_seqnum)
        if deliver:
            self.do(self.table.received(record))


def _pair() -> tuple[Peer, Peer]:
    leader, follower = Peer(Role.LEADER), Peer(Role.FOLLOWER)
    leader.other, follower.other = follower, leader
    leader.out.use_connection()
    follower.out.use_connection()
    return leader, follower


def test_two_peers_full_close_sends_one_close_each_way():
    leader, follower = _pair()
    follower.do(follower.table.register_listener("p"))
    op = leader.table.open("p")
    leader.do([op, leader.table.write(op.scid, b"hello")])
    assert follower.events == [Accepted(1, "p"), DataReceived(1, b"hello")]
    follower.do([follower.table.write(1, b"back")])
    leader.do(leader.table.lose_connection(1))
    assert leader.events == [DataReceived(1, b"back"), ConnectionLost(1)]
    assert follower.events[-1] == ConnectionLost(1)
    assert leader.sent_closes == [1] and follower.sent_closes == [1]
    assert leader.out.queued_records == follower.out.queued_records == 0


def test_two_peers_half_close_both_directions():
    leader, follower = _pair()
    follower.do(follower.table.register_listener("h", half_closeable=True))
    op = leader.table.open("h", half_closeable=True)
    leader.do([op])
    leader.do(leader.table.lose_write_connection(op.scid))
    assert follower.events == [Accepted(1, "h"), ReadConnectionLost(1)]
    follower.do([follower.table.write(1, b"the answer")])
    follower.do(follower.table.lose_write_connection(1))
    assert leader.events == [
        WriteConnectionLost(1),
        DataReceived(1, b"the answer"),
        ReadConnectionLost(1),
    ]
    assert leader.table.state_of(1) is None and follower.table.state_of(1) is None
    assert leader.sent_closes == [1] and follower.sent_closes == [1]
