"""Progress while a dataset moves: the meters of each side and the ticking thread."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from ..rules.report import Progress, combine_paths

if TYPE_CHECKING:
    from ..send.pool import ConnectionPool

log = logging.getLogger(__name__)

PROGRESS_INTERVAL = 0.5  # seconds between progress snapshots
ProgressCallback = Callable[[Progress], None]


class Ticker:
    """Calls ``on_progress(snapshot())`` every ``interval`` s in a thread until stopped."""

    def __init__(
        self,
        snapshot: Callable[[bool], Progress],
        on_progress: ProgressCallback | None,
        interval: float,
    ) -> None:
        self._snapshot = snapshot
        self._on_progress = on_progress
        self._interval = interval
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if on_progress is not None:
            self._thread = threading.Thread(target=self._run, name="progress", daemon=True)
            self._thread.start()

    def _emit(self, done: bool) -> None:
        assert self._on_progress is not None
        try:
            self._on_progress(self._snapshot(done))
        except Exception:  # a broken callback must not break the transfer
            log.exception("the progress callback failed")

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self._emit(False)

    def stop(self, final: bool = True) -> None:
        """Stop ticking; with ``final`` emit the last snapshot (``done=True``)."""
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._thread = None
        if final:
            self._emit(True)


class SendMeter:
    """Rows and bytes the receiver has: what was handed to the connections (per
    partition; a retry starts again), scaled by the share of the sent bytes the
    lanes acknowledged. Up to the Dilation queue (8 MB) waits unacknowledged on a
    slow link: counting what was handed over showed 59 % on the first tick."""

    def __init__(
        self, transfer_id: str, connections: ConnectionPool, total_rows: int | None, started: float
    ) -> None:
        self._transfer_id = transfer_id
        self._connections = connections
        self._total_rows = total_rows
        self._started = started
        self._lock = threading.Lock()
        self._rows: dict[int, int] = {}
        self._bytes: dict[int, int] = {}
        self._acked = 0
        self.committed = 0

    def wrap(
        self, makers: list[Callable[[], Iterator[pa.RecordBatch]]]
    ) -> list[Callable[[], Iterator[pa.RecordBatch]]]:
        def counting(partition: int) -> Iterator[pa.RecordBatch]:
            with self._lock:
                self._rows[partition] = self._bytes[partition] = 0
            for batch in makers[partition]():
                yield batch
                with self._lock:
                    self._rows[partition] += batch.num_rows
                    self._bytes[partition] += batch.nbytes

        return [(lambda p=p: counting(p)) for p in range(len(makers))]

    def snapshot(self, done: bool = False) -> Progress:
        stats = self._connections.stats(self._transfer_id)
        acked, queued = self._connections.link_bytes(self._transfer_id)
        with self._lock:
            rows, nbytes = sum(self._rows.values()), sum(self._bytes.values())
            # Wire bytes, as the summary counts them; never back (a closed connection).
            self._acked = max(self._acked, acked)
        if not done:
            rows = confirmed_rows(rows, acked, queued)
        return Progress(
            side="send",
            rows=rows,
            bytes=self._acked or nbytes,
            seconds=time.monotonic() - self._started,
            partitions=self.committed,
            total_rows=self._total_rows,
            connections=stats.connections_opened,
            reconnects=stats.reconnects,
            path=combine_paths(stats.paths),
            done=done,
            reconnecting=stats.reconnecting > 0,
            connecting=stats.connecting > 0,
        )


def confirmed_rows(handed: int, acked: int, queued: int) -> int:
    """Of ``handed`` rows, about how many the receiver has: their share of the bytes
    the lanes acknowledged (rows are spread evenly enough over a partition's bytes)."""
    sent = acked + queued
    return handed * acked // sent if sent else 0


class ReceiveMeter:
    """Rows and wire bytes this process' lanes have, counted as messages arrive."""

    def __init__(self, receivers: list[Any], started: float) -> None:
        self._receivers = receivers
        self._started = started
        self._peak = (0, 0)  # a dropped attempt's messages go; the count does not

    def snapshot(self, done: bool = False) -> Progress:
        rows = nbytes = partitions = connections = reconnects = reconnecting = connecting = 0
        paths: list[str] = []
        for r in self._receivers:
            made, again, seen, down, first = r.live_stats()
            connections += made
            reconnects += again
            reconnecting += down
            connecting += first
            paths += seen
            lane_rows, lane_bytes = r.arrived()
            rows += lane_rows
            nbytes += lane_bytes
            partitions += len(r.staging.complete())
        self._peak = (max(self._peak[0], rows), max(self._peak[1], nbytes))
        return Progress(
            side="receive",
            rows=self._peak[0],
            bytes=self._peak[1],
            total_rows=self._receivers[0].spec.total_rows if self._receivers else None,
            seconds=time.monotonic() - self._started,
            partitions=partitions,
            connections=connections,
            reconnects=reconnects,
            path=combine_paths(paths),
            done=done,
            reconnecting=reconnecting > 0,
            connecting=connecting > 0,
        )
