"""A door's meeting on each side (rules/meeting.py): how a claim ended, and what the
sender's connection and the lane's door do next, step by step (pure)."""

from __future__ import annotations

import pytest

from spark_dilation.errors import CrowdedError, ServerError, WrongCodeError
from spark_dilation.transfer.rules.directory import (
    DirectoryState,
    Door,
    LaneDoors,
    SenderDoors,
    lanes_message,
    spoiled_doors,
    spoiled_message,
)
from spark_dilation.transfer.rules.meeting import (
    LaneDoor,
    LaneStep,
    MeetingEnded,
    Outcome,
    SenderMeeting,
    Step,
    claim_outcome,
    meeting_versions,
)
from spark_dilation.transfer.rules.states import DoorState, Meet

T = "ab" * 16


def sender(lanes: dict[int, int] | None = None) -> SenderMeeting:
    state, doors = DirectoryState(), SenderDoors(7)
    _, risen = state.merge(lanes_message(lanes if lanes is not None else {0: 0}))
    doors.epochs(risen)
    return SenderMeeting(0, state, doors, "lane 0")


def rehost(m: SenderMeeting, epoch: int) -> None:
    _, risen = m.directory.merge(lanes_message({0: epoch}))
    m.doors.epochs(risen)


def test_how_a_claim_ended() -> None:
    ours = meeting_versions(T, "sender", Door(0, 0, 7, 0))
    theirs = meeting_versions(T, "lane", Door(0, 0, 7, 0))
    assert claim_outcome(ours, theirs=theirs) == (Outcome.PAIRED, "")
    other = meeting_versions(T, "lane", Door(0, 0, 7, 1))
    outcome, why = claim_outcome(ours, theirs=other)
    assert outcome is Outcome.NOT_OURS and "attempt 1" in why
    assert claim_outcome(ours, theirs={})[0] is Outcome.NOT_OURS
    crowded = CrowdedError({"type": "claim"})
    assert claim_outcome(ours, error=crowded)[0] is Outcome.SPOILED
    assert claim_outcome(ours, error=WrongCodeError())[0] is Outcome.SPOILED
    # On the directory link a third side is not a stranger's door: a failure.
    assert claim_outcome(ours, error=crowded, at_door=False)[0] is Outcome.FAILED
    assert claim_outcome(ours, error=ServerError("nope", {}))[0] is Outcome.FAILED


def test_a_sender_waits_for_the_epoch_then_claims_attempts_in_order() -> None:
    m = sender(lanes={})
    assert m.next_door() is None and m.state is Meet.WAITING
    rehost(m, 0)
    assert m.next_door() == Door(0, 0, 7, 0) and m.state is Meet.CLAIMING
    assert m.claimed(Outcome.SPOILED) is Step.NEXT  # a stranger: the next attempt
    assert m.next_door() == Door(0, 0, 7, 1)
    assert m.claimed(Outcome.PAIRED) is Step.DILATE and m.state is Meet.MET


def test_a_stopped_claim_stops_and_a_stale_one_moves_to_the_new_epoch() -> None:
    m = sender()
    m.next_door()
    assert not m.stale()
    assert m.stale(stopped=True)
    assert m.claimed(Outcome.CANCELLED, stopped=True) is Step.STOP
    assert m.state is Meet.ENDED
    m = sender()
    m.next_door()
    rehost(m, 1)
    assert m.stale()
    assert m.claimed(Outcome.CANCELLED) is Step.NEXT
    assert m.next_door() == Door(0, 1, 7, 0)


def test_a_pairing_on_a_door_whose_epoch_rose_is_closed() -> None:
    m = sender()
    m.next_door()
    rehost(m, 1)
    assert m.claimed(Outcome.PAIRED) is Step.CLOSE_NEXT
    assert m.next_door() == Door(0, 1, 7, 0)


@pytest.mark.parametrize("outcome", [Outcome.NOT_OURS, Outcome.FAILED])
def test_a_claim_that_failed_fails_the_meeting(outcome: Outcome) -> None:
    m = sender()
    m.next_door()
    assert m.claimed(outcome) is Step.FAIL and m.state is Meet.ENDED


def test_an_ended_transfer_or_lane_hands_out_no_door() -> None:
    m = sender()
    m.directory.merge({"end": "the receiver aborted"})
    with pytest.raises(MeetingEnded, match="lane 0: the receiver aborted"):
        m.next_door()
    m = sender()
    m.next_door()
    m.directory.merge(lanes_message({0: 0}, {0: (0, "its disk is full")}))
    assert m.stale()  # nobody will come to the door
    assert m.claimed(Outcome.CANCELLED) is Step.NEXT
    with pytest.raises(MeetingEnded, match="no new host: its disk is full"):
        m.next_door()


def test_a_door_the_lane_found_spoiled_is_given_up_as_spoiled() -> None:
    """A stranger the sender never saw (the lane was crowded out, or got a wrong code):
    the directory's ``spoiled`` reaches the sender, its claim is stale, and the meeting
    moves to the next attempt as if it had seen the stranger itself."""
    m = sender()
    door = m.next_door()
    assert door is not None
    message = spoiled_message({door})
    assert spoiled_doors(message) == {door}
    m.directory.merge(message)
    assert m.stale()
    assert m.claimed(Outcome.CANCELLED) is Step.NEXT
    assert m.reported == door
    assert m.next_door() == Door(0, 0, 7, 1)


def test_malformed_spoiled_doors_are_refused() -> None:
    for bad in ([[0, 0, 7]], [[0, 0, 7, -1]], ["0,0,7,1"]):
        with pytest.raises(ValueError):
            spoiled_doors({"spoiled": bad})


def test_a_lane_door_moves_on_after_a_pairing_or_a_stranger() -> None:
    doors = LaneDoors(0, 0)
    (first,) = doors.learn({7})
    d = LaneDoor(doors, first)
    assert d.claimed(Outcome.PAIRED) is LaneStep.NEXT and d.door.attempt == 1
    assert d.claimed(Outcome.SPOILED) is LaneStep.NEXT and d.door.attempt == 2
    assert doors.open_doors() == [Door(0, 0, 7, 2)]
    # The senders' side found a stranger on door 2: the claim is given up, as spoiled.
    assert doors.report({Door(0, 0, 7, 2), Door(0, 0, 7, 0), Door(0, 1, 7, 2)}) == [d.door]
    assert d.claimed(Outcome.CANCELLED) is LaneStep.NEXT and d.door.attempt == 3
    assert d.state is DoorState.OPEN


@pytest.mark.parametrize(
    ("outcome", "step"),
    [
        (Outcome.CANCELLED, LaneStep.LEAVE),
        (Outcome.NOT_OURS, LaneStep.LEAVE),
        (Outcome.FAILED, LaneStep.FAIL),
    ],
)
def test_a_lane_door_closes_when_stopped_or_failed(outcome: Outcome, step: LaneStep) -> None:
    doors = LaneDoors(0, 0)
    (first,) = doors.learn({7})
    d = LaneDoor(doors, first)
    assert d.claimed(outcome) is step and d.state is DoorState.CLOSED
