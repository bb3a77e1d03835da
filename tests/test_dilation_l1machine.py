"""Unit tests of the sans-IO L1 state machine (no reactor, no mailbox)."""

from __future__ import annotations

import json

from spark_dilation.dilation import l1
from spark_dilation.dilation import l1machine as M

HI, LO = "f" * 16, "0" * 16


def sent(actions) -> list[dict]:
    return [json.loads(a.plaintext) for a in actions if isinstance(a, M.SendL1)]


def kinds(actions) -> list[str]:
    return [type(a).__name__ for a in actions]


def started(side: str) -> M.L1Machine:
    m = M.L1Machine(side)
    assert m.dilate() == []  # nothing until the peer's versions are known
    actions = m.got_versions(["ged"])
    assert sent(actions) == [{"type": "please", "side": side, "use-version": "ged"}]
    assert m.state == "WANTING"
    return m


def test_please_then_roles_and_generation_zero():
    leader = started(HI)
    actions = leader.received(l1.please(LO, "ged"))
    assert actions == [M.StartConnecting(0, l1.Role.LEADER)]
    follower = started(LO)
    assert follower.received(l1.please(HI, "ged")) == [M.StartConnecting(0, l1.Role.FOLLOWER)]


def test_versions_before_dilate_also_start():
    m = M.L1Machine(HI)
    assert m.got_versions(["ged"]) == []
    assert sent(m.dilate())[0]["type"] == "please"


def test_no_shared_version_still_sends_please_without_use_version():
    m = M.L1Machine(HI)
    m.dilate()
    actions = m.got_versions(["1"])
    assert sent(actions) == [{"type": "please", "side": HI}]
    assert M.NoSharedVersion() in actions


def test_hints_only_while_connecting_and_early_hints_are_kept():
    m = started(HI)
    hint = {"type": "direct-tcp-v1", "priority": 0.0, "hostname": "h", "port": 1}
    assert m.received(l1.connection_hints([hint])) == []  # too early: kept
    actions = m.received(l1.please(LO, "ged"))
    assert actions == [M.StartConnecting(0, l1.Role.LEADER), M.UseHints((hint,))]
    assert m.received(l1.connection_hints([hint])) == [M.UseHints((hint,))]
    m.connection_made()
    assert m.received(l1.connection_hints([hint])) == []  # too late: ignored


def test_early_please_before_our_versions_is_not_lost():
    m = M.L1Machine(HI)
    m.dilate()
    assert m.received(l1.please(LO, "ged")) == []
    actions = m.got_versions(["ged"])
    assert kinds(actions) == ["SendL1", "StartConnecting"]


def test_leader_reconnects_after_reconnecting():
    m = started(HI)
    m.received(l1.please(LO, "ged"))
    m.connection_made()
    assert sent(m.connection_lost()) == [{"type": "reconnect"}]
    assert m.state == "FLUSHING"
    hint = {"type": "direct-tcp-v1", "hostname": "h", "port": 2}
    assert m.received(l1.connection_hints([hint])) == []  # stale until reconnecting
    assert m.received(l1.reconnecting()) == [M.StartConnecting(1, l1.Role.LEADER)]


def test_follower_waits_lonely_then_answers_reconnect():
    m = started(LO)
    m.received(l1.please(HI, "ged"))
    m.connection_made()
    assert m.connection_lost() == []
    assert m.state == "LONELY"
    actions = m.received(l1.reconnect())
    assert sent(actions) == [{"type": "reconnecting"}]
    assert actions[-1] == M.StartConnecting(1, l1.Role.FOLLOWER)


def test_follower_abandons_a_live_connection_on_reconnect():
    m = started(LO)
    m.received(l1.please(HI, "ged"))
    m.connection_made()
    assert m.received(l1.reconnect()) == [M.AbandonConnection()]
    assert m.state == "ABANDONING"
    actions = m.connection_lost()
    assert sent(actions) == [{"type": "reconnecting"}]
    assert actions[-1] == M.StartConnecting(1, l1.Role.FOLLOWER)


def test_follower_restarts_an_attempt_in_progress():
    m = started(LO)
    m.received(l1.please(HI, "ged"))
    actions = m.received(l1.reconnect())
    assert kinds(actions) == ["StopConnecting", "SendL1", "StartConnecting"]
    assert m.generation == 1


def test_stop_in_each_state():
    m = started(HI)
    assert m.stop() == [M.Stopped()]
    m = started(HI)
    m.received(l1.please(LO, "ged"))
    assert m.stop() == [M.StopConnecting(), M.Stopped()]
    m = started(HI)
    m.received(l1.please(LO, "ged"))
    m.connection_made()
    assert m.stop() == [M.AbandonConnection()]
    assert m.connection_lost() == [M.Stopped()]
    assert m.stop() == []


def test_unknown_messages_and_duplicate_please_are_ignored():
    m = started(HI)
    assert m.received(json.dumps({"type": "future-thing"}).encode()) == []
    m.received(l1.please(LO, "ged"))
    assert m.received(l1.please(LO, "ged")) == []
    assert m.generation == 0
