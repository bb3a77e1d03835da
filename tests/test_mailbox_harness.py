"""Scenarios against the real mailbox server code (tests/mailbox_harness.py).

Each test pins one server fact or one client rule: the release after a
crowded claim, the "robbed winner" of a shared nameplate, the "ghost" that
closes before its PAKE reached the mailbox, and seeded interleavings of a
whole exchange.
"""

from __future__ import annotations

import random

import pytest
from mailbox_harness import DOWN, UP, Harness

from spark_dilation.errors import CrowdedError, LonelyError
from spark_dilation.wormhole import core

CODE = "4-purple-sausages"
NAMEPLATE = "4"


def errors(client) -> list[tuple[str, str]]:
    """(error, type of the refused frame) for each error the server sent."""
    return [(m["error"], m["orig"]["type"]) for m in client.received if m["type"] == "error"]


def holders(h: Harness):
    """Two clients that claim NAMEPLATE, meet, and keep their claims (keep_nameplate)."""
    l_, a = h.client("l", keep_nameplate=True), h.client("a", keep_nameplate=True)
    l_.set_code(CODE)
    a.set_code(CODE)
    h.run_until_quiet()
    assert l_.got(core.GotVersions) and a.got(core.GotVersions)
    assert h.sides_per_nameplate() == {NAMEPLATE: 2}
    return l_, a


# --- release after a crowded answer ---------------------------------------------------


def test_crowded_claim_is_released_and_the_nameplate_freed():
    h = Harness()
    l_, a = holders(h)
    c = h.client("c")
    c.set_code(CODE)
    h.run_until_quiet()
    assert isinstance(c.closed_result, CrowdedError)
    assert errors(c) == [("crowded", "claim")]
    # The release, then nothing: a refused claim names no mailbox to close.
    assert c.sent_types() == ["bind", "claim", "release"]
    assert c.sent[-1]["nameplate"] == NAMEPLATE
    assert [m["type"] for m in c.received][-1] == "released"
    assert h.sides_per_nameplate() == {NAMEPLATE: 3}  # c's released row stays until the end
    with pytest.raises(AssertionError, match="more than two sides"):
        h.check_at_most_two_sides()
    for p in (l_, a):
        p.close()
    h.run_until_quiet()
    assert l_.closed_result is None and a.closed_result is None
    assert h.sides_per_nameplate() == {}  # the last release deleted the nameplate
    # The server fact no client can fix: claim() opened the mailbox for c too,
    # and c never learned the mailbox id, so the mailbox waits for pruning.
    ((mailbox, sides),) = h.sides_per_mailbox().items()
    assert sides == 3 and h.open_sides(mailbox) == [c.core.side]
    assert not h.empty()


def test_without_the_release_a_crowded_claim_pins_the_nameplate():
    """The server fact behind the fix, with hand-built frames: a refused claim
    still wrote its nameplate_sides row (claimed), so the holders' releases do
    not free the nameplate."""
    h = Harness()
    l_, a = holders(h)
    c = h.raw_client("c")
    c.send_raw("bind", appid=h.appid, side="c000000000")
    c.send_raw("claim", nameplate=NAMEPLATE)
    h.run_until_quiet()
    assert errors(c) == [("crowded", "claim")]
    assert h.sides_per_nameplate() == {NAMEPLATE: 3}
    for p in (l_, a):
        p.close()
    h.run_until_quiet()
    assert l_.closed_result is None and a.closed_result is None
    assert h.sides_per_nameplate() == {NAMEPLATE: 3}  # still there, still "crowded"
    # ... and a newcomer with the same nameplate is turned away.
    d = h.client("d")
    d.set_code(CODE)
    h.run_until_quiet()
    assert isinstance(d.closed_result, CrowdedError)
    # The release the core now sends is what frees it.
    c.send_raw("release", nameplate=NAMEPLATE)
    h.run_until_quiet()
    assert h.sides_per_nameplate() == {}


# --- the robbed winner ------------------------------------------------------------------


def test_robbed_winner_a_third_claim_between_claim_and_open():
    """L waits on N; A claims N; B claims N before A's open reaches the server.

    The server refuses B (crowded), but B's refused claim already wrote B's
    mailbox_sides row, and open() counts every side that ever entered: A's
    open is refused too although A won the claim. A's PAKE never reaches the
    mailbox; L hears nobody and waits until it gives up. This is why probing
    a shared nameplate (claim to see whether it is taken) is unsafe.
    """
    h = Harness()
    l_ = h.client("l")
    l_.set_code(CODE)
    h.run_until_quiet()
    a = h.client("a")
    a.set_code(CODE)
    h.deliver_through(a, UP, "claim")
    h.hold(a)  # A's "claimed" and everything after it wait
    assert [m["type"] for m in a.queued(DOWN)][-1] == "claimed"
    b = h.client("b")
    b.set_code(CODE)
    h.run_until_quiet()
    assert errors(b) == [("crowded", "claim")]
    assert isinstance(b.closed_result, CrowdedError)
    assert b.sent_types() == ["bind", "claim", "release"]
    h.release(a)
    h.run_until_quiet()
    assert ("crowded", "open") in errors(a)  # robbed
    assert isinstance(a.closed_result, CrowdedError)
    assert not any(m["type"] == "message" for m in a.received)
    assert not l_.got(core.GotPeer)  # L never hears of A
    assert not l_.core.closing
    mailbox = l_.core.mailbox
    assert h.sides_per_mailbox() == {mailbox: 3}
    l_.close()
    h.run_until_quiet()
    assert isinstance(l_.closed_result, LonelyError)
    assert h.sides_per_nameplate() == {}  # everyone released
    # A (claim opened it, its open was refused) and B (same) stay open.
    assert h.open_sides(mailbox) == sorted([a.core.side, b.core.side])


# --- the ghost --------------------------------------------------------------------------


def ghost_setup():
    h = Harness()
    l_ = h.client("l")
    l_.set_code(CODE)
    h.run_until_quiet()
    a = h.client("a")
    a.set_code(CODE)
    return h, l_, a


def test_ghost_close_before_the_claim_answer_still_delivers_the_pake():
    """A's claim landed (L now counts A as its second side) and A closes before
    "claimed" came back. Rule: A waits for "claimed", then sends open, add(pake),
    release, close; L receives A's PAKE and the server ends empty."""
    h, l_, a = ghost_setup()
    h.deliver_through(a, UP, "claim")
    h.hold(a)
    a.close()
    assert a.queued(UP) == []  # no release yet: the claim is unanswered
    h.release(a)
    h.run_until_quiet()
    assert a.sent_types() == ["bind", "claim", "open", "add", "release", "close"]
    assert a.sent[3]["phase"] == "pake"
    assert isinstance(a.closed_result, LonelyError)
    assert l_.got(core.GotPeer) and l_.got(core.GotUnverifiedKey)
    assert h.sides_per_nameplate() == {}  # A released, L released on A's PAKE
    l_.close()
    h.run_until_quiet()
    assert isinstance(l_.closed_result, LonelyError)
    assert h.empty()


def test_ghost_close_with_the_pake_add_in_flight():
    """A's open and add(pake) are queued, not delivered, when A closes: the
    close frames queue behind them on the same connection."""
    h, l_, a = ghost_setup()
    h.deliver_through(a, UP, "claim")
    h.deliver_through(a, DOWN, "claimed")
    h.hold(a)
    assert [m["type"] for m in a.queued(UP)] == ["open", "add"]
    a.close()
    assert [m["type"] for m in a.queued(UP)] == ["open", "add", "release", "close"]
    h.release(a)
    h.run_until_quiet()
    assert l_.got(core.GotPeer)
    l_.close()
    h.run_until_quiet()
    assert h.empty()


def test_ghost_close_while_disconnected_claims_again_on_reconnect():
    """A's claim landed, then A's connection dropped with "claimed" in flight,
    then A closed: on reconnect A claims again (allowed, it never released)
    to learn the mailbox and deliver its PAKE."""
    h, l_, a = ghost_setup()
    h.deliver_through(a, UP, "claim")
    a.disconnect()  # "claimed" is lost
    a.close()
    assert not a.got(core.Closed)
    a.connect()
    h.run_until_quiet()
    assert a.sent_types()[-6:] == ["bind", "claim", "open", "add", "release", "close"]
    assert isinstance(a.closed_result, LonelyError)
    assert l_.got(core.GotPeer)
    l_.close()
    h.run_until_quiet()
    assert h.empty()


# --- seeded interleavings ------------------------------------------------------------------


def both_learn_everything(a, b) -> None:
    for p in (a, b):
        assert len(p.got(core.GotUnverifiedKey)) == 1
        assert len(p.got(core.GotVerifier)) == 1
        assert len(p.got(core.GotVersions)) == 1
    assert a.core.key == b.core.key
    assert a.got(core.GotVersions)[0].app_versions == {"side": "b"}
    assert b.got(core.GotVersions)[0].app_versions == {"side": "a"}


@pytest.mark.parametrize("block", range(4))
def test_seeded_interleavings_of_a_whole_exchange(block):
    """200 seeds (50 per block): both set_code, exchange versions, close."""
    for seed in range(block * 50, block * 50 + 50):
        h = Harness(seed=seed)
        a = h.client("a", versions={"app_versions": {"side": "a"}})
        b = h.client("b", versions={"app_versions": {"side": "b"}})
        a.set_code(CODE)
        b.set_code(CODE)
        h.run_random(seed, check=h.check_at_most_two_sides)
        both_learn_everything(a, b)
        a.close()
        b.close()
        h.run_random(seed + 1000, check=h.check_at_most_two_sides)
        assert a.closed_result is None and b.closed_result is None, seed
        assert h.empty(), seed


def test_seeded_interleavings_with_an_early_close():
    """A closes after a random number of steps (often before its claim is
    answered). Whatever the order: at most two sides; if A's claim ever put A
    into B's mailbox, B receives A's PAKE (the ghost rule); once B closes too,
    the server is empty."""
    for seed in range(200):
        h = Harness(seed=seed)
        a, b = h.client("a"), h.client("b")
        a.set_code(CODE)
        b.set_code(CODE)
        shared = []

        def check(h=h, a=a, b=b, shared=shared) -> None:
            h.check_at_most_two_sides()
            mailbox = b.core.mailbox
            if mailbox is not None and a.core.side in h.mailbox_sides(mailbox):
                shared.append(True)

        rng = random.Random(seed)
        for _ in range(rng.randrange(12)):
            ready = h.deliverable()
            if not ready:
                break
            h.step(rng.choice(ready))
            check()
        a.close()
        h.run_random(seed, check=check)
        assert a.got(core.Closed), seed
        assert bool(b.got(core.GotPeer)) == bool(shared), seed
        b.close()
        h.run_random(seed + 1000, check=check)
        assert b.got(core.Closed), seed
        assert h.empty(), seed
