"""A door's two wormhole cores under seeded faults, on the harness (real server code,
fake clock, frames in a seeded order): connections dropped at any frame, connection
tries refused, a server restart with or without its database, and strangers on the
door. Each seed's outcome is one of a few named ones; anything else fails with the
seed's fault log.

The rules under test are the core's (``spark_dilation/wormhole/core.py``): claims and
adds sent again after a reconnect (the ghost rule), a lonely claim claimed again on
every reconnect (the re-claim rule), never more than two sides on a nameplate.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest
from mailbox_harness import Faults, Harness

from spark_dilation.errors import CrowdedError, WrongCodeError
from spark_dilation.wormhole import core

CODE = "9-door-under-faults"
WRONG = "9-not-the-doors-password"


def paired(a, b) -> bool:
    return (
        len(a.got(core.GotVersions)) == 1
        and len(b.got(core.GotVersions)) == 1
        and a.core.key == b.core.key
    )


def door(seed: int, faults: Faults) -> tuple[str, Harness]:
    """The lane claims its door, the sender a random number of frames later; frames go
    in a seeded order with ``faults`` until nothing moves. Returns the outcome."""
    rng = random.Random(seed)
    h = Harness(seed=seed, faults=faults)
    lane = h.client("lane", keep_nameplate=True, connect=False)
    lane.set_code(CODE)
    for _ in range(rng.randrange(12)):
        ready = h.deliverable()
        if ready:
            h.step(rng.choice(ready))
    sender = h.client("sender", keep_nameplate=True, connect=False)
    sender.set_code(CODE)
    h.run_random(seed, max_steps=20_000, check=h.check_at_most_two_sides)
    if paired(lane, sender):
        return "paired", h
    if lane.core.server_lost_state or sender.core.server_lost_state:
        return "stranded by a restart that lost the database (named)", h
    raise AssertionError(f"seed {seed}: neither paired nor a named cause: {faults.log}")


@pytest.mark.parametrize("keep_db", [True, False], ids=["kept-db", "lost-db"])
def test_a_door_under_drops_refusals_and_a_restart(keep_db: bool) -> None:
    """250 seeds: each delivered frame drops a random live connection with probability
    0.05, each connection try is refused with probability 0.3, the server restarts once
    at a random step. With its database the two always pair; without it they pair, or
    (the restart came mid-PAKE) the stranded side knows the server lost its state."""
    outcomes: Counter[str] = Counter()
    faults_seen: Counter[str] = Counter()
    steps: list[int] = []
    for seed in range(250):
        rng = random.Random(seed)
        faults = Faults(
            seed=seed, drop=0.05, refuse=0.3, restart_at=rng.randrange(1, 40), keep_db=keep_db
        )
        outcome, h = door(seed, faults)
        outcomes[outcome] += 1
        steps.append(h.steps)
        for line in faults.log:
            faults_seen[line.split(": ", 1)[1].split(" of ")[0]] += 1
        if keep_db:
            assert outcome == "paired", (seed, faults.log)
    assert faults_seen["dropped the connection"] > 100, faults_seen
    assert faults_seen["refused a connection"] > 100, faults_seen
    # A run can end before its restart's step: most do not.
    assert sum(v for k, v in faults_seen.items() if k.startswith("server restart")) > 200
    assert outcomes["paired"] >= 200, outcomes  # most restarts do not come mid-PAKE
    print(dict(outcomes), dict(faults_seen), "steps max", max(steps), "total", sum(steps))


def test_refused_first_connections_then_the_pair_meets() -> None:
    """The next 7 connection tries (both sides' first ones among them) are refused: the
    claims wait for a connection and go out on it; the door pairs."""
    faults = Faults(refuse_next=7)
    outcome, h = door(0, faults)
    assert outcome == "paired"
    assert h.refused == 7


# --- strangers ---------------------------------------------------------------------------


def stranger_on_the_door(seed: int, bogus: bool, guard: bool = True) -> tuple[str, str, Harness]:
    """The lane claims, a stranger claims the door's nameplate at a random frame (silent:
    a claim and nothing else; bogus: a PAKE with another password), the sender claims
    later. Both door sides are guarded as ``meet()`` guards them (``guard``). Returns
    (lane's outcome, sender's outcome)."""
    rng = random.Random(seed)
    h = Harness(seed=seed)
    lane = h.client("lane", guard_door=guard)
    lane.set_code(CODE)
    sender = h.client("sender", guard_door=guard, connect=False)
    stranger_first = rng.random() < 0.5
    h.run_random(seed)
    if bogus:
        stranger = h.client("stranger", keep_nameplate=True)
        stranger.set_code(WRONG)
    else:
        stranger = h.raw_client("stranger")
        stranger.send_raw("bind", appid=h.appid, side="stranger00")
        stranger.send_raw("claim", nameplate=CODE.split("-")[0])
    if stranger_first:
        h.run_random(seed + 1)
    sender.connect()
    sender.set_code(CODE)
    h.run_random(seed + 2)

    def outcome(c) -> str:
        closed = c.got(core.Closed)
        if closed:
            return type(closed[0].error).__name__
        if c.got(core.GotVersions):
            return "paired"
        return "waiting"

    assert not (lane.got(core.GotVersions) and lane.core.their_side == "stranger00")
    return outcome(lane), outcome(sender), h


@pytest.mark.parametrize("bogus", [False, True], ids=["silent", "bogus-pake"])
def test_what_the_cores_see_when_a_stranger_lands_on_a_door(bogus: bool) -> None:
    """A stranger on a door (a forced collision: private doors keep it off ``list``).
    Never a pairing with the stranger, never a sender alone on the door. Silent: the
    sender finds the door crowded and the lane waits (nothing tells it). Bogus PAKE: the
    lane fails with "wrong code" and keeps its claim (the guard rule), so the sender
    finds the door crowded however late it comes; or the sender's claim crowds the
    mailbox before the stranger opens it, both late-comers are crowded and the lane
    waits. Or the stranger came after both: the pair meets, the stranger is crowded.
    Each "crowded" and "wrong code" is the door spoiled: ``meet()`` raises DoorSpoiled
    and both sides move to the next attempt (pool.py, lane.py)."""
    seen: Counter[tuple[str, str]] = Counter()
    for seed in range(60):
        lane, sender, _ = stranger_on_the_door(seed, bogus)
        seen[(lane, sender)] += 1
    crowded, wrong = CrowdedError.__name__, WrongCodeError.__name__
    if bogus:
        allowed = {("paired", "paired"), (wrong, crowded), ("waiting", crowded)}
    else:
        allowed = {("paired", "paired"), ("waiting", crowded)}
    assert set(seen) <= allowed, seen
    assert seen[("paired", "paired")] < 60, "the stranger never landed first: proved nothing"


def test_without_the_guard_a_sender_waits_alone_at_a_spoiled_door() -> None:
    """The case the guard rule is for: an unguarded lane releases its door at the
    stranger's PAKE, the stranger leaves, and a sender who comes later claims the
    nameplate anew and waits alone (the lane has moved on)."""
    alone = sum(stranger_on_the_door(s, bogus=True, guard=False)[1] == "waiting" for s in range(60))
    assert alone > 0
