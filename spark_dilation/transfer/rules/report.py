"""The transfer report: what moved, how, and how long it took."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any


@dataclass(frozen=True)
class ConnectionStats:
    """What one sending process contributed (carried in each task's commit message)."""

    process: str  # "host:pid"
    connections_opened: int
    reconnects: int
    paths: tuple[str, ...]  # "direct" / "relay" per connection seen
    reconnecting: int = 0  # connections down right now and being re-established
    relay_fallbacks: int = 0  # connections relayed although both sides offered direct hints
    connecting: int = 0  # connections never up yet (first attempts under way)
    # compression=auto: the codec this partition chose ("zstd(1)") and why.
    codec: str = ""
    codec_why: str = ""


def with_choice(stats: ConnectionStats, choice: Any) -> ConnectionStats:
    """``stats`` carrying a partition's :class:`.codec.Choice` (None: a fixed codec)."""
    if choice is None:
        return stats
    return replace(stats, codec=choice.label, codec_why=choice.why)


@dataclass(frozen=True)
class TransferReport:
    rows: int
    bytes: int
    partitions: int
    lanes: int
    # Dilation connections opened by the sending processes: the tasks' pools
    # (one per process and lane) and the commit's (one per lane, for the manifest).
    connections: int
    reconnects: int
    path: str  # "direct", "relay", "direct+relay" or "unknown"
    seconds: float
    compression: str = "none"
    # Connections that went through the relay although both sides offered
    # direct hints (each logged a warning naming the hints): a firewall or a
    # routing problem between the machines. In the summary only when non-zero.
    relay_fallbacks: int = 0
    # What the partitions' codecs were and why, where the option alone does not say:
    # compression=auto (codec.describe()), or parquet sent as zstd (codec.fallback_detail()).
    compression_detail: str = ""

    @classmethod
    def of(
        cls,
        partitions: Sequence[Any],
        stats: Iterable[ConnectionStats],
        *,
        lanes: int,
        compression: str,
        seconds: float,
        control: int = 0,
        compression_detail: str = "",
    ) -> TransferReport:
        """The report of a transfer of ``partitions`` (committed: ``rows``, ``bytes``).

        ``stats``: what each sending process's connections did, merged as
        :func:`merge_stats` does (the receiving side: one per lane);
        ``control``: connections opened besides those, for the manifest.
        """
        stats = list(stats)
        connections, reconnects, path = merge_stats(stats)
        return cls(
            rows=sum(c.rows for c in partitions),
            bytes=sum(c.bytes for c in partitions),
            partitions=len(partitions),
            lanes=lanes,
            connections=connections + control,
            reconnects=reconnects,
            path=path,
            seconds=seconds,
            compression=compression,
            relay_fallbacks=merge_relay_fallbacks(stats),
            compression_detail=compression_detail,
        )

    @property
    def rows_per_s(self) -> float:
        return self.rows / self.seconds if self.seconds > 0 else 0.0

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "rows_per_s": round(self.rows_per_s, 1)})

    def summary(self) -> str:
        mb = self.bytes / 1e6
        fallbacks = (
            f"{self.relay_fallbacks} relay fallback(s) despite direct hints, "
            if self.relay_fallbacks
            else ""
        )
        return (
            f"{self.rows:,} rows, {mb:,.1f} MB in {self.partitions} partitions over "
            f"{self.lanes} lanes, {self.connections} Dilation connection(s) ({self.path}), "
            f"{self.reconnects} reconnect(s), {fallbacks}{self.seconds:.1f} s "
            f"({self.rows_per_s:,.0f} rows/s)"
        ) + (
            f"; compression {self.compression}: {self.compression_detail}"
            if self.compression_detail
            else ""
        )


def path_of(description: str | None) -> str:
    """``direct``/``relay`` from a Dilation status' connection description."""
    if not description:
        return "unknown"
    return "relay" if "relay" in description else "direct"


def reconnects_of(status: Any) -> int:
    """Times a Dilation connection came back: L2 connections made after the first.

    Not the generation number, which also counts attempts that never connected.
    """
    return max(0, status.connections - 1)


def is_reconnecting(status: Any) -> bool:
    """Was up, is down and trying to come back: not given up, not stopped."""
    return status.connections > 0 and _trying(status)


def is_connecting(status: Any) -> bool:
    """Never up yet and trying (a connection never up is not "reconnecting")."""
    return status.connections == 0 and _trying(status)


def _trying(status: Any) -> bool:
    return status.connection is None and status.down_since is not None and not status.error


@dataclass(frozen=True)
class StatusTally:
    """What a set of Dilation connections' statuses say together (see :func:`tally`)."""

    paths: tuple[str, ...] = ()  # "direct" / "relay" / "unknown", one per connection
    reconnects: int = 0
    reconnecting: int = 0  # down now and being re-established
    connecting: int = 0  # never up yet, first attempts under way
    relay_fallbacks: int = 0


def tally(statuses: Iterable[Any]) -> StatusTally:
    """Count over Dilation connection statuses: paths, reconnects, how many are
    reconnecting or still connecting now, relay fallbacks."""
    statuses = list(statuses)
    return StatusTally(
        paths=tuple(path_of(s.connection) for s in statuses),
        reconnects=sum(reconnects_of(s) for s in statuses),
        reconnecting=sum(is_reconnecting(s) for s in statuses),
        connecting=sum(is_connecting(s) for s in statuses),
        relay_fallbacks=sum(s.relay_fallbacks for s in statuses),
    )


def combine_paths(paths: Iterable[str]) -> str:
    seen = sorted({p for p in paths if p != "unknown"})
    return "+".join(seen) if seen else "unknown"


def latest_stats(stats: Iterable[ConnectionStats]) -> list[ConnectionStats]:
    """The latest stats of each process (the most connections opened)."""
    latest: dict[str, ConnectionStats] = {}
    for s in stats:
        old = latest.get(s.process)
        if old is None or s.connections_opened >= old.connections_opened:
            latest[s.process] = s
    return list(latest.values())


def merge_stats(stats: Iterable[ConnectionStats]) -> tuple[int, int, str]:
    """(connections, reconnects) over the latest stats of each process; the paths
    seen in any of them (a process's last snapshot may come after its connections
    closed, when no path is known any more)."""
    stats = list(stats)
    latest = latest_stats(stats)
    connections = sum(s.connections_opened for s in latest)
    reconnects = sum(s.reconnects for s in latest)
    return connections, reconnects, combine_paths(p for s in stats for p in s.paths)


def merge_relay_fallbacks(stats: Iterable[ConnectionStats]) -> int:
    """Relay fallbacks over the latest stats of each process (see ``TransferReport``)."""
    return sum(s.relay_fallbacks for s in latest_stats(stats))


@dataclass(frozen=True)
class Progress:
    """A snapshot of a transfer under way, for progress bars and scripts.

    ``rows``/``bytes`` count what the receiver has so far, in wire bytes (the
    summary's measure): on the sending side the bytes the lanes acknowledged and
    the rows in their share of what was sent, on the receiving side the rows and
    bytes of the messages arrived (kept partitions and streams under way).
    ``total_rows`` is known when the source says cheaply (a table, Parquet or
    Arrow files), ``total_bytes`` for plain files.
    ``path``, ``connections`` and ``reconnects`` describe the live Dilation
    (or Transit) connections, ``reconnecting`` that one is down and being
    re-established right now; ``done`` marks the last snapshot.
    """

    side: str  # "send" or "receive"
    rows: int
    bytes: int
    seconds: float
    partitions: int = 0  # partitions confirmed (sender) or staged (receiver)
    total_rows: int | None = None
    total_bytes: int | None = None
    connections: int = 0
    reconnects: int = 0
    path: str = "unknown"
    done: bool = False
    reconnecting: bool = False  # a connection is down and being re-established
    connecting: bool = False  # no connection was ever up yet; the first is being made

    @property
    def rows_per_s(self) -> float:
        return self.rows / self.seconds if self.seconds > 0 else 0.0

    @property
    def bytes_per_s(self) -> float:
        return self.bytes / self.seconds if self.seconds > 0 else 0.0

    @property
    def eta_seconds(self) -> float | None:
        """Seconds left at the average rate so far, when the total is known."""
        if self.done:
            return 0.0
        if self.total_rows and self.rows:
            return max(0.0, (self.total_rows - self.rows) / self.rows_per_s)
        if self.total_bytes and self.bytes:
            return max(0.0, (self.total_bytes - self.bytes) / self.bytes_per_s)
        return None

    def to_dict(self) -> dict[str, object]:
        eta = self.eta_seconds
        return {
            **asdict(self),
            "seconds": round(self.seconds, 3),
            "rows_per_s": round(self.rows_per_s, 1),
            "bytes_per_s": round(self.bytes_per_s, 1),
            "eta_seconds": None if eta is None else round(eta, 1),
        }
