"""One lane's staging on this machine's disk, and what its processes leave there.

``<staging_dir>/<transfer>/lane-<n>/`` holds ``p<partition>.arrow`` once a
partition is complete (``.partial`` while it arrives), ``manifest.json`` once
the lane is (every partition the sender committed is staged), ``error.json``
when it failed, ``host.pid`` and ``host.log`` of its lane host, and
``.lock``, whose ``flock`` elects the one receiver of the lane on this
machine. No Twisted here: read tasks import this module.
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.ipc as ipc

from ..machine import atomic_write, lock_held, os_cause, try_lock
from ..rules.errors import StagingError
from ..rules.protocol import Manifest

MANIFEST_FILE = "manifest.json"
ERROR_FILE = "error.json"


def staging_error(lane: int, what: str, e: OSError, root: Path) -> StagingError:
    return StagingError(
        f"lane {lane} could not stage {what}: {os_cause(e)} (staging folder {root})"
    )


class LaneStaging:
    """Files of one lane: ``p<partition>.arrow`` once complete, ``.partial`` while arriving."""

    def __init__(self, root: Path, transfer_id: str, lane: int) -> None:
        self.dir = Path(root) / transfer_id / f"lane-{lane}"

    def ensure(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)

    def complete_path(self, partition: int) -> Path:
        return self.dir / f"p{partition:06d}.arrow"

    def partial_path(self, partition: int, attempt: int) -> Path:
        return self.dir / f".p{partition:06d}-a{attempt}-{uuid.uuid4().hex[:8]}.partial"

    def complete(self) -> dict[int, Path]:
        out: dict[int, Path] = {}
        if self.dir.is_dir():
            for path in self.dir.glob("p*.arrow"):  # p000123.arrow
                with contextlib.suppress(ValueError):
                    out[int(path.stem[1:])] = path
        return out

    def manifest(self) -> Manifest | None:
        path = self.dir / MANIFEST_FILE
        if not path.exists():
            return None
        return Manifest.from_json(path.read_text())

    def write_manifest(self, manifest: Manifest) -> None:
        atomic_write(self.dir / MANIFEST_FILE, manifest.to_json())


def read_staged(path: Path) -> Iterator[pa.RecordBatch]:
    with pa.memory_map(str(path)) as source:
        yield from ipc.open_stream(source)


def rows_of(path: Path) -> int:
    with pa.memory_map(str(path)) as source:
        return sum(b.num_rows for b in ipc.open_stream(source))


PROBE_PATIENCE = 2.0
"""Seconds a new lane host keeps trying for the lane's lock: see :func:`take_lane_lock`."""


def take_lane_lock(staging: LaneStaging, patience: float = PROBE_PATIENCE) -> int | None:
    """The lane's lock on this machine (its file descriptor), or None if a process holds it.

    Where :func:`host_alive` cannot read ``/proc/locks`` it takes the lock for the
    instant of two system calls. A host starting in that instant once took the
    probe for a live host and left, and its read task failed ("its receiver process
    exited with code 0"). So the lock is tried again until ``patience`` has passed:
    a probe has let go long before; a live host holds it for good.
    """
    staging.ensure()
    deadline = time.monotonic() + patience
    while True:
        fd = try_lock(staging.dir / ".lock")
        if fd is not None or time.monotonic() >= deadline:
            return fd
        time.sleep(0.02)


def write_host_error(staging: LaneStaging, error: BaseException) -> None:
    """The lane's error for its read tasks, and copies elsewhere (hostlink's error record)."""
    from ..rules.errors import error_record

    atomic_write(staging.dir / ERROR_FILE, json.dumps(error_record(error)))


def host_error(staging: LaneStaging) -> BaseException | None:
    """The lane's error (:func:`write_host_error`) as the same class, or None."""
    from ..rules.errors import rebuild_error

    path = staging.dir / ERROR_FILE
    if not path.exists():
        return None
    return rebuild_error(json.loads(path.read_text()))


def raise_host_error(staging: LaneStaging) -> None:
    error = host_error(staging)
    if error is not None:
        raise error


def host_alive(staging: LaneStaging) -> bool:
    """Whether a process holds the lane's lock (a live receiver)."""
    if not staging.dir.is_dir():
        return False  # removed: its host ended with the application
    return lock_held(staging.dir / ".lock")
