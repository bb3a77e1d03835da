"""Meeting by introduction, end to end: the directory's rules driving real claims.

Lanes and senders are driven exactly as ``spark_dilation.transfer.rules.directory``
says: every code a client claims comes from ``LaneDoors`` (the lane host's open
doors) or ``SenderDoors`` (a sender's connection), never from the test. Each
claim is one ``WormholeCore`` against the real mailbox server code
(tests/mailbox_harness.py). After every delivered frame the world checks that
no nameplate or mailbox has more than two sides and that every nameplate on
the server is a door the directory issued, then reacts the way production
does: a lane host that paired on door ``a`` opens ``a + 1`` for that sender.

A *pairing* is a door whose two sides both got the peer's versions, and each
side's versions name that same door and the other role. Time is counted in
delivered frames (steps) and fake seconds (``Harness.clock``).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import random
import time

import pytest
from mailbox_harness import DOWN, Harness

from spark_dilation.transfer.rules.directory import (
    DirectoryState,
    Door,
    LaneDoors,
    LaneEpochs,
    SenderDoors,
    SenderIds,
    lanes_message,
    senders_message,
)
from spark_dilation.wormhole import core

SECRET = bytes(range(32))
PROTOCOL = "spark-dilation/dataset"
LANE, SENDER = "lane", "sender"
OTHER = {LANE: SENDER, SENDER: LANE}
# Harness.check_at_most_two_sides in one cheap query (it runs after every step): the
# nameplates and mailboxes with more than two side rows.
CROWDED = """
SELECT 'nameplate' AS kind, nameplates_id AS id, COUNT(*) AS sides FROM nameplate_sides
 GROUP BY nameplates_id HAVING COUNT(*) > 2
UNION ALL
SELECT 'mailbox', mailbox_id, COUNT(*) FROM mailbox_sides GROUP BY mailbox_id HAVING COUNT(*) > 2
"""
PRUNE_OLD = 11 * 60  # the server's "old": 11 minutes (server.py, AppNamespace.prune)


def entry(role: str, door: Door) -> dict:
    return {
        "role": role,
        "lane": door.lane,
        "epoch": door.epoch,
        "sender": door.sender,
        "attempt": door.attempt,
    }


class Claim:
    """One wormhole on one door: a harness client and what became of it."""

    def __init__(self, world: World, door: Door, role: str, owner: object) -> None:
        self.door, self.role, self.owner = door, role, owner
        self.code = door.code(SECRET)
        self.nameplate = self.code.split("-")[0]
        world.issued.add(self.nameplate)
        n = next(world._sides)
        self.client = world.h.client(
            f"{role[0]}{door.lane}.{door.epoch}.{door.sender}.{door.attempt}#{n}",
            side=f"{n:010d}",
            versions={"app_versions": {PROTOCOL: entry(role, door)}},
        )
        self.client.set_code(self.code)
        self.killed = False
        self.noted = False  # its GotVersions was seen by the world
        self.seen = 0  # events looked at so far

    @property
    def versions(self) -> bool:
        return bool(self.client.got(core.GotVersions))

    @property
    def live(self) -> bool:
        return not self.killed and not self.client.core.closing

    def close(self) -> None:
        if self.live:
            self.client.close()


class LaneHost:
    """The process hosting one lane at one epoch: a door per sender it knows."""

    def __init__(self, world: World, lane: int, epoch: int) -> None:
        self.world, self.lane, self.epoch = world, lane, epoch
        self.doors = LaneDoors(lane, epoch)
        self.state = DirectoryState()
        self.claims: list[Claim] = []
        self.slow_attempts: set[int] = set()

    def hear(self, message: dict) -> None:
        """A directory message: open one door per newly named sender."""
        new, _ = self.state.merge(message)
        for door in self.doors.learn(new):
            self.open(door)

    def open(self, door: Door) -> Claim:
        claim = Claim(self.world, door, LANE, self)
        if door.attempt in self.slow_attempts:  # a slow host: this claim waits
            self.world.h.hold(claim.client)
        assert door not in self.world.lane_claims, f"door {door} opened twice"
        self.world.lane_claims[door] = claim
        self.claims.append(claim)
        self.world.claims.append(claim)
        return claim

    def paired(self, claim: Claim) -> None:
        nxt = self.doors.paired(claim.door)
        assert nxt == Door(
            claim.door.lane, claim.door.epoch, claim.door.sender, claim.door.attempt + 1
        )
        self.open(nxt)

    def kill(self) -> None:
        """The process dies: its connections drop, nothing is closed."""
        for claim in self.claims:
            if claim.client.connected:
                claim.client.disconnect()
            claim.killed = True


class SenderProc:
    """One sending process: an id from the writing end and its connections' claims."""

    def __init__(self, world: World) -> None:
        self.world = world
        self.id = world.ids.issue()
        self.doors = SenderDoors(self.id)
        self.state = DirectoryState()
        self.claims: list[Claim] = []
        self.waiting: list[int] = []  # connections wanting a lane of unknown epoch

    def hear(self, message: dict) -> None:
        """A directory message: connections on a re-hosted lane are stale; close and
        connect again at the new epoch."""
        _, risen = self.state.merge(message)
        stale = self.doors.epochs(risen)
        for lane in stale:
            for claim in list(self.claims):  # connect() adds the new epoch's claims
                if claim.door.lane == lane and claim.door.epoch < stale[lane] and claim.live:
                    claim.close()
                    self.connect(lane)
            for waiting in [w for w in self.waiting if w == lane]:
                self.waiting.remove(waiting)
                self.connect(lane)

    def connect(self, lane: int) -> Claim | None:
        """A new connection to ``lane``: claim the door the rules hand out."""
        door = self.doors.want(lane)
        if door is None:
            self.waiting.append(lane)
            return None
        claim = Claim(self.world, door, SENDER, self)
        self.claims.append(claim)
        self.world.claims.append(claim)
        return claim


class World:
    """The directory (both halves), lane hosts, senders, and the harness they meet on."""

    def __init__(self, *, seed: int = 0, lanes: int = 1) -> None:
        self.h = Harness(seed=seed)
        self.t0 = self.h.clock.seconds()
        self.ids = SenderIds()
        self.epochs = LaneEpochs(lanes)
        self.hosts: list[LaneHost] = []
        self.senders: list[SenderProc] = []
        self.claims: list[Claim] = []
        self.issued: set[str] = set()  # every door nameplate handed out so far
        self.pairings: list[Door] = []
        self.lane_claims: dict[Door, Claim] = {}  # a door has one lane side, ever
        self._sides = itertools.count(1)

    # --- the directory ------------------------------------------------------------

    def host(self, lane: int) -> int:
        """The reading end hands ``lane`` to a new process: its epoch, pushed to senders."""
        epoch = self.epochs.host(lane)
        self.push_lanes()
        return epoch

    def start_host(self, lane: int, epoch: int) -> LaneHost:
        host = LaneHost(self, lane, epoch)
        self.hosts.append(host)
        host.hear(senders_message(self.ids.issued))
        return host

    def sender(self) -> SenderProc:
        """The writing end starts a sending process; its id is pushed to the lane hosts."""
        proc = SenderProc(self)
        self.senders.append(proc)
        proc.hear(lanes_message(self.epochs.current()))
        for host in self.hosts:
            host.hear(senders_message(self.ids.issued))
        return proc

    def push_lanes(self) -> None:
        for proc in self.senders:
            proc.hear(lanes_message(self.epochs.current()))

    # --- after every step -------------------------------------------------------------

    def check(self) -> None:
        """After every step: the invariants, then the hosts' and senders' reactions."""
        crowded = self.h.db.execute(CROWDED).fetchall()
        assert not crowded, f"nameplates or mailboxes with more than two sides: {crowded}"
        names = {r["name"] for r in self.h.db.execute("SELECT name FROM nameplates")}
        assert names <= self.issued, f"nameplates the directory never issued: {names - self.issued}"
        self.react()

    def react(self) -> None:
        for claim in self.claims:
            events = claim.client.events
            if claim.noted or len(events) == claim.seen:
                continue
            claim.seen = len(events)
            if not any(isinstance(e, core.GotVersions) for e in events):
                continue
            claim.noted = True
            (got,) = claim.client.got(core.GotVersions)
            theirs = got.app_versions.get(PROTOCOL)
            assert theirs == entry(OTHER[claim.role], claim.door), (claim.door, theirs)
            if claim.role == LANE:
                claim.owner.paired(claim)
            else:
                assert claim.owner.doors.paired(claim.door), f"stale pairing {claim.door}"
            self.pairings = [
                c.door
                for c in self.claims
                if c.role == SENDER and c.noted and self.lane_claims[c.door].noted
            ]

    # --- running ----------------------------------------------------------------------

    def run(self, seed: int | None = None) -> int:
        if seed is None:
            steps = self.h.run_until_quiet(check=self.check)
        else:
            steps = self.h.run_random(seed, check=self.check)
        self.h.check_at_most_two_sides()  # the harness's own query agrees
        return steps

    def fake_seconds(self) -> float:
        return round(self.h.clock.seconds() - self.t0, 3)

    def pairs_of(self, proc: SenderProc, epoch: int | None = None) -> list[Door]:
        return [d for d in self.pairings if d.sender == proc.id and epoch in (None, d.epoch)]

    def close_all(self, seed: int | None = None) -> int:
        for claim in self.claims:
            claim.close()
        steps = self.run(seed)
        for claim in self.claims:
            if not claim.killed:
                assert claim.client.got(core.Closed), claim.door
        return steps


def report(name: str, **figures: object) -> None:
    print(f"{name}: " + ", ".join(f"{k}={v}" for k, v in figures.items()))


# --- the checks can fail ------------------------------------------------------------


class ReusingIds(SenderIds):
    """A broken writing end: every process gets id 0."""

    def issue(self) -> int:
        super().issue()
        return 0


def test_the_checks_catch_a_shared_door_and_a_stray_nameplate():
    w = World()
    w.ids = ReusingIds()
    epoch = w.host(0)
    w.start_host(0, epoch)
    a, b = w.sender(), w.sender()
    assert a.connect(0).door == b.connect(0).door  # two senders on one door
    with pytest.raises(AssertionError, match="more than two sides"):
        w.run()
    w = World()
    w.h.client("stray").set_code("12345-not-a-door")
    with pytest.raises(AssertionError, match=r"never issued: \{'12345'\}"):
        w.run()


# --- 1. senders first --------------------------------------------------------------------


def test_three_senders_wait_15_fake_seconds_for_their_lane():
    w = World()
    epoch = w.host(0)  # published: a registry answered "receive"; no host process yet
    senders = [w.sender() for _ in range(3)]
    for s in senders:
        assert s.connect(0) is not None
    steps_alone = w.run()
    assert not w.pairings
    # Each sender sits alone on its own door: one side per nameplate, three nameplates.
    assert w.h.sides_per_nameplate() == {c.nameplate: 1 for c in w.claims}
    assert len(w.h.sides_per_nameplate()) == 3
    w.h.clock.advance(15)
    host = w.start_host(0, epoch)
    assert [c.door for c in host.claims] == [Door(0, 0, s.id, 0) for s in senders]
    steps_met = w.run()
    for s in senders:
        assert w.pairs_of(s) == [Door(0, 0, s.id, 0)]
    # The lane waits at each sender's next door.
    assert sorted(d.attempt for d in host.doors.open_doors()) == [1, 1, 1]
    report(
        "senders first",
        steps_alone=steps_alone,
        steps_to_pair=steps_met,
        fake_seconds=w.fake_seconds(),
        close_steps=w.close_all(),
    )
    assert w.h.empty()


# --- 2. a slow lane -----------------------------------------------------------------------


def test_lane_frames_held_for_5_fake_seconds():
    w = World()
    epoch = w.host(0)
    senders = [w.sender() for _ in range(3)]
    host = w.start_host(0, epoch)
    w.h.hold(*(c.client for c in host.claims))
    for s in senders:
        s.connect(0)
    steps_held = w.run()
    assert not w.pairings
    assert all(c.client.sent == [] for c in host.claims)  # nothing of the lane moved
    w.h.clock.advance(5)
    w.h.release(*(c.client for c in host.claims))
    steps_met = w.run()
    for s in senders:
        assert w.pairs_of(s) == [Door(0, 0, s.id, 0)]
    report(
        "lane held",
        steps_held=steps_held,
        steps_to_pair=steps_met,
        fake_seconds=w.fake_seconds(),
        close_steps=w.close_all(),
    )
    assert w.h.empty()


# --- 3. seeded interleavings --------------------------------------------------------------


class FastPake:
    """``keys.Pake``'s interface and message shape without SPAKE2's pure-Python curve
    arithmetic (about 0.6 s of each seed's 60 wormholes): two sides with the same code
    get the same key, a reflected message is refused. The frames that flow are the
    same; only the crypto inside them is cheaper."""

    def __init__(self, code: str, appid: str) -> None:
        self._secret = hashlib.sha256(f"{appid}\0{code}".encode()).digest()
        self.outbound = os.urandom(33)

    def message_body(self) -> bytes:
        return json.dumps({"pake_v1": self.outbound.hex()}).encode("utf-8")

    def finish(self, body: bytes) -> bytes:
        inbound = bytes.fromhex(json.loads(body.decode("utf-8"))["pake_v1"])
        if inbound == self.outbound:
            raise ValueError("PAKE failed: our own message")
        return hashlib.sha256(self._secret + b"".join(sorted((self.outbound, inbound)))).digest()


@pytest.fixture
def fast_pake(monkeypatch):
    """FastPake in the cores, unless RENDEZVOUS_REAL_PAKE=1 (then about 4x slower)."""
    if os.environ.get("RENDEZVOUS_REAL_PAKE") != "1":
        monkeypatch.setattr(core, "Pake", FastPake)


@pytest.mark.parametrize("block", range(4))
def test_twenty_senders_on_one_lane_seeded_interleavings(block, fast_pake):
    """200 seeds (50 per block); senders and the lane host start in a seeded order."""
    started = time.perf_counter()
    total_steps, fake = 0, 0.0
    for seed in range(block * 50, block * 50 + 50):
        w = World(seed=seed)
        epoch = w.host(0)
        order = list(range(21))
        random.Random(seed).shuffle(order)
        senders = []
        for slot in order:  # 20 senders and the lane host (slot 20), in a seeded order
            if slot == 20:
                w.start_host(0, epoch)
            else:
                s = w.sender()
                s.connect(0)
                senders.append(s)
        total_steps += w.run(seed)
        for s in senders:
            assert w.pairs_of(s) == [Door(0, 0, s.id, 0)], seed
        total_steps += w.close_all(seed + 1000)
        assert w.h.empty(), seed
        fake += w.fake_seconds()
    report(
        f"20 senders, seeds {block * 50}..{block * 50 + 49}",
        steps=total_steps,
        fake_seconds=round(fake, 3),
        wall_seconds=round(time.perf_counter() - started, 2),
    )


# --- 4. a killed lane host ----------------------------------------------------------------


def claimed_sides(h: Harness) -> set[str]:
    rows = h.db.execute("SELECT side FROM nameplate_sides WHERE claimed").fetchall()
    return {r["side"] for r in rows}


def opened_sides(h: Harness) -> set[str]:
    rows = h.db.execute("SELECT side FROM mailbox_sides WHERE opened").fetchall()
    return {r["side"] for r in rows}


def test_lane_killed_without_closing_then_rehosted():
    w = World()
    epoch0 = w.host(0)
    old = w.start_host(0, epoch0)
    senders = [w.sender() for _ in range(4)]
    for s in senders[:3]:
        s.connect(0)
    steps0 = w.run()
    for s in senders[:3]:
        assert w.pairs_of(s) == [Door(0, 0, s.id, 0)]
    # Sender 3 claims its epoch-0 door just as the host dies: its frames are in flight.
    late = senders[3].connect(0)
    w.h.hold(late.client)
    old.kill()
    killed = {c.client.core.side for c in old.claims}
    # The reading end gives the lane to a new process: epoch 1, pushed to the senders,
    # which close their epoch-0 wormholes and claim epoch-1 doors at once.
    epoch1 = w.host(0)
    assert epoch1 == 1
    for s in senders:
        assert s.doors.epoch(0) == 1
        assert [c.door for c in s.claims if c.live] == [Door(0, 1, s.id, 0)]
    w.h.release(late.client)
    steps_between = w.run()
    new = w.start_host(0, epoch1)
    steps1 = w.run()
    for s in senders:
        assert w.pairs_of(s, epoch=1) == [Door(0, 1, s.id, 0)]
    assert not w.pairs_of(senders[3], epoch=0)
    assert sorted(d.attempt for d in new.doors.open_doors()) == [1, 1, 1, 1]
    close_steps = w.close_all()
    # Left on the server: only what the killed host claimed or opened.
    assert not w.h.empty()
    assert claimed_sides(w.h) <= killed and opened_sides(w.h) <= killed
    assert opened_sides(w.h)  # its mailboxes are still open on its side
    left = (len(w.h.sides_per_nameplate()), len(w.h.sides_per_mailbox()))
    # The server's own pruning: nothing is old yet ...
    now = w.h.clock.seconds()
    w.h.server.prune_all_apps(now=now, old=now - PRUNE_OLD)
    assert not w.h.empty()
    # ... and past 11 minutes everything of the dead host is gone.
    w.h.clock.advance(PRUNE_OLD + 1)
    now = w.h.clock.seconds()
    w.h.server.prune_all_apps(now=now, old=now - PRUNE_OLD)
    assert w.h.empty()
    report(
        "killed lane",
        steps_epoch0=steps0,
        steps_stale_closes=steps_between,
        steps_epoch1=steps1,
        close_steps=close_steps,
        left_nameplates_mailboxes=left,
        fake_seconds=w.fake_seconds(),
    )


# --- 5. two connections of one sender process --------------------------------------------


def test_two_connections_of_one_sender_and_a_claim_that_outlives_its_caller():
    w = World()
    epoch = w.host(0)
    s = w.sender()
    host = w.start_host(0, epoch)
    host.slow_attempts = {2}  # the host is slow to open the door after the second pairing
    first, second = s.connect(0), s.connect(0)  # two pools of one process
    assert (first.door.attempt, second.door.attempt) == (0, 1)
    steps = w.run()
    assert w.pairs_of(s) == [Door(0, 0, s.id, 0), Door(0, 0, s.id, 1)]
    assert first.client.core.mailbox != second.client.core.mailbox
    # A third connection waits: the lane host is slow (held). Its caller's deadline
    # (lane_start_timeout) passes and the caller fails, but the claim stays: the
    # lane's next door is exactly this one.
    (door2,) = [c for c in host.claims if c.door.attempt == 2]
    assert door2.client.sent == []  # held: its claim has not reached the server
    third = s.connect(0)
    assert third.door == Door(0, 0, s.id, 2)
    steps_alone = w.run()
    assert not third.versions
    w.h.clock.advance(300)
    w.h.release(door2.client)
    steps_late = w.run()
    assert w.pairs_of(s) == [Door(0, 0, s.id, a) for a in range(3)]
    assert third.versions
    assert s.doors.want(0) == Door(0, 0, s.id, 3)  # the next connection: the next attempt
    report(
        "two pools",
        steps=steps,
        steps_alone=steps_alone,
        steps_late=steps_late,
        fake_seconds=w.fake_seconds(),
        close_steps=w.close_all(),
    )
    assert w.h.empty()


# --- a claim given up after it met the lane host ---------------------------------------


class NeverPairs(AssertionError):
    """A claim that cannot pair any more: what giving claims up led to (see below)."""


TIMINGS = {
    # The lane host's claim is on the door and the sender's PAKE is in the mailbox, but
    # the host has not read it yet (a slow host) when the sender gives up.
    "host_slow": "the nameplate keeps both sides; the re-claim is the third: crowded",
    # The host read the sender's PAKE (and released the nameplate), not its versions.
    "host_got_pake": "the host waits on door a forever; the re-claim meets nobody",
    # The host got the sender's versions: it counts a pairing and moved on to a + 1;
    # the lane's versions had not reached the sender yet.
    "host_got_versions": "the host waits on door a + 1; the re-claim meets nobody",
}


@pytest.mark.parametrize("timing", TIMINGS)
def test_a_claim_that_met_a_slow_lane_host_is_never_given_up(timing):
    """Giving a claim up once it met the lane host's claim strands both: the door is used
    up and a claim handed the same attempt again never pairs (an earlier rule, caught by
    this test in three timings). A claim therefore stays until it pairs, whatever its
    caller's deadline: here it pairs when the host catches up."""
    w = World()
    epoch = w.host(0)
    s = w.sender()
    host = w.start_host(0, epoch)
    w.run()  # the host waits on door (0, 0, s, 0)
    (lane0,) = host.claims
    first = s.connect(0)
    if timing == "host_slow":
        w.h.hold(lane0.client)
        w.run()
        assert w.h.sides_per_nameplate() == {first.nameplate: 2}
        assert "pake" in [m.get("phase") for m in first.client.sent]
    else:
        wanted = core.GotUnverifiedKey if timing == "host_got_pake" else core.GotVersions
        while not lane0.client.got(wanted):
            ready = w.h.deliverable()
            # The sender hears the host last; the host hears the sender's pake first.
            order = sorted(
                ready,
                key=lambda r: (r == (first.client, DOWN), r[0] is not lane0.client),
            )
            w.h.step(order[0])
            w.check()
            if timing == "host_got_pake":
                assert not lane0.client.got(core.GotVersions)
        assert not first.versions
    w.h.clock.advance(300)  # the caller's deadline passes; the claim stays
    again = first
    w.h.release(lane0.client)
    try:
        w.run()
    except AssertionError as e:
        raise NeverPairs(f"{TIMINGS[timing]}: {e}") from e
    if not again.versions:
        raise NeverPairs(f"{TIMINGS[timing]}; the host waits on {host.doors.open_doors()}")
