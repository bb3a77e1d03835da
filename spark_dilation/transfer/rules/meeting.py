"""A meeting at a door, seen from each side (pure: no I/O, no clock, no threads).

:mod:`.directory` says which door each side claims. This module says what the
end of one claim means (:func:`claim_outcome`) and what each side does next:
a sending process's connection to a lane (:class:`SenderMeeting`, the
``sender meeting`` table) and a lane host's door for one sender
(:class:`LaneDoor`, the ``lane door`` table; tables in :mod:`.states`).

The blocking glue asks these and does what they say: ``meet()`` classifies a
claim's end, the connection pool's meeting thread (``send/pool.py``) and a
lane's door threads (``receive/lane.py``) step the machines. The
deterministic harness (``tests/test_rendezvous_scenarios.py``) drives the same
objects with wormhole cores against the real mailbox server code, so the
rules it proves are the ones the product runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

from ...errors import CrowdedError, TransferError, WrongCodeError
from .directory import DirectoryState, Door, LaneDoors, SenderDoors
from .protocol import PROTOCOL, ROLE_LANE, ROLE_SENDER, VERSION
from .states import (
    LANE_DOOR,
    SENDER_MEETING,
    DoorEvent,
    DoorState,
    Meet,
    MeetEvent,
)

ROLE_READER = "reader"  # the reading end of the directory link
ROLE_WRITER = "writer"  # the writing end of the directory link
OTHER_ROLE = {ROLE_SENDER: ROLE_LANE, ROLE_LANE: ROLE_SENDER}
OTHER_ROLE.update({ROLE_READER: ROLE_WRITER, ROLE_WRITER: ROLE_READER})


class Outcome(Enum):
    """How one claim ended."""

    PAIRED = "paired"  # the peer the directory sent: its versions name our door
    SPOILED = "spoiled"  # a stranger on the door: crowded, or a PAKE that did not confirm
    NOT_OURS = "not ours"  # a confirmed peer the directory did not send
    CANCELLED = "cancelled"  # the caller stopped waiting (stale, stopped)
    FAILED = "failed"  # anything else (the server refused, a deadline): the error decides


def meeting_versions(transfer_id: str, role: str, door: Door | None) -> dict[str, Any]:
    """``app_versions`` of a door (or directory link) wormhole: who we are and which door."""
    entry: dict[str, Any] = {"version": VERSION, "transfer": transfer_id, "role": role}
    if door is not None:
        entry.update(lane=door.lane, epoch=door.epoch, sender=door.sender, attempt=door.attempt)
    return {PROTOCOL: entry}


def check_peer(ours: dict[str, Any], theirs: Any) -> str:
    """Why the peer is not the one the directory sent ("" if it is)."""
    a, b = ours[PROTOCOL], theirs.get(PROTOCOL) if isinstance(theirs, dict) else None
    if not isinstance(b, dict):
        return "the peer is not a spark-dilation process"
    if b.get("role") != OTHER_ROLE[a["role"]]:
        return f"the peer's role is {b.get('role')!r}, not {OTHER_ROLE[a['role']]!r}"
    for key in ("transfer", "lane", "epoch", "sender", "attempt"):
        if a.get(key) != b.get(key):
            return f"the peer names {key} {b.get(key)!r}, not {a.get(key)!r}"
    return ""


def claim_outcome(
    ours: dict[str, Any],
    *,
    theirs: Any = None,
    error: BaseException | None = None,
    at_door: bool = True,
) -> tuple[Outcome, str]:
    """The end of one claim: the peer's confirmed versions (``theirs``) or the error the
    wormhole ended with. Returns the outcome and, unless PAIRED, why.

    Only two sides ever claim a door, so a crowded door or a wrong code there is a
    stranger: SPOILED. On the directory link (``at_door`` False) they are failures.
    """
    if error is not None:
        if at_door and isinstance(error, CrowdedError | WrongCodeError):
            return Outcome.SPOILED, str(error)
        return Outcome.FAILED, str(error)
    problem = check_peer(ours, theirs)
    return (Outcome.NOT_OURS, problem) if problem else (Outcome.PAIRED, "")


class MeetingEnded(TransferError):
    """A sender's meeting cannot go on: the transfer ended, or its lane ended for good."""


class Step(Enum):
    """What a sender's meeting does after a claim ended."""

    DILATE = "dilate"  # paired with the lane's current host
    NEXT = "next door"  # claim the door :meth:`SenderMeeting.next_door` hands out
    CLOSE_NEXT = "close, next door"  # close the stale pairing's wormhole first
    STOP = "stop"  # the caller stopped: the meeting ends quietly
    FAIL = "fail"  # raise the claim's error


@dataclass
class SenderMeeting:
    """One connection of a sending process to one lane (the ``sender meeting`` table).

    ``directory`` and ``doors`` are the process's, shared by its meetings (the
    caller serializes calls on them). ``reported`` keeps the last door the lane's
    side found a stranger on, for a deadline's message.
    """

    lane: int
    directory: DirectoryState
    doors: SenderDoors
    what: str = "a partition"
    state: Meet = Meet.WAITING
    door: Door | None = None
    reported: Door | None = None

    def _to(self, event: MeetEvent) -> None:
        self.state = SENDER_MEETING.next(self.state, event)

    def ended(self) -> str:
        """Why no door can be claimed any more ("" while one can)."""
        if self.directory.ended:  # first: an ended transfer hands out no attempt
            return f"{self.what}: {self.directory.ended}"
        if why := self.directory.lane_ended(self.lane):
            return f"{self.what} ended on the receiver, with no new host: {why}"
        return ""

    def next_door(self) -> Door | None:
        """WAITING: the door to claim now, or None while the lane's epoch is unknown (wait
        for the directory). Raises :class:`MeetingEnded` if the transfer or the lane ended."""
        if why := self.ended():
            self._to(MeetEvent.ENDED)
            raise MeetingEnded(why)
        door = self.doors.want(self.lane)
        if door is not None:
            self._to(MeetEvent.DOOR)
            self.door = door
        return door

    def stale(self, stopped: bool = False) -> bool:
        """CLAIMING: give the claim up now? The caller stopped, the lane's epoch rose (its
        new host opens a new door), the transfer or the lane ended (nobody will come), or
        the lane's side found a stranger on the door (the directory said so)."""
        assert self.door is not None
        return (
            stopped
            or self.doors.epoch(self.lane) != self.door.epoch
            or self.door in self.directory.spoiled
            or bool(self.ended())
        )

    def claimed(self, outcome: Outcome, stopped: bool = False) -> Step:
        """CLAIMING: the claim ended with ``outcome`` (``stopped``: the caller stopped it);
        what the caller does now."""
        assert self.door is not None
        match outcome:
            case Outcome.PAIRED if self.doors.paired(self.door):
                self._to(MeetEvent.PAIRED)
                return Step.DILATE
            case Outcome.PAIRED:  # the epoch rose meanwhile: its host is gone
                self._to(MeetEvent.STALE)
                return Step.CLOSE_NEXT
            case Outcome.SPOILED:  # it costs this attempt: the lane moves on too
                self._to(MeetEvent.SPOILED)
                return Step.NEXT
            case Outcome.CANCELLED if not stopped and self.door in self.directory.spoiled:
                self.reported = self.door  # the lane saw a stranger there: as if we had
                self._to(MeetEvent.SPOILED)
                return Step.NEXT
            case Outcome.CANCELLED if not stopped:  # the lane was re-hosted: its new door
                self._to(MeetEvent.STALE)
                return Step.NEXT
            case Outcome.CANCELLED:
                self._to(MeetEvent.ENDED)
                return Step.STOP
            case _:
                self._to(MeetEvent.ENDED)
                return Step.FAIL


class LaneStep(Enum):
    """What a lane's door does after a claim ended."""

    NEXT = "next door"  # wait at the sender's next door (a pairing also keeps the connection)
    LEAVE = "leave"  # stop waiting for this sender (stopped; a peer that is not ours)
    FAIL = "fail"  # the lane fails with the claim's error


@dataclass
class LaneDoor:
    """A lane host's door for one sender (the ``lane door`` table); ``doors`` is the
    host's (the caller serializes calls on it)."""

    doors: LaneDoors
    door: Door
    state: DoorState = DoorState.OPEN

    def claimed(self, outcome: Outcome) -> LaneStep:
        """The claim on :attr:`door` ended with ``outcome``; :attr:`door` is the next one.
        A claim given up because the senders' side found a stranger on the door (the
        directory's ``spoiled``) is a spoiled door here too."""
        if outcome is Outcome.CANCELLED and self.door in self.doors.reported:
            outcome = Outcome.SPOILED
        event = {
            Outcome.PAIRED: DoorEvent.PAIRED,
            Outcome.SPOILED: DoorEvent.SPOILED,
            Outcome.NOT_OURS: DoorEvent.NOT_OURS,
            Outcome.CANCELLED: DoorEvent.STOPPED,
            Outcome.FAILED: DoorEvent.FAILED,
        }[outcome]
        self.state = LANE_DOOR.next(self.state, event)
        if self.state is DoorState.CLOSED:
            return LaneStep.FAIL if event is DoorEvent.FAILED else LaneStep.LEAVE
        nxt = (self.doors.paired if outcome is Outcome.PAIRED else self.doors.spoiled)(self.door)
        if nxt is None:  # a door the host no longer keeps (never: one thread per sender)
            self.state = LANE_DOOR.next(self.state, DoorEvent.STOPPED)
            return LaneStep.LEAVE
        self.door = nxt
        return LaneStep.NEXT


__all__ = [
    "OTHER_ROLE",
    "ROLE_READER",
    "ROLE_WRITER",
    "LaneDoor",
    "LaneStep",
    "MeetingEnded",
    "Outcome",
    "SenderMeeting",
    "Step",
    "check_peer",
    "claim_outcome",
    "meeting_versions",
]
