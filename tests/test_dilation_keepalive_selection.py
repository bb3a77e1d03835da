"""Keepalive (dead-path detection) and L2 selection: pure objects, fake clock."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spark_dilation.dilation.keepalive import (
    AbortConnection,
    Keepalive,
    KeepaliveAction,
    KeepaliveError,
    SendRecord,
)
from spark_dilation.dilation.records import Ping, Pong
from spark_dilation.dilation.selection import (
    Drop,
    FollowerSelection,
    Select,
    Selection,
    SelectionError,
)
from spark_dilation.errors import DilationError

I = 1.0  # keepalive interval used throughout  # noqa: E741


def counter_ids() -> Callable[[int], bytes]:
    """Deterministic, distinct 4-byte ping ids."""
    n = itertools.count(1)
    return lambda size: next(n).to_bytes(size, "big")


class Driver:
    """A fake clock that fires the keepalive's timer on time, like task.Clock."""

    def __init__(self, ka: Keepalive, start: float = 100.0) -> None:
        self.ka = ka
        self.now = start
        self.log: list[tuple[float, KeepaliveAction]] = []

    def record(self, actions: list[KeepaliveAction]) -> list[KeepaliveAction]:
        self.log.extend((self.now, a) for a in actions)
        return actions

    def connect(self) -> list[KeepaliveAction]:
        return self.record(self.ka.connection_made(self.now))

    def advance_to(self, t: float) -> None:
        """Fire every deadline <= t in order, then leave the clock at t."""
        while (d := self.ka.next_deadline()) is not None and d <= t:
            self.now = max(self.now, d)
            self.record(self.ka.timer_fired(self.now))
            # Firing at a deadline must always move past it (no busy loop).
            after = self.ka.next_deadline()
            assert after is None or after > self.now, "timer_fired made no progress"
        self.now = t

    def advance(self, dt: float) -> None:
        self.advance_to(self.now + dt)

    def pings(self) -> list[tuple[float, bytes]]:
        return [(t, a.record.ping_id) for t, a in self.log if _is_ping(a)]

    def aborts(self) -> list[float]:
        return [t for t, a in self.log if isinstance(a, AbortConnection)]


def _is_ping(a: KeepaliveAction) -> bool:
    return isinstance(a, SendRecord) and isinstance(a.record, Ping)


def leader(**kw) -> Driver:
    return Driver(Keepalive(I, leader=True, random_id=counter_ids(), **kw))


def follower(**kw) -> Driver:
    return Driver(Keepalive(I, leader=False, random_id=counter_ids(), **kw))


# --- keepalive: leader -----------------------------------------------------------


def test_leader_pings_at_connect_and_every_interval() -> None:
    d = leader()
    first = d.connect()
    # The first PING is returned by connection_made itself, so the glue sends
    # it on the (already selected) connection: it is not lost as in 0.24.
    assert len(first) == 1 and _is_ping(first[0])
    for _ in range(5):
        d.advance(I * 0.5)
        d.ka.traffic_received(d.now)  # keep it alive
    times = [t for t, _ in d.pings()]
    assert times == [100.0, 101.0, 102.0]
    ids = [i for _, i in d.pings()]
    assert len(set(ids)) == len(ids) and all(len(i) == 4 for i in ids)
    assert d.aborts() == []


def test_default_ids_are_random_and_distinct() -> None:
    ka = Keepalive(I, leader=True)
    ids = [a.record.ping_id for a in ka.connection_made(0.0)]
    for k in range(1, 4):
        ka.traffic_received(k - 0.5)
        ids += [a.record.ping_id for a in ka.timer_fired(float(k))]
    assert len(ids) == 4 and len(set(ids)) == 4 and all(len(i) == 4 for i in ids)


def test_traffic_not_just_pong_keeps_it_alive() -> None:
    d = leader()
    d.connect()
    # The peer never PONGs (or its PONGs are stuck behind data) but ACKs flow.
    for _ in range(50):
        d.advance(1.5 * I)
        d.ka.traffic_received(d.now)
    assert d.aborts() == []
    assert len(d.pings()) == 76  # one per interval over 75 s, plus the first
    # Unanswered PINGs are pruned, so a peer that never PONGs cannot grow them.
    assert len(d.ka.outstanding_pings) <= 3


def test_pong_counts_and_reports_rtt() -> None:
    d = leader()
    (ping,) = d.connect()
    d.advance(0.25)
    assert d.ka.pong_received(ping.record.ping_id, d.now) == pytest.approx(0.25)
    assert d.ka.outstanding_pings == {}
    d.advance(2 * I + 0.2)  # 2 I after the PONG, not after connect
    assert d.aborts() == [pytest.approx(100.25 + 2 * I)]


def test_silent_peer_under_load_is_aborted_within_two_intervals() -> None:
    d = leader()
    d.connect()
    # Busy: ACKs and DATA arrive, then the path stalls silently while we go on
    # sending (sending is invisible to the keepalive, as it should be).
    for _ in range(10):
        d.advance(0.1)
        d.ka.traffic_received(d.now)
    last_rx = d.now
    d.advance(10 * I)
    (abort_at,) = d.aborts()
    assert abort_at == pytest.approx(last_rx + 2 * I)
    # A PING sent at least one interval before the abort was still unanswered.
    assert any(last_rx < t <= abort_at - I for t, _ in d.pings())
    # No more PINGs after the abort, and nothing left to time.
    assert max(t for t, _ in d.pings()) < abort_at
    assert d.ka.next_deadline() is None and d.ka.aborted
    reason = d.log[-1][1].reason
    assert "follower" in reason and "dead" in reason


def test_idle_silent_peer_is_aborted_two_intervals_after_connect() -> None:
    d = leader()
    d.connect()
    d.advance(5 * I)
    assert d.aborts() == [pytest.approx(100.0 + 2 * I)]
    assert [t for t, _ in d.pings()] == [100.0, 101.0]


def test_late_pong_or_traffic_after_abort_changes_nothing() -> None:
    d = leader()
    (ping,) = d.connect()
    d.advance(3 * I)
    assert len(d.aborts()) == 1
    assert d.ka.pong_received(ping.record.ping_id, d.now) is None
    d.ka.traffic_received(d.now)
    assert d.ka.ping_received(b"abcd", d.now) == []
    assert d.ka.timer_fired(d.now + 10) == []
    assert d.ka.next_deadline() is None and d.ka.aborted
    d.ka.connection_lost()
    assert not d.ka.connected and d.ka.next_deadline() is None


def test_unknown_pong_ignored_but_counts_as_traffic() -> None:
    d = leader()
    d.connect()
    d.advance(1.5 * I)
    before = d.ka.outstanding_pings
    assert d.ka.pong_received(b"\xff\xff\xff\xff", d.now) is None
    assert d.ka.outstanding_pings == before
    d.advance(1.9 * I)
    assert d.aborts() == []  # 1.9 I after the unknown PONG
    d.advance(0.2 * I)
    assert d.aborts() == [pytest.approx(101.5 + 2 * I)]


def test_late_timer_skips_missed_ping_slots() -> None:
    ka = Keepalive(I, leader=True, timeout=100.0, random_id=counter_ids())
    ka.connection_made(0.0)
    actions = ka.timer_fired(5.5)  # the reactor was blocked for 5 s
    assert len(actions) == 1 and _is_ping(actions[0])
    assert ka.next_deadline() == 6.0


def test_early_timer_call_is_harmless() -> None:
    ka = Keepalive(I, leader=True, random_id=counter_ids())
    ka.connection_made(0.0)
    assert ka.timer_fired(0.5) == []
    assert ka.next_deadline() == 1.0


def test_own_read_pause_suspends_dead_path_rule() -> None:
    d = leader()
    d.connect()
    d.ka.reading_paused(d.now)
    d.advance(10 * I)  # we are not reading: silence is ours
    assert d.aborts() == []
    assert len(d.pings()) == 11  # pinging goes on
    d.ka.reading_resumed(d.now)
    d.advance(2 * I)
    assert d.aborts() == [pytest.approx(110.0 + 2 * I)]


def test_connection_made_twice_is_a_glue_bug() -> None:
    ka = Keepalive(I, leader=True)
    ka.connection_made(0.0)
    with pytest.raises(KeepaliveError) as e:
        ka.connection_made(1.0)
    assert isinstance(e.value, DilationError)


def test_events_before_connection_made_are_ignored() -> None:
    ka = Keepalive(I, leader=True)
    assert ka.next_deadline() is None
    assert ka.ping_received(b"abcd", 0.0) == []
    assert ka.pong_received(b"abcd", 0.0) is None
    assert ka.timer_fired(100.0) == []


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan")])
def test_bad_interval_rejected(bad: float) -> None:
    with pytest.raises(ValueError):
        Keepalive(bad, leader=True)


# --- keepalive: follower ---------------------------------------------------------


def test_follower_answers_pings_with_same_id_and_never_pings() -> None:
    d = follower()
    assert d.connect() == []
    for k in range(5):
        d.advance(I)
        ping_id = bytes([k, 1, 2, 3])
        assert d.ka.ping_received(ping_id, d.now) == [SendRecord(Pong(ping_id))]
    assert d.pings() == [] and d.aborts() == []


def test_follower_aborts_when_leader_goes_silent() -> None:
    d = follower()
    d.connect()
    d.advance(I)
    d.ka.ping_received(b"\x00\x00\x00\x01", d.now)
    d.advance(5 * I)
    assert d.aborts() == [pytest.approx(101.0 + 2 * I)]
    assert "leader" in d.log[-1][1].reason
    assert d.pings() == []


def test_follower_timeout_can_be_lengthened_for_a_slower_leader() -> None:
    d = follower(timeout=4 * I)
    d.connect()
    for _ in range(5):
        d.advance(3 * I)  # a Leader pinging every 3 s
        d.ka.ping_received(b"ping", d.now)
    assert d.aborts() == []


# --- the precise rule, as a property ---------------------------------------------

# Integers make every time exact, so "gap >= 2 I" has no rounding slack.
events = st.lists(st.tuples(st.integers(min_value=0, max_value=12), st.booleans()), max_size=40)


@settings(max_examples=300, deadline=None)
@given(events=events, is_leader=st.booleans(), pong=st.booleans())
def test_abort_iff_inbound_gap_reaches_two_intervals(
    events: list[tuple[int, bool]], is_leader: bool, pong: bool
) -> None:
    """Rule: with timers fired on time, the connection is aborted iff some gap
    between consecutive inbound events (connection_made counts as one, the end
    of the run closes the last gap) is >= 2 * interval; the abort happens
    exactly at (inbound event starting the first such gap) + 2 * interval.
    Inbound traffic arriving at that very instant is too late.
    """
    interval = 4.0
    ka = Keepalive(interval, leader=is_leader, random_id=counter_ids())
    d = Driver(ka, start=0.0)
    d.connect()
    rx = [0.0]
    for dt, inbound in events:
        d.advance(float(dt))
        if inbound and not ka.aborted:
            rx.append(d.now)
            if pong and is_leader and ka.outstanding_pings:
                ka.pong_received(next(iter(ka.outstanding_pings)), d.now)
            else:
                ka.traffic_received(d.now)
    end = d.now
    d.advance_to(end)  # fire anything due at the very end

    marks = [*rx, end]
    gaps = [(a, b) for a, b in itertools.pairwise(marks) if b - a >= 2 * interval]
    if gaps:
        expected = gaps[0][0] + 2 * interval
        assert d.aborts() == [expected]
        assert ka.next_deadline() is None
    else:
        assert d.aborts() == []
        assert ka.connected

    pings = [t for t, _ in d.pings()]
    stop = d.aborts()[0] if d.aborts() else end + 1
    if is_leader:
        # One PING at connect and one per interval, none at or after the abort.
        assert pings == [k * interval for k in range(int(-(-stop // interval)))]
        if gaps:
            # The peer had a whole interval to answer a PING and did not.
            start = gaps[0][0]
            assert any(start < t <= stop - interval for t in pings)
    else:
        assert pings == []


# --- selection: leader -----------------------------------------------------------


def test_direct_selected_at_once() -> None:
    s = Selection()
    assert s.candidate("d1", "direct", 0.0) == [Select("d1")]
    assert s.selected == "d1" and s.done and s.next_deadline() is None


def test_relay_waits_the_window_then_is_selected() -> None:
    s = Selection(prefer_direct_window=0.5)
    assert s.candidate("r1", "relay", 10.0) == []
    assert s.next_deadline() == 10.5
    assert s.timer_fired(10.4) == []
    assert s.timer_fired(10.5) == [Select("r1")]
    assert s.selected == "r1" and s.next_deadline() is None
    assert s.timer_fired(11.0) == []


def test_direct_within_window_beats_earlier_relay() -> None:
    s = Selection(prefer_direct_window=0.5)
    assert s.candidate("r1", "relay", 10.0) == []
    assert s.candidate("d1", "direct", 10.3) == [Select("d1"), Drop("r1")]
    assert s.timer_fired(10.5) == []
    assert s.selected == "d1"


def test_losers_and_late_candidates_are_dropped_exactly_one_select() -> None:
    s = Selection(prefer_direct_window=0.5)
    out = s.candidate("r1", "relay", 0.0)
    out += s.candidate("r2", "relay", 0.1)
    out += s.timer_fired(0.5)
    out += s.candidate("d1", "direct", 0.6)  # too late
    out += s.candidate("r3", "relay", 0.7)
    out += s.timer_fired(5.0)
    assert out == [Select("r1"), Drop("r2"), Drop("d1"), Drop("r3")]
    assert sum(isinstance(a, Select) for a in out) == 1


def test_second_direct_is_dropped() -> None:
    s = Selection()
    assert s.candidate("d1", "direct", 0.0) == [Select("d1")]
    assert s.candidate("d2", "direct", 0.0) == [Drop("d2")]


def test_failed_relay_before_selection_is_forgotten() -> None:
    s = Selection(prefer_direct_window=0.5)
    s.candidate("r1", "relay", 0.0)
    assert s.connection_failed("r1") == []
    assert s.next_deadline() is None
    assert s.timer_fired(1.0) == []
    assert not s.done
    # A later relay gets its own full window.
    s.candidate("r2", "relay", 2.0)
    assert s.next_deadline() == 2.5
    assert s.timer_fired(2.5) == [Select("r2")]


def test_failure_of_earliest_relay_hands_over_to_the_next() -> None:
    s = Selection(prefer_direct_window=0.5)
    s.candidate("r1", "relay", 0.0)
    s.candidate("r2", "relay", 0.2)
    s.connection_failed("r1")
    assert s.next_deadline() == pytest.approx(0.7)
    assert s.timer_fired(0.5) == []
    assert s.timer_fired(0.7) == [Select("r2")]


def test_failure_of_unknown_or_selected_connection_is_ignored() -> None:
    s = Selection()
    assert s.connection_failed("never-seen") == []
    s.candidate("d1", "direct", 0.0)
    assert s.connection_failed("d1") == []
    assert s.selected == "d1"


def test_zero_window_selects_relay_at_once_like_the_reference() -> None:
    s = Selection(prefer_direct_window=0.0)
    assert s.candidate("r1", "relay", 0.0) == [Select("r1")]


def test_stop_drops_everything() -> None:
    s = Selection()
    s.candidate("r1", "relay", 0.0)
    assert s.stop() == [Drop("r1")]
    assert s.candidate("d1", "direct", 0.1) == [Drop("d1")]
    assert s.selected is None and s.timer_fired(9.0) == []


def test_selection_rejects_bad_input() -> None:
    s = Selection()
    with pytest.raises(SelectionError):
        s.candidate("x", "tor", 0.0)  # type: ignore[arg-type]
    s.candidate("r1", "relay", 0.0)
    with pytest.raises(SelectionError):
        s.candidate("r1", "relay", 0.1)
    with pytest.raises(ValueError):
        Selection(prefer_direct_window=-1.0)


# --- selection: follower ---------------------------------------------------------


def test_follower_selects_first_leader_kcm_and_drops_later() -> None:
    f = FollowerSelection()
    assert f.connection_ready("a") == []
    assert f.connection_ready("b") == []
    assert f.connection_ready("c") == []
    f.connection_failed("c")
    assert f.leader_kcm("b") == [Select("b"), Drop("a")]
    assert f.leader_kcm("a") == [Drop("a")]
    assert f.leader_kcm("b") == []  # an UnexpectedKCM on the winner: kept
    assert f.connection_ready("d") == [Drop("d")]
    assert f.selected == "b"


def test_follower_selection_without_tracking() -> None:
    f = FollowerSelection()
    assert f.leader_kcm(1) == [Select(1)]
    assert f.leader_kcm(2) == [Drop(2)]
