"""The redial policy, the Leader's retry in the L1 machine, and the give-up text.

Pure: no sockets, no reactor, no clock (``now`` is passed in).
"""

from __future__ import annotations

import json

import pytest

import spark_dilation.dilation.l1 as l1
import spark_dilation.dilation.l1machine as M
from spark_dilation.dilation.redial import GiveUp, RedialPolicy, Retry, give_up_message
from spark_dilation.dilation.selection import Select, Selection


def policy(never_up: bool = False, **kw) -> RedialPolicy:
    """A policy whose connection was up once (a lost connection), unless ``never_up``."""
    kw.setdefault("random", lambda: 0.0)  # no jitter unless a test asks
    p = RedialPolicy(**kw)
    if not never_up:
        p.connected(0.0)
    return p


def test_up_policy_has_no_deadline_and_ignores_timers() -> None:
    p = policy()
    assert p.state == "UP"
    assert p.next_deadline() is None
    assert p.timer_fired(1e9) == []


def test_failed_attempts_retry_after_doubling_capped_backoff() -> None:
    p = policy(give_up_after=1000, first_delay=0.5, max_delay=4.0)
    p.disconnected(100.0)
    p.attempting(100.0)
    retries: list[tuple[float, int]] = []
    now = 100.0
    for _ in range(6):
        p.attempts_failed(now)  # every attempt of the generation failed at once
        due = p.next_deadline()
        assert due is not None
        assert p.timer_fired(due - 0.001) == []  # not early
        (action,) = p.timer_fired(due)
        assert isinstance(action, Retry)
        retries.append((due - now, action.attempt))
        now = due
    assert retries == [(0.5, 1), (1.0, 2), (2.0, 3), (4.0, 4), (4.0, 5), (4.0, 6)]
    assert p.retries == 6
    assert p.down_since == 100.0


def test_jitter_takes_up_to_half_off() -> None:
    assert policy(first_delay=1.0, max_delay=8.0, random=lambda: 0.999999).delay(2) == (
        pytest.approx(2.0, abs=1e-5)
    )
    assert policy(first_delay=1.0, max_delay=8.0, random=lambda: 0.5).delay(2) == 3.0
    assert policy(first_delay=1.0, max_delay=8.0, random=lambda: 0.0).delay(10) == 8.0


def test_attempts_that_hang_are_bounded_by_the_attempt_timeout() -> None:
    p = policy(give_up_after=1000, attempt_timeout=30.0)
    p.disconnected(0.0)
    p.attempting(0.0)
    assert p.next_deadline() == 30.0
    assert p.timer_fired(29.9) == []
    assert p.timer_fired(30.0) == [Retry(1)]
    assert p.state == "TRYING"  # the retry's own attempts are bounded the same way
    assert p.next_deadline() == 60.0


def test_a_new_attempt_during_backoff_cancels_the_retry() -> None:
    p = policy(give_up_after=1000)
    p.disconnected(0.0)
    p.attempting(0.0)
    p.attempts_failed(1.0)
    assert p.state == "BACKOFF"
    p.attempting(1.1)  # e.g. the peer's late hints were dialed
    assert p.state == "TRYING"
    assert p.next_deadline() == pytest.approx(1.1 + p.attempt_timeout)


def test_waiting_for_the_peer_only_runs_the_give_up_deadline() -> None:
    p = policy(give_up_after=60.0)
    p.disconnected(10.0)
    assert p.state == "WAITING"
    assert p.next_deadline() == 70.0
    assert p.timer_fired(69.0) == []
    assert p.timer_fired(70.0) == [GiveUp(down_since=10.0, retries=0)]
    assert p.state == "GAVE_UP"
    # Final: nothing revives it, nothing fires again.
    assert p.connected(71.0) == []
    assert p.state == "GAVE_UP"
    assert p.next_deadline() is None
    assert p.timer_fired(1e9) == []


def test_give_up_wins_over_a_due_retry_and_counts_retries() -> None:
    p = policy(give_up_after=3.0, first_delay=1.0, max_delay=1.0)
    p.disconnected(0.0)
    p.attempting(0.0)
    p.attempts_failed(0.0)
    assert p.timer_fired(1.0) == [Retry(1)]
    p.attempts_failed(1.0)
    assert p.timer_fired(2.0) == [Retry(2)]
    p.attempts_failed(2.0)
    assert p.next_deadline() == 3.0  # the retry and the give-up coincide
    assert p.timer_fired(3.0) == [GiveUp(down_since=0.0, retries=2)]


def test_connected_resets_the_clock_and_the_count() -> None:
    p = policy(give_up_after=10.0)
    p.disconnected(0.0)
    p.attempting(0.0)
    p.attempts_failed(0.0)
    p.timer_fired(5.0)
    p.connected(6.0)
    assert (p.state, p.down_since, p.retries, p.next_deadline()) == ("UP", None, 0, None)
    p.disconnected(100.0)
    assert (p.retries, p.next_deadline()) == (0, 110.0)


@pytest.mark.parametrize(
    "kw",
    [
        {"give_up_after": 0},
        {"first_delay": 0},
        {"first_delay": 5, "max_delay": 1},
        {"attempt_timeout": -1},
    ],
)
def test_bad_parameters_are_refused(kw) -> None:
    with pytest.raises(ValueError):
        RedialPolicy(**kw)


# --- the L1 machine's part -------------------------------------------------------


def connected_pair_machine(leader: bool) -> M.L1Machine:
    me, peer = ("f" * 16, "0" * 16) if leader else ("0" * 16, "f" * 16)
    m = M.L1Machine(side=me)
    m.dilate()
    m.got_versions(["1"])
    m.received(l1.please(peer, "1"))
    assert m.state == "CONNECTING"
    return m


def test_leader_retry_starts_a_new_generation_through_flushing() -> None:
    m = connected_pair_machine(leader=True)
    actions = m.retry()
    assert actions == [M.StopConnecting(), M.SendL1(l1.reconnect())]
    assert m.state == "FLUSHING"
    assert m.retry() == []  # waiting for the Follower's answer: nothing more to do
    assert m.received(l1.reconnecting()) == [M.StartConnecting(1, l1.Role.LEADER)]


def test_follower_retry_is_the_managers_redial_not_an_l1_message() -> None:
    m = connected_pair_machine(leader=False)
    assert m.retry() == []
    assert m.state == "CONNECTING"
    # ...and a Leader's retry reaches it as a reconnect while CONNECTING.
    assert m.received(l1.reconnect()) == [
        M.StopConnecting(),
        M.SendL1(l1.reconnecting()),
        M.StartConnecting(1, l1.Role.FOLLOWER),
    ]


def test_give_up_is_final_and_stop_still_works() -> None:
    m = connected_pair_machine(leader=True)
    assert m.give_up() == [M.StopConnecting()]
    assert m.state == "FAILED"
    assert m.received(l1.reconnecting()) == []
    assert m.received(l1.connection_hints([])) == []
    assert m.connection_lost() == []
    assert m.retry() == []
    assert m.give_up() == []
    assert m.stop() == [M.Stopped()]


def test_retry_messages_are_the_reference_wire_format() -> None:
    # The Leader's retry sends exactly the reference's reconnect message.
    m = connected_pair_machine(leader=True)
    (_, send) = m.retry()
    assert json.loads(send.plaintext) == {"type": "reconnect"}


# --- selection: no waiting for a direct path that cannot come --------------------


def test_relay_candidate_is_selected_at_once_without_direct_paths() -> None:
    s = Selection(prefer_direct_window=0.5)
    assert s.candidate("r1", "relay", 0.0, direct_possible=False) == [Select("r1")]


def test_relay_candidate_waits_when_a_direct_path_may_come() -> None:
    s = Selection(prefer_direct_window=0.5)
    assert s.candidate("r1", "relay", 0.0, direct_possible=True) == []
    assert s.next_deadline() == 0.5


# --- the give-up message --------------------------------------------------------


def test_give_up_message_says_what_was_tried_and_what_to_check() -> None:
    text = give_up_message(
        give_up_after=120,
        down_for=120.4,
        retries=17,
        generations=9,
        tried={
            "relay tcp:relay.example:4001": (17, "Connection was refused by other side: 111"),
            "direct tcp:10.0.0.2:4312": (3, "timeout"),
        },
        relays=["tcp:relay.example:4001"],
        mailbox_connected=False,
        first_connection=False,
    )
    assert text.startswith(
        "Dilation lost the connection to the other side and could not re-establish it "
        "within 120 s (reconnect_timeout)."
    )
    assert "20 failed connection attempts" in text
    assert "relay tcp:relay.example:4001 x17 (last: Connection was refused" in text
    assert "direct tcp:10.0.0.2:4312 x3 (last: timeout)" in text
    assert "17 retries and 9 new generations in 120 s" in text
    assert "mailbox server is unreachable right now" in text
    assert "Check that the transit relay (tcp:relay.example:4001)" in text
    assert text.endswith("raise reconnect_timeout to wait longer.")


def test_give_up_message_when_the_peer_never_came_back() -> None:
    text = give_up_message(
        give_up_after=5,
        down_for=5,
        retries=0,
        generations=0,
        tried={},
        relays=[],
        mailbox_connected=True,
        first_connection=True,
    )
    assert text.startswith("Dilation could not connect to the other side within 5 s")
    assert "never started a new connection through the mailbox" in text
    assert "none configured: pass relay_url" in text
    assert "mailbox server is unreachable" not in text


# --- no path at all: a connection never up gives up in seconds ---------------------------


def test_never_up_gives_up_no_path_timeout_after_the_first_failed_round() -> None:
    p = policy(never_up=True, give_up_after=300, no_path_timeout=10, first_delay=0.5)
    p.disconnected(100.0)
    p.attempting(100.0)
    assert p.next_deadline() == 130.0  # attempt_timeout; no no-path deadline before a failure
    p.attempts_failed(101.0)  # every hint refused
    actions: list = []
    now = 101.0
    while not actions or isinstance(actions[-1], Retry):
        due = p.next_deadline()
        assert due is not None and due <= 111.0
        now = due
        actions += p.timer_fired(now)
        if isinstance(actions[-1], Retry):
            p.attempts_failed(now)  # the retry fails too
    assert [type(a) for a in actions[:-1]] == [Retry] * (len(actions) - 1)
    assert len(actions) > 2  # it retried within the window
    assert actions[-1] == GiveUp(100.0, p.retries, no_path=True)
    assert now == 111.0 and p.state == "GAVE_UP"


def test_never_up_attempts_that_hang_count_as_a_failed_round() -> None:
    p = policy(never_up=True, attempt_timeout=30, no_path_timeout=10)
    p.disconnected(0.0)
    p.attempting(0.0)
    assert p.timer_fired(30.0) == [Retry(1)]  # the round hung: retry, and the window starts
    p.waiting_for_peer(30.0)  # the peer's turn: the no-path deadline still runs
    assert p.next_deadline() == 40.0
    assert p.timer_fired(40.0) == [GiveUp(0.0, 1, no_path=True)]


def test_no_path_rule_does_not_apply_once_connected() -> None:
    p = policy(never_up=True, give_up_after=300, no_path_timeout=10)
    p.disconnected(0.0)
    p.attempting(0.0)
    p.attempts_failed(1.0)
    p.attempting(2.0)
    p.connected(3.0)  # a late hint worked
    p.disconnected(50.0)
    p.attempting(50.0)
    p.attempts_failed(50.0)
    assert p.next_deadline() == 50.5  # only the backoff and give_up_after (350) now
    for _ in range(40):
        due = p.next_deadline()
        assert due is not None
        if due >= 350.0:
            break
        expected = [Retry(p.retries + 1)]
        assert p.timer_fired(due) == expected
        p.attempts_failed(due)
    assert p.timer_fired(350.0) == [GiveUp(50.0, p.retries, no_path=False)]


def test_no_path_message_names_the_relay_and_each_hint() -> None:
    text = give_up_message(
        give_up_after=300,
        down_for=14.6,
        retries=5,
        generations=5,
        tried={
            "direct tcp:10.0.0.2:4312": (2, "timed out"),
            "relay tcp:relay.example:4001": (6, "refused"),
        },
        relays=["tcp:relay.example:4001"],
        mailbox_connected=True,
        first_connection=True,
        no_path=True,
        no_path_timeout=10,
    )
    assert text == (
        "could not reach the other side: relay tcp:relay.example:4001 refused (x6), "
        "direct tcp:10.0.0.2:4312 timed out (x2); no connection within 15 s (gave up 10 s "
        "after every attempt had failed). Check that the transit relay "
        "tcp:relay.example:4001 is running and reachable from both machines, or that the "
        "machines can reach each other directly."
    )
    assert "reconnect" not in text


def test_never_up_without_a_failed_round_is_the_plain_give_up() -> None:
    """Hints that never came (nothing failed): give_up_after's error, not "no path"."""
    p = policy(never_up=True, give_up_after=20, no_path_timeout=10)
    p.disconnected(0.0)
    p.attempting(0.0)
    p.waiting_for_peer(1.0)  # nothing of ours to try; the peer never sends hints
    assert p.next_deadline() == 20.0
    assert p.timer_fired(20.0) == [GiveUp(0.0, 0, no_path=False)]
