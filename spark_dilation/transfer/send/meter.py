"""This process's measurements for ``compression=auto`` (the rule is :mod:`..rules.codec`).

What compressing costs on this machine (measured once per schema on a sample
of the first batch), the path and rate of each transfer's connections (the
pool's watch samples them), and the codec each partition chose (for the
report). Process-wide and thread-safe; :func:`forget` drops a transfer's.
"""

from __future__ import annotations

import threading
import time

import pyarrow as pa
import pyarrow.ipc as ipc

from ..rules import pqformat
from ..rules.codec import (
    CANDIDATES,
    PARQUET,
    SAMPLE_BYTES,
    Choice,
    CpuCost,
    Link,
    WireMeter,
    observed_link,
)

_lock = threading.Lock()


_costs: dict[str, tuple[CpuCost, ...]] = {}


_paths: dict[str, str] = {}  # transfer -> the path of its connections


_meters: dict[str, WireMeter] = {}


_choices: dict[str, dict[int, Choice]] = {}


def measure(batch: pa.RecordBatch, key: str, parquet: bool = False) -> tuple[CpuCost, ...]:
    """This machine's cost per codec on a sample of ``batch`` (cached per ``key``);
    ``parquet``: the receiver decodes the Parquet format, measure it too."""
    key = f"{key}/{parquet}"
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
    if parquet and raw > 0:
        # Last: chosen only if it beats zstd by the margin (on bytes or CPU). A first,
        # untimed frame imports pyarrow.parquet: timed, the import made a 440 MB/s
        # encoder measure 20 MB/s in a Spark worker.
        pqformat.encode_chunk(pa.Table.from_batches([sample.slice(0, 64)]))
        started = time.process_time()
        size = len(pqformat.encode_chunk(pa.Table.from_batches([sample])))
        seconds = time.process_time() - started
        costs.append(CpuCost(PARQUET, None, raw / max(seconds, 1e-6) / 1e6, size / raw))
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
        _paths[transfer_id] = path


def note_progress(
    transfer_id: str, now: float, acked: dict[object, int], queued: dict[object, int]
) -> None:
    """A sample of the transfer's connections (the sender pool's watch feeds it)."""
    with _lock:
        meter = _meters.setdefault(transfer_id, WireMeter())
        meter.sample(now, acked, queued)


def link_state(transfer_id: str) -> tuple[str, float | None, bool]:
    """(path, measured MB/s or None, whether the rate is exact rather than a lower bound)."""
    with _lock:
        path = _paths.get(transfer_id, "unknown")
        meter = _meters.get(transfer_id)
        if meter is None or meter.estimate is None:
            return path, None, True
        return path, *meter.estimate


def current_link(transfer_id: str) -> Link:
    return observed_link(*link_state(transfer_id))


def note_choice(transfer_id: str, partition: int, choice: Choice) -> None:
    with _lock:
        _choices.setdefault(transfer_id, {})[partition] = choice


def choice_of(transfer_id: str, partition: int) -> Choice | None:
    with _lock:
        return _choices.get(transfer_id, {}).get(partition)


def choices(transfer_id: str) -> list[Choice]:
    """The choices of this process's partitions of a transfer, by partition."""
    with _lock:
        return [c for _, c in sorted(_choices.get(transfer_id, {}).items())]


def forget(transfer_id: str) -> None:
    with _lock:
        _paths.pop(transfer_id, None)
        _meters.pop(transfer_id, None)
        _choices.pop(transfer_id, None)
