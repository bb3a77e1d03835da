"""The directory's pure rules (transfer.rules.directory): ids, epochs, doors, codes."""

from __future__ import annotations

import random

import pytest

from spark_dilation.transfer.rules.directory import (
    DirectoryState,
    Door,
    LaneDoors,
    LaneEpochs,
    SenderDoors,
    SenderIds,
    abort_message,
    directory_code,
    door_code,
    end_message,
    lanes_message,
    senders_message,
)

SECRET = bytes(range(32))


def test_door_codes_are_digit_nameplates_unique_per_tuple_and_per_secret() -> None:
    seen = set()
    for lane in range(3):
        for epoch in range(3):
            for sender in range(3):
                for attempt in range(3):
                    code = door_code(SECRET, lane, epoch, sender, attempt)
                    nameplate, password = code.split("-")
                    assert nameplate.isdigit() and len(nameplate) <= 40
                    assert len(password) == 32
                    seen.add(nameplate)
    assert len(seen) == 81
    assert directory_code(SECRET).split("-")[0] not in seen
    assert door_code(SECRET, 0, 0, 0, 0) != door_code(bytes(32), 0, 0, 0, 0)
    assert door_code(SECRET, 1, 2, 3, 4) == door_code(SECRET, 1, 2, 3, 4)
    with pytest.raises(ValueError):
        door_code(SECRET, 0, -1, 0, 0)


def test_sender_ids_are_never_reused_and_epochs_rise_per_lane() -> None:
    ids = SenderIds()
    assert [ids.issue() for _ in range(4)] == [0, 1, 2, 3]
    assert ids.issued == [0, 1, 2, 3]
    epochs = LaneEpochs(2)
    assert epochs.host(0) == 0
    assert epochs.host(1) == 0
    assert epochs.host(0) == 1
    assert epochs.current() == {0: 1, 1: 0}
    with pytest.raises(ValueError):
        epochs.host(2)


def test_merge_is_idempotent_and_order_free_over_seeded_shuffles() -> None:
    messages = [
        senders_message([0]),
        lanes_message({0: 0}),
        senders_message([0, 1, 2]),
        lanes_message({0: 1, 1: 0}),
        lanes_message({0: 0, 1: 2}),
        senders_message([0, 1]),
    ]
    for seed in range(50):
        rng = random.Random(seed)
        shuffled = messages + rng.sample(messages, 3)  # repeats too
        rng.shuffle(shuffled)
        state = DirectoryState()
        for m in shuffled:
            state.merge(m)
        assert state.senders == {0, 1, 2}
        assert state.epochs == {0: 1, 1: 2}


def test_merge_reports_only_what_changed_and_refuses_garbage() -> None:
    state = DirectoryState()
    assert state.merge(senders_message([1, 0])) == ({0, 1}, {})
    assert state.merge(senders_message([0, 1])) == (set(), {})
    assert state.merge(lanes_message({0: 3})) == (set(), {0: 3})
    assert state.merge(lanes_message({0: 2})) == (set(), {})  # an older epoch, late
    assert state.merge({"future": 1}) == (set(), {})
    assert state.merge(end_message("the reading application ended")) == (set(), {})
    assert state.ended == "the reading application ended"
    for bad in ({"senders": ["x"]}, {"senders": [-1]}, {"lanes": {"0": 1.5}}, {"lanes": {"a": 1}}):
        with pytest.raises(ValueError):
            DirectoryState().merge(bad)


def test_the_end_is_kept_once_set_whatever_the_order() -> None:
    """A side's half after its abort, and the other's answer, in any order with repeats:
    the first abort and the first end stay, and the directory's other state is intact."""
    messages = [
        senders_message([0]),
        {**senders_message([0, 1]), **abort_message("Ctrl-C", True)},
        {**senders_message([0, 1]), **abort_message("later", False)},  # not a new end
        {**lanes_message({0: 0}), **end_message("the sender cancelled the transfer (Ctrl-C)")},
        lanes_message({0: 0, 1: 0}),
    ]
    for seed in range(30):
        rng = random.Random(seed)
        shuffled = messages + rng.sample(messages, 2)
        rng.shuffle(shuffled)
        state = DirectoryState()
        for m in shuffled:
            state.merge(m)
        assert state.senders == {0, 1} and state.epochs == {0: 0, 1: 0}
        assert state.ended == "the sender cancelled the transfer (Ctrl-C)"
        assert state.abort is not None and state.abort["reason"] in ("Ctrl-C", "later")
        first = next(m["abort"] for m in shuffled if "abort" in m)
        assert state.abort == first
    assert DirectoryState().abort is None
    plain = DirectoryState()
    plain.merge({"abort": "not an object"})  # malformed: ignored like an unknown key
    assert plain.abort is None


def test_a_lanes_end_holds_until_a_new_host_takes_it_over_in_any_order() -> None:
    """``lanes_ended`` (the reading end's half): a lane ended at epoch e is ended while
    its epoch is e (or unknown: never hosted); a later epoch (a new host) outranks it,
    whatever order the messages come in; garbage is refused."""
    ended_at_1 = lanes_message({0: 1, 1: 0}, {0: (1, "lane 0: disk full")})
    rehosted = lanes_message({0: 2, 1: 0})
    never_hosted = lanes_message({}, {3: (0, "lane 3: no read task ran it")})
    for order in ([ended_at_1, rehosted], [rehosted, ended_at_1]):
        state = DirectoryState()
        for m in order:
            state.merge(m)
        assert state.lane_ended(0) == ""  # epoch 2 came after the end at 1
        assert state.lane_ended(1) == ""
    state = DirectoryState()
    state.merge(ended_at_1)
    state.merge(ended_at_1)
    assert state.lane_ended(0) == "lane 0: disk full" and state.lane_ended(1) == ""
    state.merge(never_hosted)
    assert state.lane_ended(3) == "lane 3: no read task ran it"
    assert lanes_message({0: 0}) == {"lanes": {"0": 0}}  # no key when nothing ended
    for bad in ({"lanes_ended": {"0": "x"}}, {"lanes_ended": {"0": {"epoch": -1}}}):
        with pytest.raises(ValueError):
            DirectoryState().merge(bad)


def test_lane_doors_follow_the_lane_table() -> None:
    doors = LaneDoors(lane=1, epoch=2)
    assert doors.learn({0, 1}) == [Door(1, 2, 0, 0), Door(1, 2, 1, 0)]
    assert doors.learn({0, 1}) == []  # already open
    assert doors.paired(Door(1, 2, 0, 0)) == Door(1, 2, 0, 1)
    assert doors.paired(Door(1, 2, 0, 0)) is None  # used once
    assert doors.paired(Door(1, 1, 1, 0)) is None  # another epoch's door
    assert doors.open_doors() == [Door(1, 2, 0, 1), Door(1, 2, 1, 0)]
    # A stranger on a door uses it up as a pairing does: the sender moves on too.
    assert doors.spoiled(Door(1, 2, 1, 0)) == Door(1, 2, 1, 1)
    assert doors.spoiled(Door(1, 2, 1, 0)) is None
    assert doors.open_doors() == [Door(1, 2, 0, 1), Door(1, 2, 1, 1)]


def test_sender_doors_follow_the_sender_table() -> None:
    s = SenderDoors(sender=7)
    assert s.epochs({1: 0}) == {}  # lane 1 not used yet: only recorded
    assert s.want(0) is None  # no epoch for lane 0 yet: wait for the push
    assert s.epochs({0: 0}) == {0: 0}  # lane 0 is used here: claims at older epochs are stale
    first, second = s.want(0), s.want(0)  # two connections (two pools): two doors
    assert (first, second) == (Door(0, 0, 7, 0), Door(0, 0, 7, 1))
    assert s.paired(first)
    assert s.epochs({0: 1}) == {0: 1}  # re-hosted: attempts start again at the new epoch
    assert not s.paired(second)  # a claim at the old epoch is stale
    assert s.want(0) == Door(0, 1, 7, 0)
    assert s.epochs({0: 1}) == {} and s.epoch(0) == 1


def test_lane_and_sender_doors_agree_over_seeded_connection_orders() -> None:
    """However many connections one process makes and in whatever order the lane pairs
    them, every claim lands on the lane's open door or one it opens later, and the
    lane's open door is always claimed when any claim waits: no claim is ever stranded."""
    for seed in range(200):
        rng = random.Random(seed)
        sender, lane = SenderDoors(3), LaneDoors(0, 0)
        sender.epochs({0: 0})
        lane.learn({3})
        waiting: list[Door] = []
        paired = 0
        for _ in range(40):
            if rng.random() < 0.5:
                door = sender.want(0)
                assert door is not None
                waiting.append(door)
            else:
                (open_door,) = lane.open_doors()
                if open_door in waiting:  # the lane's open door has its claimer: they pair
                    waiting.remove(open_door)
                    assert sender.paired(open_door)
                    lane.paired(open_door)
                    paired += 1
            (open_door,) = lane.open_doors()
            assert all(d.attempt >= open_door.attempt for d in waiting), (seed, waiting)
            assert not waiting or open_door in waiting, (seed, waiting, open_door)
        assert paired + len(waiting) == sender._next[0]  # every attempt handed out is accounted


def test_both_sides_derive_the_same_door_so_exactly_two_claim_it() -> None:
    """A lane host and a sender that learnt each other from the directory meet on one door."""
    writer, reader = SenderIds(), LaneEpochs(2)
    senders = [SenderDoors(writer.issue()) for _ in range(3)]
    reader_view, writer_view = DirectoryState(), DirectoryState()
    epoch = reader.host(1)
    _, risen = writer_view.merge(lanes_message(reader.current()))
    new, _ = reader_view.merge(senders_message(writer.issued))
    lane = LaneDoors(1, epoch)
    lane_side = {d.code(SECRET) for d in lane.learn(new)}
    for s in senders:
        s.epochs(risen)
    sender_side = [s.want(1).code(SECRET) for s in senders]  # type: ignore[union-attr]
    assert sorted(sender_side) == sorted(lane_side)
    assert len(set(sender_side)) == 3
