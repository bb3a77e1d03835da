"""The sending side's progress counts what the receiver has, not what was queued.

A fake pool stands for the connections: its acknowledged and unacknowledged
byte counts are set by the test, as a slow link leaves them.
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from spark_dilation.transfer.api.progress import SendMeter, confirmed_rows
from spark_dilation.transfer.rules.report import ConnectionStats


class Pool:
    def __init__(self) -> None:
        self.acked = self.queued = 0

    def stats(self, transfer_id: str) -> ConnectionStats:
        return ConnectionStats("host:1", 1, 0, ("relay",))

    def link_bytes(self, transfer_id: str) -> tuple[int, int]:
        return self.acked, self.queued


def test_confirmed_rows_are_the_acknowledged_share() -> None:
    assert confirmed_rows(1000, 0, 0) == 0  # nothing sent yet
    assert confirmed_rows(1000, 0, 8_000_000) == 0  # all of it still queued
    assert confirmed_rows(1000, 2_000_000, 6_000_000) == 250
    assert confirmed_rows(1000, 5, 0) == 1000


def test_the_first_tick_on_a_slow_link_shows_what_arrived() -> None:
    pool: Any = Pool()
    meter = SendMeter("t", pool, 100_000, 0.0)
    batches = [pa.record_batch({"x": list(range(10_000))}) for _ in range(10)]
    (maker,) = meter.wrap([lambda: iter(batches)])
    for _ in maker():  # every batch handed to the connection at once...
        pass
    pool.queued = 9_000_000  # ... and most of it still waits in the queue
    pool.acked = 1_000_000
    first = meter.snapshot()
    assert first.rows == 10_000 and first.bytes == 1_000_000  # 10 %, not 100 %
    pool.acked, pool.queued = 10_000_000, 0
    last = meter.snapshot(done=True)
    assert last.rows == 100_000 and last.bytes == 10_000_000
