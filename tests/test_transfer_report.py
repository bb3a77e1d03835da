"""The one report builder and the one tally of connection statuses (rules/report.py)."""

from __future__ import annotations

from spark_dilation.dilation import DilationStatus
from spark_dilation.transfer.rules.protocol import CommittedPartition
from spark_dilation.transfer.rules.report import ConnectionStats, StatusTally, TransferReport, tally


def _part(partition: int, rows: int, nbytes: int) -> CommittedPartition:
    return CommittedPartition(partition, 0, partition % 2, "i", rows, nbytes)


def test_tally_counts_paths_reconnects_and_who_is_trying() -> None:
    up = DilationStatus(connection="relay tcp:r:4001", connections=3, relay_fallbacks=1)
    first = DilationStatus(down_since=1.0)  # never up, trying
    again = DilationStatus(down_since=1.0, connections=2)  # was up, trying again
    gave_up = DilationStatus(down_since=1.0, connections=1, error="gave up")
    assert tally([up, first, again, gave_up]) == StatusTally(
        paths=("relay", "unknown", "unknown", "unknown"),
        reconnects=2 + 0 + 1 + 0,
        reconnecting=1,
        connecting=1,
        relay_fallbacks=1,
    )
    assert tally([]) == StatusTally()


def test_the_report_merges_the_latest_stats_of_each_process() -> None:
    parts = [_part(0, 10, 100), _part(1, 5, 50)]
    stats = [
        ConnectionStats("a:1", 1, 0, ("direct",)),
        ConnectionStats("a:1", 2, 1, (), relay_fallbacks=1),  # later: counts
        ConnectionStats("b:2", 1, 0, ("relay",)),
    ]
    report = TransferReport.of(
        parts, stats, lanes=2, compression="zstd", seconds=1.5, control=2, compression_detail="why"
    )
    assert report == TransferReport(
        rows=15,
        bytes=150,
        partitions=2,
        lanes=2,
        connections=2 + 1 + 2,
        reconnects=1,
        path="direct+relay",
        seconds=1.5,
        compression="zstd",
        relay_fallbacks=1,
        compression_detail="why",
    )


def test_a_report_without_connections() -> None:
    report = TransferReport.of([], [], lanes=1, compression="none", seconds=0.0)
    assert (report.rows, report.connections, report.path) == (0, 0, "unknown")
