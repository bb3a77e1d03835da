"""Python API for single-process peers: a laptop, a notebook kernel, a service.

::

    from spark_dilation.transfer import send_dataset, receive_table

    # one side: a pyarrow.Table, a pyarrow.dataset, or Parquet/CSV/JSON/Arrow files
    report = send_dataset(table, code="7-guitarist-revenge")

    # the other side (or spark.read.format("dilation") on a cluster)
    table = receive_table("7-guitarist-revenge")

Both sides speak the same protocol as the Spark source and sink, so any pair
works: Spark to Python, Python to Spark, Python to Python. The sender sends
its partitions in parallel over one Dilation connection per lane; a
partition whose lane vanished before confirming it is sent again.
"""

from __future__ import annotations

import logging
import math
import shutil
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq

from ..errors import TransferError
from .lane import LaneStaging, lane_receiver, read_staged
from .options import TransferOptions
from .protocol import CommittedPartition, Manifest
from .report import TransferReport, combine_paths
from .sender import ConnectionPool, LaneLostError, deliver_abort, deliver_manifest, send_partition
from .session import ReceivedFileResult, SenderSession, receive_session
from .spec import TransferSpec

log = logging.getLogger(__name__)

TARGET_PARTITION_BYTES = 64 * 1024 * 1024
MAX_ATTEMPTS = 3
_FORMATS = {
    ".parquet": "parquet",
    ".csv": "csv",
    ".json": "json",
    ".jsonl": "json",
    ".ndjson": "json",
    ".arrow": "ipc",
    ".feather": "ipc",
    ".ipc": "ipc",
}

Source = pa.Table | pa.RecordBatch | ds.Dataset | str | Path | Sequence[str | Path]


def _options(options: TransferOptions | None, overrides: dict[str, Any]) -> TransferOptions:
    base = options or TransferOptions()
    return base.with_(**overrides) if overrides else base


# --- sources -> partitions ---------------------------------------------------------------


@dataclass
class _Partitions:
    schema: pa.Schema
    makers: list[Callable[[], Iterator[pa.RecordBatch]]]


def _as_dataset(source: Any) -> ds.Dataset:
    if isinstance(source, ds.Dataset):
        return source
    paths = [Path(source)] if isinstance(source, str | Path) else [Path(p) for p in source]
    if not paths:
        raise TransferError("nothing to send: no files given")
    for p in paths:
        if not p.exists():
            raise TransferError(f"{p} does not exist")
    first = paths[0]
    if first.is_dir():
        files = sorted(f for f in first.rglob("*") if f.suffix.lower() in _FORMATS)
        if not files:
            raise TransferError(f"{first} holds no Parquet, CSV, JSON-lines or Arrow files to send")
        suffix = files[0].suffix.lower()
        return ds.dataset(first, format=_FORMATS[suffix], partitioning="hive")
    suffix = first.suffix.lower()
    if suffix not in _FORMATS:
        raise TransferError(
            f"cannot tell the format of {first.name}: name it .parquet, .csv, .json (JSON "
            "lines) or .arrow"
        )
    return ds.dataset([str(p) for p in paths], format=_FORMATS[suffix])


def _partitions(source: Any, min_partitions: int) -> _Partitions:
    if isinstance(source, pa.RecordBatch):
        source = pa.Table.from_batches([source])
    if isinstance(source, pa.Table):
        table = source
        count = max(min_partitions, math.ceil(table.nbytes / TARGET_PARTITION_BYTES), 1)
        step = max(1, math.ceil(table.num_rows / count)) if table.num_rows else 1
        slices = [table.slice(i, step) for i in range(0, max(table.num_rows, 1), step)]
        return _Partitions(table.schema, [(lambda t=t: iter(t.to_batches())) for t in slices])
    dataset = _as_dataset(source)
    fragments = list(dataset.get_fragments())
    if not fragments:
        return _Partitions(dataset.schema, [lambda: iter(())])
    schema = dataset.schema
    return _Partitions(
        schema,
        [(lambda f=f: iter(f.to_batches(schema=schema))) for f in fragments],
    )


# --- sending --------------------------------------------------------------------------------


class DatasetSender:
    """One dataset on its way out: :attr:`code` at once, :meth:`wait` for the report."""

    def __init__(
        self,
        source: Source,
        *,
        code: str | None = None,
        options: TransferOptions | None = None,
        code_length: int = 2,
    ) -> None:
        self.options = options or TransferOptions()
        # Look at the files once: the schema now, the fragments after the session.
        self._source = (
            source if isinstance(source, pa.Table | pa.RecordBatch) else _as_dataset(source)
        )
        self._session = SenderSession.open(
            self._source.schema, self.options, code=code, code_length=code_length
        )
        self.code: str = self._session.code

    def wait(self) -> TransferReport:
        """Wait for the receiver, send every partition, deliver the manifest; the report."""
        spec = self._session.wait()
        started = time.monotonic()
        parts = _partitions(self._source, spec.lanes)
        connections = ConnectionPool()
        try:
            committed = _send_all(spec, parts.makers, connections)
        except BaseException as e:
            deliver_abort(spec, f"the sender failed: {e}")
            connections.close_transfer(spec.transfer_id)
            raise
        stats = connections.stats(spec.transfer_id)
        manifest = deliver_manifest(spec, committed)
        connections.close_transfer(spec.transfer_id)
        return TransferReport(
            rows=manifest.rows,
            bytes=sum(c.bytes for c in committed),
            partitions=len(committed),
            lanes=spec.lanes,
            connections=stats.connections_opened,
            reconnects=stats.reconnects,
            path=combine_paths(stats.paths),
            seconds=time.monotonic() - started,
            compression=spec.compression,
        )


def _send_all(
    spec: TransferSpec,
    makers: list[Callable[[], Iterator[pa.RecordBatch]]],
    connections: ConnectionPool,
) -> list[CommittedPartition]:
    def one(partition: int) -> CommittedPartition:
        for attempt in range(MAX_ATTEMPTS):
            try:
                return send_partition(
                    spec, partition, attempt, makers[partition](), connections=connections
                )
            except LaneLostError as e:
                if attempt + 1 == MAX_ATTEMPTS:
                    raise
                log.info("partition %d: %s; sending it again", partition, e)
        raise AssertionError("unreachable")

    workers = max(1, min(len(makers), 2 * spec.lanes, 16))
    with ThreadPoolExecutor(max_workers=workers) as ex:
        return list(ex.map(one, range(len(makers))))


def send_dataset(
    source: Source,
    code: str | None = None,
    *,
    on_code: Callable[[str], None] | None = None,
    options: TransferOptions | None = None,
    **overrides: Any,
) -> TransferReport:
    """Send ``source`` as a dataset (blocking) and return the report.

    ``source``: a ``pyarrow.Table``, a ``pyarrow.dataset.Dataset``, or paths
    of Parquet, CSV, JSON-lines or Arrow IPC files (or a folder of them).
    Without ``code`` one is allocated and given to ``on_code`` (default: log
    it). ``overrides`` are :class:`TransferOptions` fields (``mailbox=...``).
    """
    sender = DatasetSender(source, code=code, options=_options(options, overrides))
    if on_code is not None:
        on_code(sender.code)
    else:
        log.warning("wormhole code: %s", sender.code)
    return sender.wait()


# --- receiving ------------------------------------------------------------------------------


@dataclass
class ReceivedDataset:
    """What :func:`receive_dataset` got: the report and the data where it was asked to go."""

    report: TransferReport
    schema: pa.Schema
    table: pa.Table | None = None
    files: list[Path] = field(default_factory=list)


def _wait_lanes(spec: TransferSpec) -> tuple[list[Manifest], int, int, list[str]]:
    receivers = [lane_receiver(spec, lane) for lane in range(spec.lanes)]
    if any(r is None for r in receivers):
        raise TransferError("another process on this machine is already receiving this transfer")
    for r in receivers:
        assert r is not None
        error = r.wait_finished()
        if error is not None:
            for other in receivers:
                assert other is not None
                other.stop(linger=0)
            raise error
    manifests = []
    paths = []
    connections = reconnects = 0
    for r in receivers:
        assert r is not None
        r.stop(linger=0)  # idempotent; records paths and reconnects
        manifest = r.staging.manifest()
        assert manifest is not None
        manifests.append(manifest)
        connections += r.connections_made
        reconnects += r.reconnects
        paths.extend(r.paths)
    return manifests, connections, reconnects, paths


def receive_dataset(
    code: str,
    dest: str | Path | None = None,
    *,
    format: str = "parquet",
    options: TransferOptions | None = None,
    **overrides: Any,
) -> ReceivedDataset:
    """Receive a dataset (blocking): into a ``pyarrow.Table``, or into files under ``dest``.

    ``format`` of the files: ``parquet`` (default) or ``arrow``; one file per
    sender partition, named ``part-NNNNN``. The whole transfer runs in this
    process with ``lanes`` parallel lanes.
    """
    opts = _options(options, overrides)
    if format not in ("parquet", "arrow"):
        raise TransferError(f"format={format!r}: choose parquet or arrow")
    started = time.monotonic()
    spec = receive_session(code, opts, accept_file=False)
    assert not isinstance(spec, ReceivedFileResult)
    manifests, connections, reconnects, paths = _wait_lanes(spec)
    partitions = sorted(
        (c for lane, m in enumerate(manifests) for c in m.for_lane(lane)),
        key=lambda c: c.partition,
    )
    staging = {
        lane: LaneStaging(opts.staging_root, spec.transfer_id, lane) for lane in range(spec.lanes)
    }
    result = ReceivedDataset(
        TransferReport(
            rows=sum(c.rows for c in partitions),
            bytes=sum(c.bytes for c in partitions),
            partitions=len(partitions),
            lanes=spec.lanes,
            connections=connections,
            reconnects=reconnects,
            path=combine_paths(paths),
            seconds=time.monotonic() - started,
            compression=spec.compression,
        ),
        spec.schema,
    )
    try:
        if dest is None:
            batches = [
                b
                for c in partitions
                for b in read_staged(staging[c.lane].complete_path(c.partition))
            ]
            result.table = pa.Table.from_batches(batches, schema=spec.schema)
        else:
            out = Path(dest)
            out.mkdir(parents=True, exist_ok=True)
            for c in partitions:
                src = staging[c.lane].complete_path(c.partition)
                if format == "arrow":
                    target = out / f"part-{c.partition:05d}.arrow"
                    shutil.copyfile(src, target)
                else:
                    target = out / f"part-{c.partition:05d}.parquet"
                    with pq.ParquetWriter(target, spec.schema) as writer:
                        for b in read_staged(src):
                            writer.write_batch(b)
                result.files.append(target)
    finally:
        shutil.rmtree(opts.staging_root / spec.transfer_id, ignore_errors=True)
    return result


def receive_table(code: str, **overrides: Any) -> pa.Table:
    """Receive a dataset into a ``pyarrow.Table`` (blocking)."""
    got = receive_dataset(code, **overrides)
    assert got.table is not None
    return got.table


def send_in_background(
    source: Source, code: str | None = None, **overrides: Any
) -> tuple[DatasetSender, threading.Thread, dict[str, Any]]:
    """Start a send in a thread: (sender with .code, thread, box with "report"/"error")."""
    sender = DatasetSender(source, code=code, options=_options(None, overrides))
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["report"] = sender.wait()
        except BaseException as e:
            box["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return sender, thread, box


__all__ = [
    "DatasetSender",
    "ReceivedDataset",
    "receive_dataset",
    "receive_table",
    "send_dataset",
    "send_in_background",
]
