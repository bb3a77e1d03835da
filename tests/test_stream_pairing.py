"""A stream's pairing survives restarts: the record, and meeting again with no code.

The rule (``spark_dilation.transfer.rules.pairing``) is checked alone, then
driven end to end against the real mailbox server code (tests/mailbox_harness.py):
each run of a side is a ``StandingMailbox`` client plus a ``Meeting``, and a
seeded schedule kills, restarts and disconnects runs, and lets the server
prune, at any point between frames. After every frame no nameplate or
mailbox may hold more than two sides; when the schedule stops killing, the
two live runs must agree on the pair of their own incarnations.
"""

from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path

import pytest
from mailbox_harness import Client, Harness

from spark_dilation.transfer.meet.record import load_record, revoke_record, save_record
from spark_dilation.transfer.rules.pairing import (
    RECEIVER,
    SENDER,
    STREAM_APPID,
    Meeting,
    Pair,
    PairingError,
    PairingRecord,
    hello,
    new_record,
    revocation,
    seal,
)
from spark_dilation.transfer.rules.states import MeetingState
from spark_dilation.wormhole import core
from spark_dilation.wormhole.standing import GotPosted, StandingMailbox

KEY = bytes(range(32))  # the wormhole key both sides confirmed on the first run
PRUNE_OLD = 11 * 60  # the server's "old" (server.py, AppNamespace.prune)


def pairing() -> tuple[PairingRecord, PairingRecord]:
    return (
        new_record(KEY, SENDER, "ws://mailbox", side="5e0de50000"),
        new_record(KEY, RECEIVER, "ws://mailbox", side="0ece170000"),
    )


# --- the record ---------------------------------------------------------------------


def test_both_sides_derive_one_pairing_and_different_sides() -> None:
    s, r = pairing()
    assert s.secret == r.secret and s.stream == r.stream and s.nameplate == r.nameplate
    assert s.secret != KEY and len(s.secret) == 32
    assert s.nameplate.isdigit() and len(s.nameplate) <= 40  # the server's nameplate rule
    assert (s.peer_role, r.peer_role) == (RECEIVER, SENDER)
    other = new_record(bytes(32), SENDER, "ws://mailbox")
    assert other.secret != s.secret and other.nameplate != s.nameplate


def test_the_record_is_private_and_round_trips(tmp_path: Path) -> None:
    s, _ = pairing()
    s = replace(s.next_run(), schema="c2NoZW1h")
    path = tmp_path / "q" / "stream.pairing"
    assert load_record(path) is None  # the first run: nothing paired yet
    save_record(path, s)
    assert path.stat().st_mode & 0o777 == 0o600
    assert load_record(path) == s
    path.chmod(0o644)
    with pytest.raises(PairingError, match="can be read by other users"):
        load_record(path)
    path.chmod(0o600)
    assert revoke_record(path, "laptop lost").revoked == "laptop lost"
    with pytest.raises(PairingError, match=r"revoked \(laptop lost\)"):
        load_record(path).next_run()  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "text",
    ["not json", "{}", json.dumps({"version": 9}), json.dumps({"version": 1, "secret": "!!"})],
)
def test_a_bad_record_is_one_line(text: str) -> None:
    with pytest.raises(PairingError) as e:
        PairingRecord.from_json(text, "/q/stream.pairing")
    assert "/q/stream.pairing is not a spark-dilation pairing record" in str(e.value)
    assert "\n" not in str(e.value)


def test_a_revoked_record_starts_no_run() -> None:
    s, _ = pairing()
    with pytest.raises(PairingError, match="revoked"):
        replace(s, revoked="by the user").next_run()


# --- the meeting rule alone -------------------------------------------------------------


def run(record: PairingRecord) -> tuple[PairingRecord, Meeting]:
    record = record.next_run()
    return record, Meeting(record)


def test_runs_pair_by_their_incarnations_whoever_starts_first() -> None:
    s0, r0 = pairing()
    s1, sm = run(s0)
    r1, rm = run(r0)
    assert sm.pair is None and sm.state is MeetingState.WAITING
    heard = sm.heard(r1.side, *hello(r1))
    assert heard.pair == Pair(1, 1)
    assert rm.heard(s1.side, *hello(s1)).pair == Pair(1, 1)
    # The receiver restarts twice; its first restart's hello is replayed late.
    r2, r3 = r1.next_run(), r1.next_run().next_run()
    assert sm.heard(r3.side, *hello(r3)).pair == Pair(1, 3)
    assert sm.heard(r2.side, *hello(r2)).pair is None and sm.pair == Pair(1, 3)
    assert sm.heard(r1.side, *hello(r1)).pair is None  # the first, replayed on open
    # Only the current pair's phases are the connection's.
    assert sm.accepts(Pair(1, 3).phase("dilate-0")) == "dilate-0"
    assert sm.accepts(Pair(1, 1).phase("dilate-0")) is None


def test_own_echoes_are_nothing_and_a_later_own_run_ends_this_one() -> None:
    s0, _ = pairing()
    s1, sm = run(s0)
    assert sm.heard(s1.side, *hello(s1)).pair is None  # its own echo
    assert sm.heard(s0.side, *hello(replace(s0, incarnation=0))).ended is None
    ended = sm.heard(s1.side, *hello(s1.next_run())).ended
    assert ended is not None and "a later run of this stream's sender started" in str(ended)
    assert sm.state is MeetingState.SUPERSEDED and sm.pair is None


def test_a_body_without_the_secret_is_ignored() -> None:
    s0, r0 = pairing()
    _, sm = run(s0)
    forged = seal(bytes(32), r0.side, "hello-5", {"role": RECEIVER, "incarnation": 5})
    assert sm.heard(r0.side, "hello-5", forged).pair is None
    assert sm.heard(r0.side, "hello-5", b"garbled").pair is None
    phase, body = hello(replace(r0, incarnation=5))
    assert sm.heard(r0.side, "hello-6", body).pair is None  # moved to another phase
    assert sm.heard(r0.side, phase, body).pair == Pair(1, 5)


def test_revoking_ends_either_sides_run_with_the_reason() -> None:
    s0, r0 = pairing()
    _, sm = run(s0)
    _, rm = run(r0)
    sm.heard(r0.side, *hello(r0.next_run()))
    ended = sm.heard(r0.side, *revocation(r0, "laptop lost")).ended
    assert str(ended) == (
        "the receiver revoked this stream's pairing: laptop lost; pair again with a new code"
    )
    assert sm.state is MeetingState.REVOKED and sm.pair is None
    assert "this side revoked" in str(rm.heard(r0.side, *revocation(r0, "")).ended)


# --- meeting again on the real server ------------------------------------------------------


class Side:
    """One side of the stream across runs: its record on 'disk', its live run if any."""

    def __init__(self, h: Harness, record: PairingRecord, fresh_sides: bool = False) -> None:
        self.h, self.disk, self.fresh_sides = h, record, fresh_sides
        self.client: Client | None = None
        self.meeting: Meeting | None = None
        self.ended: list[PairingError] = []

    def start(self) -> None:
        self.disk = self.disk.next_run()  # written before anything is posted
        if self.fresh_sides:  # what a run that took a new side each time would do
            self.disk = replace(self.disk, side=f"{self.disk.role[:4]}{self.disk.incarnation:06d}")
        self.meeting = Meeting(self.disk)
        mailbox = StandingMailbox(STREAM_APPID, self.disk.side, self.disk.nameplate)
        self.client = Client(self.h, f"{self.disk.role}-{self.disk.incarnation}", mailbox)
        self.client.feed = self._feed  # type: ignore[method-assign]
        self.h.clients.append(self.client)
        self.client.connect()
        self.client.feed(mailbox.keep(*hello(self.disk)))

    def kill(self) -> None:
        """SIGKILL: the connection drops; nothing is released or closed."""
        assert self.client is not None
        self.client.disconnect()
        self.h.clients.remove(self.client)
        self.client = self.meeting = None

    def _feed(self, events: list) -> None:
        client = self.client
        assert client is not None and self.meeting is not None
        for e in events:
            if isinstance(e, core.SendFrame):
                client.up.append((next(self.h._seq), e.payload))
            elif isinstance(e, GotPosted):
                heard = self.meeting.heard(e.side, e.phase, e.body)
                if heard.ended is not None:
                    self.ended.append(heard.ended)
            else:
                client.events.append(e)

    @property
    def pair(self) -> Pair | None:
        return self.meeting.pair if self.meeting is not None else None


def world(seed: int, fresh_sides: bool = False) -> tuple[Harness, Side, Side]:
    h = Harness(appid=STREAM_APPID, seed=seed)
    s, r = pairing()
    return h, Side(h, s, fresh_sides), Side(h, r, fresh_sides)


def play(seed: int, fresh_sides: bool = False) -> tuple[Harness, Side, Side]:
    """A seeded schedule of frames, kills, restarts, reconnects and prunes; then quiet."""
    rng = random.Random(seed)
    h, sender, receiver = world(seed, fresh_sides)
    sides = (sender, receiver)
    for side in rng.sample(sides, 2):
        side.start()
    for _ in range(rng.randrange(20, 120)):
        roll = rng.random()
        side = rng.choice(sides)
        client = side.client
        if roll < 0.07 and client is not None:
            side.kill()
        elif roll < 0.14 and client is None:
            side.start()
        elif roll < 0.18 and client is not None:
            # A dropped connection: the run lives on and reconnects (now or later).
            client.disconnect() if client.connected else client.connect()
        elif roll < 0.21 and not any(x.client and x.client.connected for x in sides):
            h.clock.advance(PRUNE_OLD + 60)  # nobody listening long enough: the server prunes
            h.server.prune_all_apps(now=h.clock.seconds(), old=h.clock.seconds() - PRUNE_OLD)
        elif h.deliverable():
            h.step(rng.choice(h.deliverable()))
        h.check_at_most_two_sides()
    for side in sides:
        if side.client is None:
            side.start()
        elif not side.client.connected:
            side.client.connect()
    h.run_random(seed, check=h.check_at_most_two_sides)
    return h, sender, receiver


@pytest.mark.parametrize("seed", range(200))
def test_runs_meet_again_whatever_kills_restarts_and_prunes_come_between(seed: int) -> None:
    h, sender, receiver = play(seed)
    want = Pair(sender.disk.incarnation, receiver.disk.incarnation)
    assert sender.pair == want and receiver.pair == want, (sender.pair, receiver.pair, want)
    assert not sender.ended and not receiver.ended
    sides = {s["side"] for s in h.db.execute("SELECT side FROM nameplate_sides").fetchall()}
    assert sides <= {sender.disk.side, receiver.disk.side}


def test_a_fresh_side_per_run_would_crowd_the_server() -> None:
    """Why the side is fixed: a killed run's claim stays, and two restarts crowd it."""
    crowded = 0
    for seed in range(40):
        try:
            play(seed, fresh_sides=True)
        except AssertionError as e:
            crowded += "more than two sides" in str(e)
    assert crowded > 0


def test_a_second_run_of_one_side_ends_the_first() -> None:
    h, sender, receiver = world(0)
    sender.start()
    receiver.start()
    h.run_until_quiet()
    first = sender.meeting
    second = Side(h, sender.disk)  # the same query started again from its record
    second.start()
    h.run_until_quiet(check=h.check_at_most_two_sides)
    assert first is not None and first.state is MeetingState.SUPERSEDED
    assert "a later run of this stream's sender started (run 2, this is run 1)" in str(
        sender.ended[0]
    )
    assert second.pair == receiver.pair == Pair(2, 1)


def test_a_revocation_reaches_the_peers_next_run() -> None:
    h, sender, receiver = world(1)
    sender.start()
    receiver.start()
    h.run_until_quiet()
    assert sender.client is not None
    sender.client.feed(sender.client.core.post(*revocation(sender.disk, "rotated")))
    h.run_until_quiet()
    receiver.kill()
    receiver.start()  # its next run hears the revocation in the mailbox's history
    h.run_until_quiet()
    assert receiver.pair is None
    assert "the sender revoked this stream's pairing: rotated" in str(receiver.ended[-1])


def test_closing_gives_up_the_nameplate_and_the_mailbox() -> None:
    h, sender, receiver = world(2)
    sender.start()
    receiver.start()
    h.run_until_quiet()
    for side in (sender, receiver):
        assert side.client is not None
        side.client.feed(side.client.core.close())
    h.run_until_quiet()
    assert h.empty()
    assert [e.error for e in sender.client.events if isinstance(e, core.Closed)] == [None]
