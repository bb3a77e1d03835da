"""A mailbox server restart, with or without its database, on the harness (real server
code, fake clock): the wormhole core's re-claim rule (``core.py``, "a lonely claim is
claimed again on every reconnect").

A lane's door and the directory link wait on a *lonely* claim: one side, its PAKE in
the mailbox, the peer not yet there. A server that restarts without its database
(``:memory:``) forgets the nameplate; the peer's later claim makes a new nameplate with
a new mailbox. Before the rule the lonely side reopened its old mailbox and the two
never met. Seeded runs add random orders and a restart at a random step.
"""

from __future__ import annotations

import random

import pytest
from mailbox_harness import DOWN, UP, Harness

from spark_dilation.errors import CrowdedError
from spark_dilation.wormhole import core

CODE = "7-lonely-door"


def paired(a, b) -> bool:
    return bool(a.got(core.GotVersions) and b.got(core.GotVersions)) and a.core.key == b.core.key


def close_both(h: Harness, a, b) -> None:
    a.close()
    b.close()
    h.run_until_quiet()
    assert a.closed_result is None and b.closed_result is None
    assert h.empty()


@pytest.mark.parametrize("keep_db", [False, True], ids=["lost-db", "kept-db"])
@pytest.mark.parametrize("keep_nameplate", [True, False], ids=["door", "code"])
def test_a_lonely_claim_meets_its_peer_after_a_restart(keep_db, keep_nameplate):
    """The door (keep_nameplate, as lanes and senders claim) or a plain code claims
    alone; the server restarts; the peer claims on the new server: they pair."""
    h = Harness()
    door = h.client("door", keep_nameplate=keep_nameplate)
    door.set_code(CODE)
    h.run_until_quiet()
    old_mailbox = door.core.mailbox
    assert old_mailbox is not None and not door.got(core.GotPeer)
    h.restart(keep_db=keep_db)
    door.connect()
    peer = h.client("peer", keep_nameplate=keep_nameplate)
    peer.set_code(CODE)
    h.run_until_quiet(check=h.check_at_most_two_sides)
    assert paired(door, peer)
    assert door.core.mailbox == peer.core.mailbox
    # The lost state is told as such (a meeting that then fails names it).
    assert door.core.server_lost_state is (not keep_db)
    assert (door.core.mailbox != old_mailbox) is (not keep_db)
    close_both(h, door, peer)


def test_an_allocated_code_waits_through_a_restart():
    """``wormhole send`` allocates, prints the code and waits alone: the receiver typed
    the code after a restart that lost the allocation."""
    h = Harness()
    sender = h.client("sender")
    sender.allocate_code()
    h.run_until_quiet()
    (got,) = sender.got(core.GotCode)
    h.restart(keep_db=False)
    sender.connect()
    h.run_until_quiet()
    receiver = h.client("receiver")
    receiver.set_code(got.code)
    h.run_until_quiet(check=h.check_at_most_two_sides)
    assert paired(sender, receiver)
    close_both(h, sender, receiver)


def test_a_restart_between_two_reconnects_claims_on_each():
    """Two restarts without a database before the peer comes: each reconnect claims again."""
    h = Harness()
    door = h.client("door", keep_nameplate=True)
    door.set_code(CODE)
    h.run_until_quiet()
    for _ in range(2):
        h.restart(keep_db=False)
        door.connect()
        h.run_until_quiet()
    assert door.sent_types().count("claim") == 3
    peer = h.client("peer", keep_nameplate=True)
    peer.set_code(CODE)
    h.run_until_quiet(check=h.check_at_most_two_sides)
    assert paired(door, peer)
    close_both(h, door, peer)


def test_a_paired_claim_is_not_claimed_again():
    """Once the peer is there, a reconnect reopens the mailbox and sends no claim: the
    pairing is made, and a new claim would only make a stray nameplate."""
    h = Harness()
    a, b = h.client("a", keep_nameplate=True), h.client("b", keep_nameplate=True)
    a.set_code(CODE)
    b.set_code(CODE)
    h.run_until_quiet()
    assert paired(a, b)
    h.restart(keep_db=True)
    a.connect()
    b.connect()
    h.run_until_quiet()
    assert a.sent_types().count("claim") == 1 and b.sent_types().count("claim") == 1
    assert not a.core.server_lost_state
    close_both(h, a, b)


@pytest.mark.parametrize("keep_db", [False, True], ids=["lost-db", "kept-db"])
def test_seeded_restarts_before_the_peer_arrives(keep_db):
    """100 seeds: the door claims, frames go in a random order, the server restarts at a
    random step before the peer's claim, every client reconnects, then the peer claims:
    at most two sides at every step, and the two always pair."""
    for seed in range(100):
        rng = random.Random(seed)
        h = Harness(seed=seed)
        door = h.client("door", keep_nameplate=True)
        door.set_code(CODE)
        for _ in range(rng.randrange(8)):
            ready = h.deliverable()
            if not ready:
                break
            h.step(rng.choice(ready))
        h.restart(keep_db=keep_db)
        door.connect()
        peer = h.client("peer", keep_nameplate=True)
        peer.set_code(CODE)
        h.run_random(seed, check=h.check_at_most_two_sides)
        assert paired(door, peer), seed
        close_both(h, door, peer)


def test_a_restart_that_lost_the_peers_pake_is_named():
    """The sender received the lane's PAKE (so it is no longer lonely: no re-claim) and
    the server restarted without its database before the sender's own PAKE landed. Its
    reopen finds an empty mailbox: the replay check misses the lane's PAKE, so the core
    knows the server lost its state (a meeting that then times out names it). Before,
    with nothing of its own echoed, the sender reopened without a check and waited
    with no cause to give."""
    h = Harness()
    lane = h.client("lane", guard_door=True)
    lane.set_code(CODE)
    h.run_until_quiet()
    sender = h.client("sender", guard_door=True)
    sender.set_code(CODE)
    h.deliver_through(sender, UP, "claim")
    h.deliver_through(sender, DOWN, "claimed")
    h.deliver_through(sender, UP, "open")  # its PAKE's add is still queued behind
    while not sender.got(core.GotPeer):
        h.step((sender, DOWN))
    assert "pake" not in sender.core._echoed
    h.restart(keep_db=False)
    sender.connect()
    lane.connect()
    h.run_until_quiet()
    assert not paired(lane, sender)
    assert sender.core.server_lost_state


def test_a_crowded_reclaim_ends_the_wormhole():
    """A stranger claimed the door after the sender; the lane's claim was the third
    (crowded, and the server keeps its row). The server restarts with its database and
    the sender, still lonely, claims again: crowded. Its close is refused too (the
    server opens the crowded mailbox for it): the wormhole still ends, with the crowded
    error, so the meeting moves to the next door. Before, it waited for a ``closed``
    that never came, and the sender's meeting waited on the spoiled door for good."""
    h = Harness()
    sender = h.client("sender", guard_door=True)
    sender.set_code(CODE)
    h.run_until_quiet()
    stranger = h.raw_client("stranger")
    stranger.send_raw("bind", appid=h.appid, side="stranger00")
    stranger.send_raw("claim", nameplate=CODE.split("-")[0])
    h.run_until_quiet()
    lane = h.client("lane", guard_door=True)
    lane.set_code(CODE)
    h.run_until_quiet()
    assert isinstance(lane.closed_result, CrowdedError)
    assert not sender.got(core.Closed)
    h.restart(keep_db=True)
    sender.connect()
    h.run_until_quiet()
    assert isinstance(sender.closed_result, CrowdedError)
