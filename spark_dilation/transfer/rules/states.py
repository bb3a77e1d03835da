"""The states of the transfer's machines, as tables (pure, h11 style).

Each machine is an enum of states, an enum of events and one table of
``(state, event) -> next state``: every legal transition is a row, and
:meth:`Table.next` is the one place a state changes. An event with no row
for the current state raises :class:`IllegalTransition`, which names both.
``docs/transfer.md`` shows the same tables; a test checks them against these.

* :data:`LANE`: one lane's receiver (:class:`~..receive.lane.LaneReceiver`).
* :data:`SENDER_TASK`: one partition attempt on the sending side
  (:func:`~..send.pool.stream_partition`).
* :data:`REGISTRY_LANE`: where a lane of a loaded dataset lives, in the
  reading application's registry (:class:`~.registry.LaneRegistry`).
* :data:`STREAM_MEETING`: one run of a stream's side on its standing mailbox
  (:class:`~.pairing.Meeting`).
* :data:`BATCH`: one micro-batch of a stream on the receiving side
  (:class:`~.ledger.ReceiverLedger`).
* :data:`SENDER_MEETING`: one connection of a sending process to a lane
  (:class:`~.meeting.SenderMeeting`).
* :data:`LANE_DOOR`: a lane host's door for one sender (:class:`~.meeting.LaneDoor`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Generic, TypeVar

S = TypeVar("S", bound=Enum)
E = TypeVar("E", bound=Enum)


class IllegalTransition(RuntimeError):
    """An event the machine's table has no row for in its current state (a bug)."""

    def __init__(self, machine: str, state: Enum, event: Enum) -> None:
        super().__init__(f"{machine}: event {event.name} is not allowed in state {state.name}")
        self.machine, self.state, self.event = machine, state, event


@dataclass(frozen=True)
class Table(Generic[S, E]):
    """One machine's transitions; :meth:`next` applies them."""

    name: str
    initial: S
    rows: Mapping[tuple[S, E], S]
    terminal: frozenset[S] = frozenset()

    def next(self, state: S, event: E) -> S:
        try:
            return self.rows[(state, event)]
        except KeyError:
            raise IllegalTransition(self.name, state, event) from None

    def allowed(self, state: S) -> list[E]:
        return [e for (s, e) in self.rows if s == state]

    def markdown(self) -> str:
        """The table as docs/transfer.md shows it (one row per state)."""
        lines = ["| state | event | next |", "|---|---|---|"]
        events = {e for (_, e) in self.rows}
        absorbing = {s for s in self.terminal if all(self.rows.get((s, e)) == s for e in events)}
        for (state, event), target in self.rows.items():
            if state not in absorbing:
                lines.append(f"| {state.name} | {event.name} | {target.name} |")
        lines += [f"| {state.name} | any | {state.name} |" for state in sorted(absorbing, key=str)]
        return "\n".join(lines)

    def __iter__(self) -> Iterator[tuple[S, E, S]]:
        return ((s, e, t) for (s, e), t in self.rows.items())


def _absorbing(states: frozenset[S], events: type[E]) -> dict[tuple[S, E], S]:
    """Every event leaves a terminal state as it is (the first end wins)."""
    return {(s, e): s for s in states for e in events}


# --- a lane's receiver ---------------------------------------------------------------


class Lane(Enum):
    RECEIVING = "receiving"  # doors open, partition streams accepted
    FAILING = "failing"  # a partition could not be staged: streams and manifest get "E"
    STAGED = "staged"  # manifest + every partition staged; the receiver writes out
    DONE = "done"
    FAILED = "failed"


class LaneEvent(Enum):
    STAGING_FAILED = "staging failed"  # disk full, no permission (the first cause is kept)
    ALL_STAGED = "all staged"  # an in-process receiver's lane, waiting in before_ok
    COMPLETED = "completed"  # the lane ends with every partition (manifest answered)
    ENDED = "ended"  # the lane ends with an error (abort, cannot heal, idle, own failure)


LANE: Table[Lane, LaneEvent] = Table(
    "lane",
    Lane.RECEIVING,
    {
        (Lane.RECEIVING, LaneEvent.STAGING_FAILED): Lane.FAILING,
        (Lane.RECEIVING, LaneEvent.ALL_STAGED): Lane.STAGED,
        (Lane.RECEIVING, LaneEvent.COMPLETED): Lane.DONE,
        (Lane.RECEIVING, LaneEvent.ENDED): Lane.FAILED,
        (Lane.FAILING, LaneEvent.STAGING_FAILED): Lane.FAILING,
        # Every partition staged after all (another attempt of the one that failed).
        (Lane.FAILING, LaneEvent.COMPLETED): Lane.DONE,
        (Lane.FAILING, LaneEvent.ENDED): Lane.FAILED,
        # A late duplicate attempt that could not be staged: the lane has its rows.
        (Lane.STAGED, LaneEvent.STAGING_FAILED): Lane.STAGED,
        (Lane.STAGED, LaneEvent.ALL_STAGED): Lane.STAGED,  # a manifest delivered again
        (Lane.STAGED, LaneEvent.COMPLETED): Lane.DONE,
        (Lane.STAGED, LaneEvent.ENDED): Lane.FAILED,
        **_absorbing(frozenset({Lane.DONE, Lane.FAILED}), LaneEvent),
    },
    frozenset({Lane.DONE, Lane.FAILED}),
)


# --- a sender task's partition attempt -------------------------------------------------


class Task(Enum):
    CONNECTING = "connecting"  # a connection to the lane (pooled, or a new meeting)
    STREAMING = "streaming"  # header and data on the partition's subchannel
    AWAITING_COMPLETE = "awaiting complete"  # trailer sent; the lane checks and renames
    COMMITTED = "committed"  # "C": the task may succeed
    FAILED = "failed"  # the lane drops the attempt (no trailer, or "E")


class TaskEvent(Enum):
    OPENED = "opened"  # the partition's subchannel is open
    TRAILER_SENT = "trailer sent"
    COMPLETE = "complete"  # the lane's "C"
    FAILED = "failed"  # an error, "E", a deadline, the transfer's end


SENDER_TASK: Table[Task, TaskEvent] = Table(
    "sender task",
    Task.CONNECTING,
    {
        (Task.CONNECTING, TaskEvent.OPENED): Task.STREAMING,
        (Task.CONNECTING, TaskEvent.FAILED): Task.FAILED,
        (Task.STREAMING, TaskEvent.TRAILER_SENT): Task.AWAITING_COMPLETE,
        (Task.STREAMING, TaskEvent.FAILED): Task.FAILED,
        (Task.AWAITING_COMPLETE, TaskEvent.COMPLETE): Task.COMMITTED,
        (Task.AWAITING_COMPLETE, TaskEvent.FAILED): Task.FAILED,
        # A committed partition stays committed: a later error is another attempt's.
        (Task.FAILED, TaskEvent.FAILED): Task.FAILED,
    },
    frozenset({Task.COMMITTED, Task.FAILED}),
)


# --- a lane in the reading application's registry ---------------------------------------


class Placed(Enum):
    NONE = "none"  # nobody holds it: the next claim receives it
    RECEIVING = "receiving"  # one host receives it from the sender; others follow it
    DONE = "done"  # staged on one or more machines (replicas)
    FAILED = "failed"  # the same error for every later read


class PlacedEvent(Enum):
    CLAIM = "claim"  # a host without the lane claims it (receive, follow, or fetch)
    CLAIM_COMPLETE = "claim complete"  # a host that holds the finished lane claims it
    DONE = "done"  # the receiver staged it
    FAILED = "failed"  # the lane's own verdict (cannot heal, idle, its disk)
    ABORTED = "aborted"  # the sender aborted the transfer: every lane ends
    RECEIVER_GONE = "receiver gone"  # its receiver's link ended
    LAST_REPLICA_GONE = "last replica gone"
    HOSTING_GAVE_UP = "hosting gave up"  # the registry could not start a host for it


REGISTRY_LANE: Table[Placed, PlacedEvent] = Table(
    "registry lane",
    Placed.NONE,
    {
        (Placed.NONE, PlacedEvent.CLAIM): Placed.RECEIVING,
        (Placed.NONE, PlacedEvent.CLAIM_COMPLETE): Placed.DONE,
        (Placed.NONE, PlacedEvent.DONE): Placed.DONE,  # a receiver's late word, after it left
        (Placed.NONE, PlacedEvent.FAILED): Placed.FAILED,
        (Placed.NONE, PlacedEvent.ABORTED): Placed.FAILED,
        (Placed.NONE, PlacedEvent.HOSTING_GAVE_UP): Placed.FAILED,
        (Placed.RECEIVING, PlacedEvent.CLAIM): Placed.RECEIVING,  # its receiver, or a follower
        (Placed.RECEIVING, PlacedEvent.CLAIM_COMPLETE): Placed.DONE,
        (Placed.RECEIVING, PlacedEvent.DONE): Placed.DONE,
        (Placed.RECEIVING, PlacedEvent.FAILED): Placed.FAILED,
        (Placed.RECEIVING, PlacedEvent.ABORTED): Placed.FAILED,
        (Placed.RECEIVING, PlacedEvent.RECEIVER_GONE): Placed.NONE,
        (Placed.DONE, PlacedEvent.CLAIM): Placed.DONE,  # fetch from a replica
        (Placed.DONE, PlacedEvent.CLAIM_COMPLETE): Placed.DONE,
        (Placed.DONE, PlacedEvent.DONE): Placed.DONE,
        (Placed.DONE, PlacedEvent.FAILED): Placed.DONE,  # a fetcher's failure: copies remain
        (Placed.DONE, PlacedEvent.ABORTED): Placed.FAILED,
        (Placed.DONE, PlacedEvent.LAST_REPLICA_GONE): Placed.FAILED,
        **_absorbing(frozenset({Placed.FAILED}), PlacedEvent),
    },
    frozenset({Placed.FAILED}),
)


# --- one run of a stream's side on its standing mailbox ---------------------------------


class MeetingState(Enum):
    WAITING = "waiting"  # no hello of the peer heard yet
    PAIRED = "paired"  # connected (or connecting) to the peer's latest run
    SUPERSEDED = "superseded"  # a later run of this side started: this one ends
    REVOKED = "revoked"  # either side revoked the pairing


class MeetingEvent(Enum):
    PEER_RUN = "peer run"  # a hello of a later run of the peer: (re)connect to it
    SUPERSEDED = "superseded"  # a hello of a later run of this side, or a copied record
    REVOKED = "revoked"


STREAM_MEETING: Table[MeetingState, MeetingEvent] = Table(
    "stream meeting",
    MeetingState.WAITING,
    {
        (MeetingState.WAITING, MeetingEvent.PEER_RUN): MeetingState.PAIRED,
        (MeetingState.WAITING, MeetingEvent.SUPERSEDED): MeetingState.SUPERSEDED,
        (MeetingState.WAITING, MeetingEvent.REVOKED): MeetingState.REVOKED,
        (MeetingState.PAIRED, MeetingEvent.PEER_RUN): MeetingState.PAIRED,  # the next pair
        (MeetingState.PAIRED, MeetingEvent.SUPERSEDED): MeetingState.SUPERSEDED,
        (MeetingState.PAIRED, MeetingEvent.REVOKED): MeetingState.REVOKED,
        **_absorbing(frozenset({MeetingState.SUPERSEDED, MeetingState.REVOKED}), MeetingEvent),
    },
    frozenset({MeetingState.SUPERSEDED, MeetingState.REVOKED}),
)


# --- one micro-batch of a stream on the receiving side ------------------------------------


class Batch(Enum):
    RECEIVING = "receiving"  # partitions kept as they arrive; the manifest may name them
    STAGED = "staged"  # every attempt the manifest names is kept: "have", a sequence number
    FREED = "freed"  # the receiving query committed an offset past it


class BatchEvent(Enum):
    ALL_KEPT = "all kept"  # the manifest's last partition is kept
    MANIFEST_AGAIN = "manifest again"  # a re-run of the batch: answered "have", dropped
    CONSUMED = "consumed"  # the receiving query's commit(end) passed it


BATCH: Table[Batch, BatchEvent] = Table(
    "stream batch",
    Batch.RECEIVING,
    {
        (Batch.RECEIVING, BatchEvent.ALL_KEPT): Batch.STAGED,
        (Batch.STAGED, BatchEvent.MANIFEST_AGAIN): Batch.STAGED,
        (Batch.STAGED, BatchEvent.CONSUMED): Batch.FREED,
        (Batch.FREED, BatchEvent.MANIFEST_AGAIN): Batch.FREED,
    },
    frozenset({Batch.FREED}),
)


# --- a sending process's connection to one lane, and a lane's door for one sender ----------


class Meet(Enum):
    WAITING = "waiting"  # the lane's epoch unknown: no door yet
    CLAIMING = "claiming"  # a claim on the door the directory's rules handed out
    MET = "met"  # paired with the lane's current host: the caller dilates
    ENDED = "ended"  # the transfer or the lane ended, the caller stopped, or it failed


class MeetEvent(Enum):
    DOOR = "door"  # the lane's epoch is known: the next attempt's door
    PAIRED = "paired"  # the claim paired, and its epoch is still the lane's
    STALE = "stale"  # the lane's epoch rose (claim cancelled, or a pairing too late)
    SPOILED = "spoiled"  # a stranger on the door: it costs this attempt
    ENDED = "ended"  # the transfer ended, the lane ended for good, stopped, or failed


SENDER_MEETING: Table[Meet, MeetEvent] = Table(
    "sender meeting",
    Meet.WAITING,
    {
        (Meet.WAITING, MeetEvent.DOOR): Meet.CLAIMING,
        (Meet.WAITING, MeetEvent.ENDED): Meet.ENDED,
        (Meet.CLAIMING, MeetEvent.PAIRED): Meet.MET,
        (Meet.CLAIMING, MeetEvent.STALE): Meet.WAITING,
        (Meet.CLAIMING, MeetEvent.SPOILED): Meet.WAITING,
        (Meet.CLAIMING, MeetEvent.ENDED): Meet.ENDED,
    },
    frozenset({Meet.MET, Meet.ENDED}),
)


class DoorState(Enum):
    OPEN = "open"  # claimed, waiting for its sender at attempt a
    CLOSED = "closed"  # the lane stopped, the peer was not ours, or the meeting failed


class DoorEvent(Enum):
    PAIRED = "paired"  # the sender came: keep the connection, wait at a + 1
    SPOILED = "spoiled"  # a stranger on it (a wrong code): wait at a + 1
    STOPPED = "stopped"  # the lane finished or stopped
    NOT_OURS = "not ours"  # a confirmed peer the directory did not send
    FAILED = "failed"  # the mailbox server refused or was lost for good: the lane fails


LANE_DOOR: Table[DoorState, DoorEvent] = Table(
    "lane door",
    DoorState.OPEN,
    {
        (DoorState.OPEN, DoorEvent.PAIRED): DoorState.OPEN,
        (DoorState.OPEN, DoorEvent.SPOILED): DoorState.OPEN,
        (DoorState.OPEN, DoorEvent.STOPPED): DoorState.CLOSED,
        (DoorState.OPEN, DoorEvent.NOT_OURS): DoorState.CLOSED,
        (DoorState.OPEN, DoorEvent.FAILED): DoorState.CLOSED,
    },
    frozenset({DoorState.CLOSED}),
)

TABLES: tuple[Table, ...] = (
    LANE,
    SENDER_TASK,
    REGISTRY_LANE,
    STREAM_MEETING,
    BATCH,
    SENDER_MEETING,
    LANE_DOOR,
)
