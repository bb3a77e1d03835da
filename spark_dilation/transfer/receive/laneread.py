"""The read task's side of a lane: start its host, follow its staged files, emit each once.

A Spark read task (or early lanes, during ``load()``) starts the lane's host
process on its machine (:mod:`.lanehost`), which outlives the task, and
follows the lane's staging (:mod:`.staging`) as partitions complete; the
manifest says when every partition is there. Later actions read what is
staged. Test-only faults (option ``test_fail``) live here too.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator
from typing import Any

import pyarrow as pa

from ...errors import TransferError
from ..machine import wait_ready
from ..rules.errors import CannotHealError
from ..rules.protocol import Manifest
from ..rules.spec import TransferSpec
from .staging import LaneStaging, host_alive, host_error, raise_host_error, read_staged

log = logging.getLogger(__name__)

# How often a read task looks for new staged partitions and the manifest: the
# last partition and the manifest are on the transfer's critical path, and a
# look (a directory listing, a stat, a lock probe) costs ~0.1 ms.
_POLL = 0.05


def read_lane(spec: TransferSpec, lane: int) -> Iterator[pa.RecordBatch]:
    """Every row the lane receives, once: staged partitions as they complete.

    The receiver runs in a lane host process (:mod:`.lanehost`) started on
    first use (or during ``load()``, with early lanes), so the transfer goes
    on when Spark ends or kills the Python worker of this task (``show()``
    stops reading early; idle workers are killed); this generator follows
    the staged files. Yields Arrow batches with the transfer's schema. Raises
    when the sender aborts, a partition cannot heal, or the lane hears
    nothing for ``idle_timeout``.
    """
    staging = LaneStaging(spec.options.staging_root, spec.transfer_id, lane)
    emitted: set[int] = set()
    faults = _Faults(spec.options.test_fail, lane, staging)
    manifest = staging.manifest()
    if manifest is not None:
        yield from _emit_manifest(staging, manifest, lane, emitted, faults)
        return
    staging.ensure()
    ensure_host(spec, lane, staging)
    while True:
        raise_host_error(staging)
        complete = sorted(staging.complete().items())
        if complete:
            faults.before_rows()
        for partition, path in complete:
            if partition not in emitted:
                emitted.add(partition)
                yield from read_staged(path)
                faults.after_rows()
        manifest = staging.manifest()
        if manifest is not None:
            yield from _emit_manifest(staging, manifest, lane, emitted, faults)
            return
        if not host_alive(staging):
            raise_host_error(staging)
            if staging.manifest() is None:
                log.warning("lane %d: its receiver process ended; starting another", lane)
                ensure_host(spec, lane, staging)
        time.sleep(_POLL)


class _Faults:
    """Test-only fault injection of a read task (option ``test_fail``), first attempt only."""

    def __init__(self, test_fail: str, lane: int, staging: LaneStaging) -> None:
        self.armed = bool(test_fail) and _attempt() == 0
        self.test_fail, self.lane, self.staging = test_fail, lane, staging

    def before_rows(self) -> None:
        if self.armed and "lane-before-rows" in self.test_fail:
            raise TransferError(f"test_fail: lane {self.lane} fails before emitting rows")

    def after_rows(self) -> None:
        if self.armed and self.lane == 0 and "lane-after-rows" in self.test_fail:
            _lose_lane(self.staging)
            raise TransferError(
                f"test_fail: lane {self.lane} fails after emitting rows, losing its staging"
            )


def _attempt() -> int:
    """The Spark task attempt number of the current read task (0 outside Spark)."""
    try:
        from pyspark import TaskContext

        ctx = TaskContext.get()
        return ctx.attemptNumber() if ctx is not None else 0
    except ImportError:
        return 0


def start_lanes(spec: TransferSpec, wait: float = 60.0) -> None:
    """Start every lane's host process now (early lanes), then wait until each runs.

    The read tasks that come later find the hosts alive and follow their
    staged files, exactly as a second action does.
    """
    started = []
    for lane in range(spec.lanes):
        staging = LaneStaging(spec.options.staging_root, spec.transfer_id, lane)
        staging.ensure()
        started.append((lane, staging, _spawn_host(spec, lane, staging)))
    for lane, staging, proc in started:
        _wait_host(lane, staging, proc, wait)


def ensure_host(spec: TransferSpec, lane: int, staging: LaneStaging, wait: float = 60.0) -> None:
    """Start the lane's host process unless one runs; wait until it holds the lock."""
    _wait_host(lane, staging, _spawn_host(spec, lane, staging), wait)


def _spawn_host(spec: TransferSpec, lane: int, staging: LaneStaging) -> Any:
    """A new lane host process, or None if one already holds the lane's lock."""
    from ..machine import spawn, write_private

    if host_alive(staging):
        return None
    staging.ensure()
    spec_path = write_private(staging.dir, spec)
    return spawn(
        "spark_dilation.transfer.receive.lanehost",
        [str(spec_path), str(lane), str(os.getpid())],
        staging.dir / "host.log",
    )


def _wait_host(lane: int, staging: LaneStaging, proc: Any, wait: float) -> None:
    """Until a process holds the lane's lock (this one or another that won it), or
    the lane is done; the lane's error, or the exit of ``proc``, if not."""
    if proc is None:
        return
    log_path = staging.dir / "host.log"

    def ready() -> bool | None:
        if host_alive(staging):
            return True
        # Exited: another process won the lock, or the lane is already done.
        return True if proc.poll() is not None and staging.manifest() is not None else None

    def failed() -> BaseException | None:
        if proc.poll() is None:
            return None
        return host_error(staging) or TransferError(
            f"lane {lane}: its receiver process exited with code {proc.returncode}; see {log_path}"
        )

    # Not killed past the deadline: it may yet take the lock and receive the lane.
    wait_ready(
        None,
        ready,
        failed,
        time.monotonic() + wait,
        f"lane {lane}'s receiver process to start",
        log=log_path,
        every=0.05,
    )


def _lose_lane(staging: LaneStaging) -> None:
    """Test-only: what losing the lane's machine does (receiver and staged files gone)."""
    import signal

    pid_file = staging.dir / "host.pid"
    if pid_file.exists():
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid_file.read_text()), signal.SIGKILL)
    deadline = time.monotonic() + 10
    while host_alive(staging) and time.monotonic() < deadline:
        time.sleep(0.05)
    for path in staging.complete().values():
        path.unlink(missing_ok=True)


def _emit_manifest(
    staging: LaneStaging,
    manifest: Manifest,
    lane: int,
    emitted: set[int],
    faults: _Faults | None = None,
) -> Iterator[pa.RecordBatch]:
    complete = staging.complete()
    if faults is not None and manifest.for_lane(lane):
        faults.before_rows()
    for c in manifest.for_lane(lane):
        if c.partition in emitted:
            continue
        path = complete.get(c.partition)
        if path is None:
            raise CannotHealError(
                f"lane {lane} cannot heal: the staged data of partition {c.partition} is gone "
                f"(staging directory {staging.dir}) and its sender has finished. Keep the "
                "staging directory while the DataFrame is in use, or send the dataset again"
            )
        emitted.add(c.partition)
        yield from read_staged(path)
        if faults is not None:
            faults.after_rows()
    extra = emitted - {c.partition for c in manifest.for_lane(lane)}
    if extra:
        # Cannot happen with Spark's commit protocol; never silently.
        raise CannotHealError(
            f"lane {lane} emitted partitions {sorted(extra)} that the sender did not commit"
        )
