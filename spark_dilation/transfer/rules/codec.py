"""``compression=auto``: which codec a partition uses, from measurements.

The rule (:func:`choose`) is pure: given what compressing costs on this
machine (:class:`CpuCost`, per codec: raw MB compressed per CPU second and
the ratio it reaches) and what the link carries (:class:`Link`), it picks
the codec whose pipelined time per raw MB, ``max(compress, wire * ratio)``,
is smallest. Compression and sending overlap (the encoder runs while the
connection drains earlier messages), hence the max, not the sum.

Why per partition, with no protocol change: an Arrow IPC stream says in
each message which codec its body used, so the receiver decodes whatever
each partition chose; the offer keeps saying one of ``none|lz4|zstd`` (see
:func:`offer_compression`) and older receivers accept it. The ``parquet``
format (:mod:`.pqformat`: Parquet's column encodings, then zstd) is a
candidate only where the receiver's answer listed it; each partition's
header names what it chose.

A direct path counts as fast unless measured slow: on a direct (often
loopback or LAN) path the rate we observe is bounded by our own encryption
on the same cores, and compressing would compete with it. A relayed path is
assumed slow (:data:`RELAY_PRIOR_MB_S`) until the lanes' acknowledged
bytes say otherwise (:class:`WireMeter`).

:func:`measure` (a few MB of the first batch, cached per process and schema)
and the per-process link meters are the only state; the glue feeds them
(``send/stream.py`` chooses, the sender pool's watch samples its connections)
live in :mod:`..send.meter`; this module keeps the rule.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import pyarrow as pa

from .pqformat import FORMAT as PARQUET

AUTO = "auto"
# Raw MB/s at or above which a link is never worth compressing for (about a
# core's worth of lz4): a fast direct link pays nothing.
FAST_LINK_MB_S = 1000.0
# Before any measurement (the first partitions choose before a byte has moved):
# a relayed path is a 40 Mbit/s link, the public relay's tens of Mbit/s. Erring
# slow is cheap (the CPU compresses harder while the link is still fast enough
# to need it), erring fast is not (every extra byte waits on a slow link).
RELAY_PRIOR_MB_S = 5.0
# A direct path's measured rate counts only below this (see the module docstring).
DIRECT_SLOW_MB_S = 25.0
# A codec must win by this fraction over the next cheaper one to be chosen.
MARGIN = 0.1
# The wire meter: seconds of ACKs a rate is taken over, and the un-ACKed bytes
# on a connection that mean the link, not the senders, sets the pace.
METER_WINDOW = 4.0
BACKLOG_BYTES = 1024 * 1024
# The sample of the first batch measured per codec.
SAMPLE_BYTES = 4 * 1024 * 1024
# Candidates besides none, cheapest CPU first: (codec, level).
CANDIDATES: tuple[tuple[str, int | None], ...] = (("lz4", None), ("zstd", 1), ("zstd", 3))


@dataclass(frozen=True)
class CpuCost:
    """What compressing with ``codec`` (``level``) costs here: raw MB per CPU second, ratio."""

    codec: str
    level: int | None
    mb_per_s: float
    ratio: float  # compressed / raw bytes

    @property
    def label(self) -> str:
        return self.codec if self.level is None else f"{self.codec}({self.level})"


@dataclass(frozen=True)
class Link:
    """What the connection to the lanes carries: raw wire MB/s, the path, measured or assumed."""

    mb_per_s: float
    path: str  # "direct", "relay", "unknown"
    measured: bool = False
    # Measured while the senders could not keep it busy: it carries at least this.
    at_least: bool = False

    def text(self) -> str:
        rate = "fast" if self.mb_per_s >= FAST_LINK_MB_S else f"{self.mb_per_s:.1f} MB/s"
        if self.at_least and self.mb_per_s < FAST_LINK_MB_S:
            rate = f"at least {rate}"
        return f"link {rate} {self.path}" + ("" if self.measured else " (assumed)")


@dataclass(frozen=True)
class Choice:
    """A partition's codec and why."""

    codec: str  # none, lz4, zstd, parquet
    level: int | None
    why: str

    @property
    def label(self) -> str:
        return self.codec if self.level is None else f"{self.codec}({self.level})"

    def encoder_compression(self) -> str | pa.Codec | None:
        """What :class:`~.protocol.PartitionEncoder` takes for this choice."""
        if self.codec in ("none", PARQUET):
            return self.codec
        return pa.Codec(self.codec, compression_level=self.level)


def choose(costs: Sequence[CpuCost], link: Link) -> Choice:
    """The codec with the smallest pipelined time per raw MB (pure)."""
    why = link.text()
    if link.mb_per_s >= FAST_LINK_MB_S or not costs:
        return Choice("none", None, why)
    best: CpuCost | None = None
    best_time = 1.0 / link.mb_per_s  # none: wire time alone
    for cost in costs:
        t = max(1.0 / cost.mb_per_s, cost.ratio / link.mb_per_s)
        if t < best_time * (1 - MARGIN):
            best, best_time = cost, t
    if best is None:
        return Choice("none", None, why)
    why += f", {best.label} {best.mb_per_s:.0f} MB/s ratio {best.ratio:.2f}"
    return Choice(best.codec, best.level, why)


def prior_link(path: str) -> Link:
    """The link assumed before any measurement: slow if relayed, else fast."""
    return Link(RELAY_PRIOR_MB_S if path == "relay" else float("inf"), path)


def observed_link(path: str, mb_per_s: float | None, exact: bool = True) -> Link:
    """The link to decide with, from the path and a measured rate (None: none yet).

    ``exact``: the rate was measured while the link was the bottleneck; else
    it is a lower bound (the senders could not keep the link busy).
    """
    prior = prior_link(path)
    if mb_per_s is None or (not exact and mb_per_s <= prior.mb_per_s):
        return prior  # a lower bound under the assumption does not contradict it
    if path != "relay" and mb_per_s >= DIRECT_SLOW_MB_S:
        return Link(float("inf"), path, measured=True)
    return Link(mb_per_s, path, measured=True, at_least=not exact)


class WireMeter:
    """How fast one transfer's connections deliver, from the peer's ACKs (pure: fed samples).

    Partitions in flight at once share one network link (every lane's
    connection leaves through it), and each connection buffers megabytes
    before back-pressure, so neither one partition's nor the bytes handed
    over say what the link carries. The meter adds up what the lanes
    acknowledged over the last :data:`METER_WINDOW` seconds. When a
    connection had a backlog (:data:`BACKLOG_BYTES` un-ACKed) in most samples,
    the link set the pace and the rate is the link's; otherwise the senders
    (CPU, the source) set it and the rate is only a lower bound.
    """

    def __init__(self, window: float = 0.0) -> None:
        self.window = window or METER_WINDOW
        self._last: dict[object, int] = {}  # connection -> its acked bytes at the last sample
        self._samples: deque[tuple[float, int, bool]] = deque()  # (time, new acked, backlog)
        self.estimate: tuple[float, bool] | None = None  # (MB/s, exact), kept between partitions

    def sample(self, now: float, acked: dict[object, int], queued: dict[object, int]) -> None:
        """Every connection's acked and un-ACKed bytes at ``now`` (a new connection starts at 0)."""
        new = sum(max(0, n - self._last.get(c, 0)) for c, n in acked.items())
        self._last = dict(acked)
        backlog = any(q >= BACKLOG_BYTES for q in queued.values())
        self._samples.append((now, new, backlog))
        while len(self._samples) > 2 and self._samples[1][0] <= now - self.window:
            self._samples.popleft()
        span = now - self._samples[0][0]
        moved = sum(n for _, n, _ in list(self._samples)[1:])
        if span >= 0.5 * self.window and moved >= 256 * 1024:
            backlogged = sum(b for _, _, b in self._samples) >= 0.5 * len(self._samples)
            self.estimate = (moved / span / 1e6, backlogged)


def describe(choices: Iterable[Choice]) -> str:
    """``zstd(1) for 7 of 8 partitions, none for 1 (link 11.8 MB/s relay, ...)``."""
    choices = list(choices)
    if not choices:
        return "no partitions"
    counts = Counter(c.label for c in choices)
    (top, n), *rest = counts.most_common()
    text = f"{top} for {n} of {len(choices)} partitions"
    text += "".join(f", {label} for {k}" for label, k in rest)
    last = next(c for c in reversed(choices) if c.label == top)
    return f"{text} ({last.why})"


def fallback_detail(compression: str, refused: str, partitions: int) -> str:
    """``compression=parquet`` that sent zstd instead, and why ("" otherwise): the report
    says what went over the wire, not only what was asked for."""
    if compression != PARQUET or not refused:
        return ""
    return f"zstd for {partitions} of {partitions} partitions ({refused})"


def offer_compression(compression: str) -> str:
    """The offer's ``compression`` for an option value: ``auto`` and ``parquet`` offer ``zstd``.

    Receivers decode every codec whatever the offer says (Arrow IPC is
    self-describing); ``zstd``, the strongest Arrow IPC codec, keeps older
    receivers (which accept only ``none|lz4|zstd``, and list no formats in
    their answer, so they never get ``parquet``) working.
    """
    return "zstd" if compression in (AUTO, PARQUET) else compression


def stats_choices(stats: Iterable[object]) -> list[Choice]:
    """The choices carried by the partitions' stats (``report.with_choice``)."""
    found = []
    for s in stats:
        label = getattr(s, "codec", "")
        if label:
            name, _, level = label.rstrip(")").partition("(")
            found.append(Choice(name, int(level) if level else None, s.codec_why))  # type: ignore[attr-defined]
    return found
