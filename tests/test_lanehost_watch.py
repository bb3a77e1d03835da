"""The lane host's copy watch never takes its own staging removal for a deletion under it.

It once did: the application ended, the host began removing its staging, the
watch (every second) saw the manifest gone, called ``os._exit`` half-way through
the removal and left ``lane-N/`` files behind (a clean-clone run caught it).
The rule: the removal sets a flag, then deletes; the watch reads the manifest,
then the flag. Here every interleaving of those four steps is played.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

from spark_dilation.transfer.receive.lanehost import RegisteredLane

REMOVAL = ("set the flag", "delete the manifest")  # _application_ended's order


class Played:
    """The shared state; each read by the watch first lets the removal take the steps
    the schedule places before it."""

    def __init__(self, before_read: dict[int, list[str]]) -> None:
        self.flag = False
        self.manifest: Any = {"partitions": []}
        self.before_read = before_read
        self.reads = 0

    def _read(self) -> None:
        for step in self.before_read.get(self.reads, []):
            if step == "set the flag":
                self.flag = True
            else:
                self.manifest = None
        self.reads += 1


class Staging:
    def __init__(self, played: Played) -> None:
        self.played = played

    def manifest(self) -> Any:
        self.played._read()
        return self.played.manifest


class Flag:
    def __init__(self, played: Played) -> None:
        self.played = played

    def is_set(self) -> bool:
        self.played._read()
        return self.played.flag


def schedules() -> list[dict[int, list[str]]]:
    """Each way to place the removal's two steps (in their order) before read 0, before
    read 1, or after both reads (2)."""
    out = []
    for slots in itertools.combinations_with_replacement(range(3), len(REMOVAL)):
        placed: dict[int, list[str]] = {}
        for step, slot in zip(REMOVAL, slots, strict=True):
            placed.setdefault(slot, []).append(step)
        out.append(placed)
    return out


def host(played: Played) -> RegisteredLane:
    lane = RegisteredLane(None, 0, Staging(played), 0)  # type: ignore[arg-type]
    lane.removing = Flag(played)  # type: ignore[assignment]
    return lane


def test_the_hosts_own_removal_is_never_a_deletion_under_it() -> None:
    assert len(schedules()) == 6
    for schedule in schedules():
        played = Played(schedule)
        assert host(played).copy_deleted() is False, schedule


def test_a_deletion_by_someone_else_is_seen() -> None:
    played = Played({0: ["delete the manifest"]})  # no flag: not the host's removal
    assert host(played).copy_deleted() is True


def test_the_other_read_order_would_be_fooled() -> None:
    """The rule matters: reading the flag first misses it in one interleaving."""

    def flag_first(lane: RegisteredLane) -> bool:
        flagged: Callable[[], bool] = lane.removing.is_set
        return not flagged() and lane.staging.manifest() is None

    fooled = [s for s in schedules() if flag_first(host(Played(s)))]
    assert fooled == [{1: ["set the flag", "delete the manifest"]}]
