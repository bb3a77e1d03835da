"""The lane registry's rules: where each lane of a loaded dataset lives (pure, no I/O).

A Spark read places every action's lanes anew: a later ``count()`` may run
lane 0 on an executor that never received it. The reading application keeps
one *registry* (run by :mod:`..receive.registryhost` on the driver's machine); every lane
host claims its lane there before it does anything. The registry answers:

* ``receive``: nobody holds the lane yet; this host receives it from the sender;
* ``fetch``: the lane is staged on other machines (``sources``), or is being
  received by another live host: copy it from one of them (following the
  receiver partition by partition), then serve it too (each copy is a replica);
* ``serve``: this host already holds the complete lane (its ``manifest.json``);
* ``error``: the lane failed (the sender aborted, it cannot heal, every copy is
  gone): the same error, at once, for every later read.

Lane states: :data:`~.states.REGISTRY_LANE` is the table (every legal
transition; :func:`_move` applies it). In short: NONE --claim--> RECEIVING
(host, epoch + 1) --done--> DONE (replicas); RECEIVING --receiver gone-->
NONE (a new claim receives; the lane itself detects lost partitions);
RECEIVING --claim by another host--> RECEIVING (it follows the receiver);
DONE --claim--> DONE (fetch from a replica; the fetcher becomes one);
DONE --last replica gone--> FAILED (cannot heal).

A lane in NONE that no host claims for a grace period after the first claim
(or :data:`RECEIVER_GONE_WAIT` after its receiver went) is received by the registry itself
(:meth:`LaneRegistry.unclaimed`, :meth:`LaneRegistry.hosting`): the sender
never waits for a task slot. A lane the registry failed to host
:data:`HOSTING_ATTEMPTS` times fails.

The true cause wins: a lane that fails by itself (its staging disk full) declares
it here (:meth:`LaneRegistry.own_failure`) before it tells the senders, so the
abort that follows, on any other lane, finds it: every lane's error is that
cause, not "the sender aborted", in whatever order the two arrive.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from ...errors import TransferError
from .errors import CannotHealError, error_record
from .states import REGISTRY_LANE, Placed, PlacedEvent

NONE, RECEIVING, DONE, FAILED = Placed.NONE, Placed.RECEIVING, Placed.DONE, Placed.FAILED
HOSTING_ATTEMPTS = 3
RECEIVER_GONE_WAIT = 30.0
"""Seconds a lane whose receiver went waits for a new claim (Spark's rerun of the task,
or the read task's new host after a lost link) before the registry receives it."""
HOSTED_CLAIM_WAIT = 90.0
"""Seconds a host the registry started has to claim its lane (it starts within 60 s,
then reaches the registry within 10 s) before the registry starts another."""


@dataclass(frozen=True)
class HostInfo:
    """A lane host: its id, the machine it says it is on, where it serves its staged lane."""

    host_id: str
    machine: str
    addresses: tuple[str, ...]
    port: int

    def to_json(self) -> dict[str, Any]:
        return {
            "host_id": self.host_id,
            "machine": self.machine,
            "addresses": list(self.addresses),
            "port": self.port,
        }

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> HostInfo:
        return cls(
            str(body["host_id"]),
            str(body["machine"]),
            tuple(str(a) for a in body["addresses"]),
            int(body["port"]),
        )


@dataclass
class LaneEntry:
    state: Placed = NONE
    receiver: HostInfo | None = None
    replicas: dict[str, HostInfo] = field(default_factory=dict)
    lost: list[str] = field(default_factory=list)  # machines whose copy went away
    deleted: set[str] = field(default_factory=set)  # ... of those, deleted under their host
    error: dict[str, str] | None = None  # an error_record (hostlink.error_record)
    claimed: bool = False  # claimed since its last receiver went (else the registry hosts it)
    left_at: float | None = None  # when its last receiver went
    hosted_at: float | None = None  # when the registry last started a host for it
    hosting_failures: int = 0
    # Rises each time a new host receives the lane (-1: never received); the
    # reading end publishes it so that senders meet that host (directory.py).
    epoch: int = -1


def _move(entry: LaneEntry, event: PlacedEvent) -> Placed:
    """The one place a registry lane changes state (:data:`~.states.REGISTRY_LANE`)."""
    entry.state = REGISTRY_LANE.next(entry.state, event)
    return entry.state


def cannot_heal_record(
    lane: int, machines: list[str], deleted: Collection[str] = ()
) -> dict[str, str]:
    """The error of a lane whose every copy went; each machine's copy named by how it went:
    deleted under its lane host (a temp cleaner, a user), or its host ended with it."""
    gone = sorted(set(machines)) or ["its machine"]
    ways = {
        "deleted": [m for m in gone if m in deleted],
        "ended": [m for m in gone if m not in deleted],
    }
    why = {
        "deleted": "its staged copy was deleted under its lane host (a temp cleaner, a user)",
        "ended": "its lane host ended: machine lost or process killed",
    }
    where = "; ".join(f"on {', '.join(ms)}: {why[way]}" for way, ms in ways.items() if ms)
    return error_record(
        CannotHealError(
            f"lane {lane} cannot heal: every copy of its staged rows is gone ({where}), and the "
            "sender has finished. Nothing was emitted twice or lost silently; load the "
            "DataFrame again from a new transfer (a new code), or cache() it after load() "
            "next time"
        )
    )


class LaneRegistry:
    """Every lane's state, the hosts' claims and what they are told to do."""

    def __init__(self, lanes: int) -> None:
        self.lanes = [LaneEntry() for _ in range(lanes)]
        self.first_claim: float | None = None
        # The first failure a lane declared its own before telling the senders: the
        # true cause of the transfer's end, which wins over the aborts it set off.
        self.cause: dict[str, str] | None = None

    def unclaimed(self, now: float, grace: float) -> list[int]:
        """Lanes nobody claimed ``grace`` seconds after the first claim: the reader's action
        runs, but Spark has no slot for them (busy slots, more lanes than slots, or a
        ``show()`` that runs lane 0 alone). The registry then hosts them itself, so the
        sender never waits on a task slot; read tasks copy them later."""
        if self.first_claim is None or now - self.first_claim < grace:
            return []
        return [
            lane
            for lane, e in enumerate(self.lanes)
            if e.state == NONE
            and not e.claimed
            and (e.left_at is None or now - e.left_at >= max(grace, RECEIVER_GONE_WAIT))
            and (e.hosted_at is None or now - e.hosted_at >= HOSTED_CLAIM_WAIT)
        ]

    def hosting(self, lane: int, now: float) -> None:
        """The registry starts a host for the lane (its claim follows)."""
        self._entry(lane).hosted_at = now

    def hosting_failed(self, lane: int, error: str, now: float) -> None:
        """The registry could not start a host for the lane: try again after
        RECEIVER_GONE_WAIT, and fail the lane after :data:`HOSTING_ATTEMPTS` tries."""
        entry = self._entry(lane)
        entry.hosting_failures += 1
        if entry.state != NONE or entry.claimed:
            return  # a read task claimed it meanwhile
        if entry.hosting_failures >= HOSTING_ATTEMPTS:
            _move(entry, PlacedEvent.HOSTING_GAVE_UP)
            entry.error = error_record(
                TransferError(
                    f"lane {lane}: no read task ran it and its receiver on the driver's "
                    f"machine did not start ({HOSTING_ATTEMPTS} tries): {error}"
                )
            )
        else:
            entry.hosted_at, entry.left_at = None, now

    def _entry(self, lane: int) -> LaneEntry:
        if not 0 <= lane < len(self.lanes):
            raise ValueError(f"lane {lane} is not one of the transfer's {len(self.lanes)} lanes")
        return self.lanes[lane]

    def claim(self, lane: int, host: HostInfo, complete: bool, now: float = 0.0) -> dict[str, Any]:
        """What ``host`` (``complete``: it holds the finished lane already) must do.

        ``now`` (monotonic seconds) dates the first claim, for :meth:`unclaimed`.
        """
        entry = self._entry(lane)
        if self.first_claim is None:
            self.first_claim = now
        entry.claimed = True
        before = entry.state
        _move(entry, PlacedEvent.CLAIM_COMPLETE if complete else PlacedEvent.CLAIM)
        if before == FAILED:
            return {"do": "error", "error": entry.error}
        if complete:
            entry.replicas[host.host_id] = host
            entry.receiver = None
            return {"do": "serve"}
        if before == DONE:
            sources = [h.to_json() for h in entry.replicas.values() if h.host_id != host.host_id]
            return {"do": "fetch", "sources": sources}
        if before == RECEIVING:
            assert entry.receiver is not None
            if entry.receiver.host_id == host.host_id:
                return {"do": "receive", "epoch": entry.epoch}
            # Follow the receiver: its partitions as they are staged, then the
            # manifest (a show() may need the first rows before the lane ends).
            return {"do": "fetch", "sources": [entry.receiver.to_json()]}
        entry.receiver = host
        entry.epoch += 1
        return {"do": "receive", "epoch": entry.epoch}

    def done(self, lane: int, host: HostInfo) -> None:
        entry = self._entry(lane)
        if _move(entry, PlacedEvent.DONE) == FAILED:
            return
        entry.receiver = None
        entry.replicas[host.host_id] = host

    def failed(self, lane: int, host: HostInfo, error: dict[str, str]) -> None:
        """The lane's own verdict (the sender's abort, cannot heal, idle): final."""
        entry = self._entry(lane)
        if _move(entry, PlacedEvent.FAILED) == DONE:
            return  # a fetcher's failure; the lane still has its copies
        entry.receiver, entry.error = None, error
        if error.get("type") == "TransferAbortedError":
            # The sender aborted the whole transfer: no lane can finish.
            for other in self.lanes:
                if other.state != FAILED:
                    _move(other, PlacedEvent.ABORTED)
                    other.receiver, other.error = None, error
        if self.cause is not None:
            # The true cause wins over the aborts it set off, whichever came first.
            for other in self.lanes:
                if other.state == FAILED and other.error is not None:
                    if other.error.get("type") == "TransferAbortedError":
                        other.error = self.cause

    def own_failure(self, lane: int, host: HostInfo, error: dict[str, str]) -> dict[str, str]:
        """A lane failed by itself (disk full, ...) and tells the senders next; their abort
        then reaches the other lanes. The first such failure is the transfer's cause:
        every lane's error is it, not the abort. Returns it."""
        if self.cause is None:
            self.cause = error
        self.failed(lane, host, error)
        return self.cause

    def deleted(self, lane: int, host: HostInfo) -> None:
        """The host found its staged copy of ``lane`` deleted under it; it leaves next
        (:meth:`gone`), and the lane's error then says how that copy went."""
        self._entry(lane).deleted.add(host.machine)

    def gone(self, host_id: str, now: float = 0.0) -> None:
        """A host's connection ended: it died, or its machine was lost.

        A lane it was receiving is unclaimed again: a new claim receives it (Spark
        runs its read task again), else the registry hosts it after RECEIVER_GONE_WAIT.
        """
        for lane, entry in enumerate(self.lanes):
            if entry.receiver is not None and entry.receiver.host_id == host_id:
                _move(entry, PlacedEvent.RECEIVER_GONE)
                entry.receiver = None
                entry.claimed, entry.left_at, entry.hosted_at = False, now, None
            lost = entry.replicas.pop(host_id, None)
            if lost is not None:
                entry.lost.append(lost.machine)
                if entry.state == DONE and not entry.replicas:
                    _move(entry, PlacedEvent.LAST_REPLICA_GONE)
                    entry.error = cannot_heal_record(lane, entry.lost, entry.deleted)

    def ended(self) -> dict[int, tuple[int, str]]:
        """Lanes that failed for good (FAILED is final: no host will take them again), with
        the epoch they ended at (0 if never received) and their error: what the reading end
        publishes so that their senders fail at once (``directory.lanes_message``)."""
        return {
            lane: (max(e.epoch, 0), (e.error or {}).get("message") or "the lane failed")
            for lane, e in enumerate(self.lanes)
            if e.state == FAILED
        }

    def epochs(self) -> dict[int, int]:
        """The epoch of every lane ever received: what the reading end publishes."""
        return {lane: e.epoch for lane, e in enumerate(self.lanes) if e.epoch >= 0}

    def snapshot(self) -> list[dict[str, Any]]:
        """Each lane's state and the machines holding it (logs, tests)."""
        return [
            {
                "lane": lane,
                "state": e.state.value,
                "receiver": e.receiver.machine if e.receiver else None,
                "replicas": sorted(h.machine for h in e.replicas.values()),
            }
            for lane, e in enumerate(self.lanes)
        ]
