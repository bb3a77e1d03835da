"""``compression=auto``: which Arrow IPC body codec a partition uses, from measurements.

The rule (:func:`choose`) is pure: given what compressing costs on this
machine (:class:`CpuCost`, per codec: raw MB compressed per CPU second and
the ratio it reaches) and what the link carries (:class:`Link`), it picks
the codec whose pipelined time per raw MB, ``max(compress, wire * ratio)``,
is smallest. Compression and sending overlap (the encoder runs while the
connection drains earlier messages), hence the max, not the sum.

Why per partition, with no protocol change: an Arrow IPC stream says in
each message which codec its body used, so the receiver decodes whatever
each partition chose; the offer keeps saying one of ``none|lz4|zstd`` (see
:func:`offer_compression`) and older receivers accept it.

A direct path counts as fast unless measured slow: on a direct (often
loopback or LAN) path the rate we observe is bounded by our own encryption
on the same cores, and compressing would compete with it. A relayed path is
assumed slow (:data:`RELAY_PRIOR_MB_S`) until a partition's acknowledged
bytes say otherwise.

:func:`measure` (a few MB of the first batch, cached per process and schema)
and the per-process link observations are the only state; the glue feeds
them (``partition.py`` chooses, ``sender.py`` observes the wire).
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.ipc as ipc

AUTO = "auto"
# Raw MB/s at or above which a link is never worth compressing for (about a
# core's worth of lz4): a fast direct link pays nothing.
FAST_LINK_MB_S = 1000.0
# Before any measurement: a relayed path is a 100 Mbit/s-class link.
RELAY_PRIOR_MB_S = 12.5
# A direct path's measured rate counts only below this (see the module docstring).
DIRECT_SLOW_MB_S = 25.0
# A codec must win by this fraction over the next cheaper one to be chosen.
MARGIN = 0.1
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

    def text(self) -> str:
        rate = "fast" if self.mb_per_s >= FAST_LINK_MB_S else f"{self.mb_per_s:.1f} MB/s"
        return f"link {rate} {self.path}" + ("" if self.measured else " (assumed)")


@dataclass(frozen=True)
class Choice:
    """A partition's codec and why."""

    codec: str  # none, lz4, zstd
    level: int | None
    why: str

    @property
    def label(self) -> str:
        return self.codec if self.level is None else f"{self.codec}({self.level})"

    def ipc_compression(self) -> pa.Codec | None:
        if self.codec == "none":
            return None
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


def observed_link(path: str, mb_per_s: float | None) -> Link:
    """The link to decide with, from the path and a measured rate (None: none yet)."""
    if mb_per_s is None:
        return prior_link(path)
    if path != "relay" and mb_per_s >= DIRECT_SLOW_MB_S:
        return Link(float("inf"), path, measured=True)
    return Link(mb_per_s, path, measured=True)


def wire_rate(sent: int, wall: float, blocked: float) -> float | None:
    """Raw wire MB/s seen by one partition (None: nothing to go on).

    ``wall``: from its first message to the lane's answer; ``blocked``: of
    that, time spent waiting for the connection (back-pressure, the answer).
    Waiting most of the time means the link was busy all along (rate =
    bytes / wall); waiting little means it kept up, so it is at least
    faster than that: credited as if it had been busy only while we waited.
    """
    if sent < 256 * 1024 or wall <= 0:
        return None
    busy = wall if blocked >= 0.5 * wall else max(blocked, 0.05 * wall)
    return sent / busy / 1e6


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


def offer_compression(compression: str) -> str:
    """The offer's ``compression`` for an option value: ``auto`` offers ``zstd``.

    Receivers decode every codec whatever the offer says (Arrow IPC is
    self-describing); ``zstd``, the strongest codec auto may pick, keeps
    older receivers (which accept only ``none|lz4|zstd``) working.
    """
    return "zstd" if compression == AUTO else compression


# --- this process's measurements (the glue feeds them) -------------------------------------

_lock = threading.Lock()
_costs: dict[str, tuple[CpuCost, ...]] = {}
_links: dict[str, tuple[str, float | None]] = {}  # transfer -> (path, smoothed MB/s)
_choices: dict[str, dict[int, Choice]] = {}


def measure(batch: pa.RecordBatch, key: str) -> tuple[CpuCost, ...]:
    """This machine's cost per codec on a sample of ``batch`` (cached per ``key``)."""
    with _lock:
        if key in _costs:
            return _costs[key]
    sample = batch
    if batch.nbytes > SAMPLE_BYTES and batch.num_rows > 1:
        sample = batch.slice(0, max(1, batch.num_rows * SAMPLE_BYTES // batch.nbytes))
    raw = _ipc_size(sample, None)[0]
    costs = []
    for codec, level in CANDIDATES:
        size, seconds = _ipc_size(sample, pa.Codec(codec, compression_level=level))
        if raw > 0:
            costs.append(CpuCost(codec, level, raw / max(seconds, 1e-6) / 1e6, size / raw))
    with _lock:
        _costs[key] = tuple(costs)
    return tuple(costs)


def _ipc_size(batch: pa.RecordBatch, compression: pa.Codec | None) -> tuple[int, float]:
    sink = pa.BufferOutputStream()
    started = time.process_time()
    options = ipc.IpcWriteOptions(compression=compression)
    with ipc.new_stream(sink, batch.schema, options=options) as writer:
        writer.write_batch(batch)
    return sink.tell(), time.process_time() - started


def note_path(transfer_id: str, path: str) -> None:
    with _lock:
        _, rate = _links.get(transfer_id, ("unknown", None))
        _links[transfer_id] = (path, rate)


def note_wire(transfer_id: str, path: str, mb_per_s: float | None) -> None:
    """A partition's observed wire rate (smoothed: the latest counts half)."""
    with _lock:
        _, old = _links.get(transfer_id, ("unknown", None))
        rate = mb_per_s if old is None or mb_per_s is None else (old + mb_per_s) / 2
        _links[transfer_id] = (path, rate if mb_per_s is not None else old)


def link_state(transfer_id: str) -> tuple[str, float | None]:
    with _lock:
        return _links.get(transfer_id, ("unknown", None))


def current_link(transfer_id: str) -> Link:
    return observed_link(*link_state(transfer_id))


def note_choice(transfer_id: str, partition: int, choice: Choice) -> None:
    with _lock:
        _choices.setdefault(transfer_id, {})[partition] = choice


def choice_of(transfer_id: str, partition: int) -> Choice | None:
    with _lock:
        return _choices.get(transfer_id, {}).get(partition)


def stats_choices(stats: Iterable[object]) -> list[Choice]:
    """The choices carried by the partitions' stats (``report.with_choice``)."""
    found = []
    for s in stats:
        label = getattr(s, "codec", "")
        if label:
            name, _, level = label.rstrip(")").partition("(")
            found.append(Choice(name, int(level) if level else None, s.codec_why))  # type: ignore[attr-defined]
    return found


def choices(transfer_id: str) -> list[Choice]:
    """The choices of this process's partitions of a transfer, by partition."""
    with _lock:
        return [c for _, c in sorted(_choices.get(transfer_id, {}).items())]


def forget(transfer_id: str) -> None:
    with _lock:
        _links.pop(transfer_id, None)
        _choices.pop(transfer_id, None)
