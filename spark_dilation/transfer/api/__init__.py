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
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.dataset as ds
import pyarrow.parquet as pq

from ...dilation.manager import DilationNoPath
from ...errors import Interrupted, TransferCancelledError, TransferError, interrupt_cause
from ..machine import os_cause
from ..meet.hub import SenderHub
from ..meet.rendezvous import ReadingEnd, forget, sender_set
from ..meet.session import ReceivedFileResult, SenderSession, receive_session
from ..receive.lane import LaneReceiver, LocalCauses, lane_receiver
from ..receive.staging import LaneStaging, read_staged
from ..rules import codec
from ..rules.errors import OutputError, TransferAbortedError
from ..rules.options import RECEIVE_FORMATS, TransferOptions
from ..rules.protocol import Abort, CommittedPartition, Manifest
from ..rules.report import Progress, TransferReport, combine_paths
from ..rules.spec import TransferSpec
from ..send.pool import (
    ConnectionPool,
    LaneLostError,
    deliver_abort,
    deliver_manifest,
    send_partition,
)

log = logging.getLogger(__name__)

TARGET_PARTITION_BYTES = 64 * 1024 * 1024
# Telling the other side of a cancel: a round trip on a live connection, after
# the data already queued on it (up to about 12 MiB: instant on a fast link).
CANCEL_TELL_TIMEOUT = 10.0
CANCEL_LINGER = 5.0  # for our answer to the receiver's end to get through
DIRECTORY_ANSWER_WAIT = 0.5  # s: the receiver's end through the mailbox, if in-band came first
MAX_ATTEMPTS = 3
PROGRESS_INTERVAL = 0.5  # seconds between progress snapshots
ProgressCallback = Callable[[Progress], None]
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


def _data_files(path: Path) -> list[Path]:
    """The data files under a folder, skipping hidden and ``_``-prefixed names (``_SUCCESS``)."""
    return sorted(
        f
        for f in path.rglob("*")
        if f.is_file()
        and f.suffix.lower() in _FORMATS
        and not any(part.startswith((".", "_")) for part in f.relative_to(path).parts)
    )


def _format_of(path: Path) -> str:
    suffix = path.suffix.lower()
    if suffix not in _FORMATS:
        raise TransferError(
            f"cannot tell the format of {path.name}: name it .parquet, .csv, .json/.jsonl "
            "(JSON lines) or .arrow/.feather (Arrow IPC)"
        )
    return _FORMATS[suffix]


def _as_dataset(source: Any) -> ds.Dataset:
    """A ``pyarrow.dataset`` over files and folders of one format (folders: Hive partitions)."""
    if isinstance(source, ds.Dataset):
        return source
    paths = [Path(source)] if isinstance(source, str | Path) else [Path(p) for p in source]
    if not paths:
        raise TransferError("nothing to send: no files given")
    files: list[Path] = []
    for p in paths:
        if not p.exists():
            raise TransferError(f"{p} does not exist")
        if p.is_dir():
            found = _data_files(p)
            if not found:
                raise TransferError(f"{p} holds no Parquet, CSV, JSON-lines or Arrow files to send")
            files += found
        else:
            files.append(p)
    formats = {_format_of(f) for f in files}
    if len(formats) > 1:
        raise TransferError(
            f"the files to send mix formats ({', '.join(sorted(formats))}): send one format "
            "at a time"
        )
    (fmt,) = formats
    folder = paths[0] if len(paths) == 1 and paths[0].is_dir() else None
    try:
        if folder is not None:
            return ds.dataset(
                [str(f) for f in files],
                format=fmt,
                partitioning="hive",
                partition_base_dir=str(folder),
            )
        return ds.dataset([str(f) for f in files], format=fmt)
    except (pa.ArrowException, OSError) as e:
        kind = {"parquet": "Parquet", "csv": "CSV", "json": "JSON lines", "ipc": "Arrow IPC"}
        raise TransferError(f"cannot read {files[0]} as {kind[fmt]}: {e}") from e


def _total_rows(source: pa.Table | pa.RecordBatch | ds.Dataset) -> int | None:
    """The row count if the source knows it cheaply (tables; Parquet and Arrow metadata)."""
    if isinstance(source, pa.Table | pa.RecordBatch):
        return source.num_rows
    if isinstance(source, ds.FileSystemDataset) and source.format.default_extname in (
        "parquet",
        "arrow",
        "feather",
        "ipc",
    ):
        try:
            return source.count_rows()
        except (pa.ArrowException, OSError):
            return None
    return None


def _total_bytes(source: pa.Table | pa.RecordBatch | ds.Dataset) -> int | None:
    """An estimate of the data's size: a table's ``nbytes``, the files' sizes; else None."""
    if isinstance(source, pa.Table | pa.RecordBatch):
        return source.nbytes
    if isinstance(source, ds.FileSystemDataset):
        try:
            return sum(os.path.getsize(f) for f in source.files)
        except OSError:
            return None
    return None


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
        self._total_rows = _total_rows(self._source)
        self._session = SenderSession.open(
            self._source.schema,
            self.options,
            code=code,
            code_length=code_length,
            rows=self._total_rows,
            nbytes=_total_bytes(self._source),
        )
        self.code: str = self._session.code
        self._cancelled = threading.Event()
        self._cause = "cancel() was called"
        self._lock = threading.Lock()
        self._under_way: tuple[str, ConnectionPool] | None = None

    def cancel(self, cause: str | None = None) -> None:
        """Stop this send: a receiver not yet met will not be met; partitions under
        way stop within about a second and the receiver is told ("the sender
        cancelled the transfer (``cause``)"). :meth:`wait` then raises
        :class:`~spark_dilation.errors.TransferCancelledError`. Ctrl-C
        (``KeyboardInterrupt``) in :meth:`wait` takes the same path and raises
        :class:`~spark_dilation.errors.Interrupted`."""
        with self._lock:
            if cause:
                self._cause = cause
            self._cancelled.set()
            under_way = self._under_way
        self._session.cancel()
        if under_way is not None:
            under_way[1].fail(under_way[0], self._cancelled_error())

    def _cancelled_error(self) -> TransferCancelledError:
        return TransferCancelledError(f"the send with code {self.code} was cancelled")

    def _unless_cancelled(
        self, makers: list[Callable[[], Iterator[pa.RecordBatch]]]
    ) -> list[Callable[[], Iterator[pa.RecordBatch]]]:
        def checked(maker: Callable[[], Iterator[pa.RecordBatch]]) -> Iterator[pa.RecordBatch]:
            for batch in maker():
                if self._cancelled.is_set():
                    raise self._cancelled_error()
                yield batch

        return [(lambda m=m: checked(m)) for m in makers]

    def wait(
        self,
        on_progress: ProgressCallback | None = None,
        *,
        interval: float = PROGRESS_INTERVAL,
        on_waiting: Callable[[], None] | None = None,
    ) -> TransferReport:
        """Wait for the receiver, send every partition, deliver the manifest; the report.

        ``on_progress`` gets a :class:`Progress` every ``interval`` seconds
        while partitions move (from a helper thread), and a last one with
        ``done=True``. ``on_waiting`` is called first, where a Ctrl-C already
        cancels the wait as one (the CLI's "waiting for the receiver" line).
        """
        try:
            if on_waiting is not None:
                on_waiting()
            spec = self._session.wait()
        except KeyboardInterrupt as e:
            self._session.cancel()
            raise Interrupted(interrupt_cause(e), "no receiver had taken the dataset") from None
        except Exception as e:
            if self._cancelled.is_set():
                raise TransferCancelledError(
                    f"the send with code {self.code} was cancelled before a receiver used it"
                ) from e
            raise
        connections = ConnectionPool()
        # The writing end of the transfer's directory: this process is sender 0. The
        # receiver's end can come through it, ahead of the data queued toward the receiver.
        hub = SenderHub(
            spec,
            on_abort=lambda abort: connections.fail(
                spec.transfer_id, TransferAbortedError(abort.text("receiver"))
            ),
        )
        try:
            return self._send(spec, connections, hub.answered, on_progress, interval)
        finally:
            hub.close()

    def _send(
        self,
        spec: TransferSpec,
        connections: ConnectionPool,
        answered: threading.Event,
        on_progress: ProgressCallback | None,
        interval: float,
    ) -> TransferReport:
        started = time.monotonic()
        parts = _partitions(self._source, spec.lanes)
        parts.makers = self._unless_cancelled(parts.makers)
        with self._lock:
            self._under_way = (spec.transfer_id, connections)
        if self._cancelled.is_set():  # cancel() came just before
            connections.fail(spec.transfer_id, self._cancelled_error())
        meter = _SendMeter(spec.transfer_id, connections, self._total_rows, started)
        ticker = _Ticker(meter.snapshot, on_progress, interval)
        try:
            committed = _send_all(spec, meter.wrap(parts.makers), connections, meter)
        except BaseException as e:
            ticker.stop(final=False)
            ended = self._ended(spec, connections, e)
            # The receiver ended it: it waits for our answer. The directory link carries
            # it (at once); else it queues behind the data we had sent, and closing now
            # would drop it. Else the lanes were told already.
            linger = 0.0
            if connections.receiver_ended(spec.transfer_id):
                linger = 0.0 if answered.wait(DIRECTORY_ANSWER_WAIT) else CANCEL_LINGER
            connections.close_transfer(spec.transfer_id, linger=linger)
            if ended is e:
                raise
            raise ended from e
        ticker.stop()
        stats = connections.stats(spec.transfer_id)
        try:
            # Answered once the receiver has the data where it asked, or with its error.
            # On the connections that carried the data: no new meeting, so the mailbox
            # is not needed to finish.
            manifest, control = deliver_manifest(spec, committed, connections)
        finally:
            connections.close_transfer(spec.transfer_id)
        return TransferReport(
            rows=manifest.rows,
            bytes=sum(c.bytes for c in committed),
            partitions=len(committed),
            lanes=spec.lanes,
            connections=stats.connections_opened + control,
            reconnects=stats.reconnects,
            path=combine_paths(stats.paths),
            seconds=time.monotonic() - started,
            compression=spec.compression,
            relay_fallbacks=stats.relay_fallbacks,
            compression_detail=_auto_detail(spec, len(committed)),
        )

    def _ended(
        self, spec: TransferSpec, connections: ConnectionPool, error: BaseException
    ) -> BaseException:
        """Tell the receiver the send ended (unless it ended it); the error to raise."""
        tid = spec.transfer_id
        if connections.receiver_ended(tid):
            return connections.failure(tid) or error  # the receiver's reason, not ours
        interrupted = isinstance(error, KeyboardInterrupt)
        if interrupted or self._cancelled.is_set():
            cause = interrupt_cause(error) if interrupted else self._cause
            connections.fail(tid, self._cancelled_error())  # Ctrl-C: stop what still runs
            told = deliver_abort(
                spec, cause, CANCEL_TELL_TIMEOUT, connections, cancelled=True, reached_only=True
            )
            outcome = "the receiver was told" if told else "the receiver could not be told"
            if interrupted:
                return Interrupted(cause, outcome)
            return TransferCancelledError(
                f"the send with code {self.code} was cancelled ({cause}); {outcome}"
            )
        connections.fail(tid, error)
        if not isinstance(error, DilationNoPath):  # no path: nothing would reach the lanes
            reason = str(error) or type(error).__name__
            deliver_abort(spec, reason, connections=connections, reached_only=True)
        return error


def _auto_detail(spec: TransferSpec, partitions: int) -> str:
    """compression=auto: what this process's partitions chose (then forgets them);
    parquet sent as zstd: why."""
    if spec.compression != codec.AUTO:
        return codec.fallback_detail(spec.compression, spec.parquet_refused(), partitions)
    detail = codec.describe(codec.choices(spec.transfer_id))
    codec.forget(spec.transfer_id)
    return detail


class _Ticker:
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


class _SendMeter:
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


def _send_all(
    spec: TransferSpec,
    makers: list[Callable[[], Iterator[pa.RecordBatch]]],
    connections: ConnectionPool,
    meter: _SendMeter | None = None,
) -> list[CommittedPartition]:
    failed: list[BaseException] = []  # the first error ends the send: no partition starts after

    def one(partition: int) -> CommittedPartition:
        for attempt in range(MAX_ATTEMPTS):
            if failed:
                raise failed[0]
            try:
                committed = send_partition(
                    spec, partition, attempt, makers[partition](), connections=connections
                )
                if meter is not None:
                    meter.committed += 1
                return committed
            except LaneLostError as e:
                if attempt + 1 == MAX_ATTEMPTS:
                    failed.append(e)
                    raise
                log.info("partition %d: %s; sending it again", partition, e)
            except BaseException as e:
                failed.append(e)
                raise
        raise AssertionError("unreachable")

    workers = max(1, min(len(makers), 2 * spec.lanes, 16))
    ex = ThreadPoolExecutor(max_workers=workers)
    futures = [ex.submit(one, p) for p in range(len(makers))]
    try:
        wait(futures, return_when=FIRST_EXCEPTION)
        if failed:
            # The first failure ends the transfer (the cause, not whichever partition
            # came first): the other partitions stop at once.
            connections.fail(spec.transfer_id, failed[0])
            raise failed[0]
    except KeyboardInterrupt as e:
        cancelled = TransferCancelledError(f"cancelled ({interrupt_cause(e)})")
        connections.fail(spec.transfer_id, cancelled)
        raise
    finally:
        ex.shutdown(wait=True, cancel_futures=True)  # quick: fail() cut every stream
    return [f.result() for f in futures]


def send_dataset(
    source: Source,
    code: str | None = None,
    *,
    on_code: Callable[[str], None] | None = None,
    on_progress: ProgressCallback | None = None,
    options: TransferOptions | None = None,
    **overrides: Any,
) -> TransferReport:
    """Send ``source`` as a dataset (blocking) and return the report.

    ``source``: a ``pyarrow.Table``, a ``pyarrow.dataset.Dataset``, or paths
    of Parquet, CSV, JSON-lines or Arrow IPC files (or a folder of them).
    Without ``code`` one is allocated and given to ``on_code`` (default: log
    it). ``on_progress`` gets :class:`Progress` snapshots (see
    :meth:`DatasetSender.wait`). ``overrides`` are :class:`TransferOptions`
    fields (``mailbox=...``).
    """
    sender = DatasetSender(source, code=code, options=_options(options, overrides))
    if on_code is not None:
        on_code(sender.code)
    else:
        log.warning("wormhole code: %s", sender.code)
    return sender.wait(on_progress)


# --- receiving ------------------------------------------------------------------------------


@dataclass
class ReceivedDataset:
    """What :func:`receive_dataset` got: the report and the data where it was asked to go."""

    report: TransferReport
    schema: pa.Schema
    table: pa.Table | None = None
    files: list[Path] = field(default_factory=list)


def format_refusal(schema: pa.Schema, format: str) -> str | None:
    """Why files of ``format`` cannot hold ``schema`` (``None`` if they can)."""
    if format not in RECEIVE_FORMATS:
        return f"format={format!r}: choose {', '.join(RECEIVE_FORMATS)}"
    if format == "csv":
        nested = [
            f"{f.name} ({f.type})"
            for f in schema
            if pa.types.is_nested(f.type) or pa.types.is_dictionary(f.type)
        ]
        if nested:
            return (
                f"CSV cannot hold the nested column(s) {', '.join(nested)}: receive as parquet "
                "or arrow instead"
            )
    return None


class _ReceiveMeter:
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


class _Delivery:
    """The receiver's answer to every lane's final manifest, given once (``before_ok``).

    The lanes' control threads wait here without a deadline of their own: the
    receiving thread always gives the answer (in ``receive_agreed``'s finally).
    """

    def __init__(self) -> None:
        self._given = threading.Event()
        self._error: str | None = None

    def give(self, error: str | None) -> None:
        if not self._given.is_set():
            self._error = error
            self._given.set()

    def wait(self) -> str | None:
        self._given.wait()
        return self._error


ANSWER_WAIT = 10.0  # seconds a lane gets to send the manifest's answer before it is stopped


def _start_lanes(spec: TransferSpec, delivery: _Delivery) -> list[LaneReceiver]:
    causes = LocalCauses()  # the true cause of an end wins on every lane
    found = [lane_receiver(spec, lane, delivery.wait, causes) for lane in range(spec.lanes)]
    receivers = [r for r in found if r is not None]
    if len(receivers) < len(found):
        for other in receivers:
            other.stop(linger=0)
        raise TransferError("another process on this machine is already receiving this transfer")
    return receivers


def _wait_staged(
    receivers: list[LaneReceiver],
    reading: ReadingEnd,
    on_progress: ProgressCallback | None,
    interval: float,
) -> None:
    """Until every lane holds its share (manifest and partitions).

    Any lane's error ends the wait (a lane the sender aborted, though others
    still wait); Ctrl-C tells the sender through every lane, then raises
    :class:`Interrupted` with whether it was told.
    """
    ticker = _Ticker(_ReceiveMeter(receivers, time.monotonic()).snapshot, on_progress, interval)
    try:
        while True:
            error = next((r.error for r in receivers if r.error is not None), None)
            pending = [r for r in receivers if not (r.finished or r.staged)]
            if error is not None or not pending:
                break
            pending[0].wait_finished(staged=True, timeout=0.25)
    except KeyboardInterrupt as e:
        ticker.stop(final=False)
        cause = interrupt_cause(e)
        raise Interrupted(cause, _tell_sender(receivers, reading, cause)) from None
    if error is not None:
        ticker.stop(final=False)
        # The sender's abort may only echo this side's own failure (a lane that could
        # not stage): raise the cause, as the lane that saw it recorded it.
        own = next((r.failure for r in receivers if r.failure is not None), None)
        raise own if own is not None else error
    ticker.stop()


def _answer_text(e: BaseException) -> str:
    """What the sender is told when this receiver fails after the data was staged."""
    if isinstance(e, OutputError):
        return str(e)  # already names the receiver and its folder
    if isinstance(e, KeyboardInterrupt):
        return Abort(interrupt_cause(e), cancelled=True).text("receiver")
    return f"the receiver failed: {e}"


def dest_problem(dest: Path, *, must_be_empty: bool = False) -> str | None:
    """Why the dataset cannot be written into ``dest``, or None; checks before a code is used.

    ``dest`` may be absent (made at the end) or a folder (empty, if
    ``must_be_empty``); its parent must be writable for the hidden temporary
    folder the files are written into first.
    """
    if dest.exists() and not dest.is_dir():
        return f"cannot write the dataset into {dest}: it exists and is not a folder"
    if must_be_empty and dest.is_dir() and any(dest.iterdir()):
        return f"cannot write the dataset into {dest}: it exists and is not empty"
    folders = [_existing(dest.parent)] + ([dest] if dest.is_dir() else [])
    for folder in folders:
        try:
            os.rmdir(tempfile.mkdtemp(prefix=".spark-dilation-check-", dir=folder))
        except OSError as e:
            return f"cannot write the dataset into {dest}: {folder} is not writable ({os_cause(e)})"
    return None


def _existing(path: Path) -> Path:
    path = Path(os.path.abspath(path))
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _write_part(target: Path, src: Path, schema: pa.Schema, format: str) -> None:
    if format == "arrow":  # the IPC file format (what .arrow/Feather v2 readers take)
        with pa.ipc.new_file(target, schema) as writer:
            for b in read_staged(src):
                writer.write_batch(b)
    elif format == "csv":
        with pacsv.CSVWriter(target, schema) as writer:
            for b in read_staged(src):
                writer.write_batch(b)
    else:
        with pq.ParquetWriter(target, schema) as writer:
            for b in read_staged(src):
                writer.write_batch(b)


def _write_files(
    spec: TransferSpec,
    partitions: list[CommittedPartition],
    staging: dict[int, LaneStaging],
    out: Path,
    format: str,
    replace: bool = False,
) -> list[Path]:
    """Write the files into a hidden folder next to ``out``, then move them into ``out``.

    ``out`` appears only complete: renamed from the hidden folder if absent,
    or given the files if it is a folder; with ``replace`` an existing
    ``out`` is swapped for the new folder only then (and removed). On any
    failure the hidden folder goes and the error names the file and the cause.
    """
    partial = out.parent / f".{out.name}.spark-dilation-{spec.transfer_id[:12]}.partial"

    def failed(what: str, e: BaseException) -> OutputError:
        return OutputError(f"the receiver could not write {what} into {out}: {os_cause(e)}")

    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        partial.mkdir()
    except OSError as e:
        raise failed(f"its temporary folder {partial.name}", e) from e
    try:
        names: list[str] = []
        for c in partitions:
            name = f"part-{c.partition:05d}.{format}"
            try:
                _write_part(partial / name, staging[c.lane].complete_path(c.partition),
                            spec.schema, format)  # fmt: skip
            except (OSError, pa.ArrowException) as e:
                raise failed(name, e) from e
            names.append(name)
        try:
            if replace and out.exists():
                old = out.parent / f".{out.name}.spark-dilation-{spec.transfer_id[:12]}.old"
                os.rename(out, old)
                os.rename(partial, out)
                if old.is_dir():
                    shutil.rmtree(old, ignore_errors=True)
                else:
                    old.unlink(missing_ok=True)
            elif out.is_dir():  # an existing folder (empty, for the CLI): the files go in
                for name in names:
                    os.replace(partial / name, out / name)
                partial.rmdir()
            else:
                os.rename(partial, out)
        except OSError as e:
            raise OutputError(
                f"the receiver could not move its files into {out}: {os_cause(e)}"
            ) from e
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return [out / name for name in names]


def _tell_sender(receivers: list[Any], reading: ReadingEnd, cause: str) -> str:
    """The receiver was cancelled: tell the sender through the directory link (ahead of
    the data queued toward us) and through every lane's connections; then stop."""
    abort = Abort(cause, cancelled=True)
    error = Interrupted(cause)
    deadline = time.monotonic() + CANCEL_TELL_TIMEOUT
    heard = threading.Event()  # the writing end answered "end" on the directory link

    def tell_directory() -> None:
        reading.tell_abort(abort)
        if reading.wait_ended(deadline):
            heard.set()

    outcomes: list[str] = []
    threads = [threading.Thread(target=tell_directory, daemon=True)] + [
        threading.Thread(
            target=lambda r=r: outcomes.append(
                r.end_transfer(abort, error, CANCEL_TELL_TIMEOUT, heard)
            ),
            daemon=True,
        )
        for r in receivers
    ]
    for t in threads:
        t.start()
    for t in threads[1:]:
        t.join(CANCEL_TELL_TIMEOUT + 1)
    # Each lane stops in a thread of its own (end_transfer): closing a wormhole
    # whose peer is busy or gone can take seconds, and we have nothing to wait for.
    if "confirmed" in outcomes:
        return "the sender was told"
    if "sent" in outcomes:
        return "the sender was told (no answer yet)"
    return "the sender could not be told"


def receive_dataset(
    code: str,
    dest: str | Path | None = None,
    *,
    format: str = "parquet",
    on_progress: ProgressCallback | None = None,
    options: TransferOptions | None = None,
    **overrides: Any,
) -> ReceivedDataset:
    """Receive a dataset (blocking): into a ``pyarrow.Table``, or into files under ``dest``.

    ``format`` of the files: ``parquet`` (default), ``arrow`` (Arrow IPC file) or
    ``csv`` (flat schemas only); one file per sender partition, named
    ``part-NNNNN``. The whole transfer runs in this process with ``lanes``
    parallel lanes. ``on_progress`` gets :class:`Progress` snapshots of what
    is staged, every half second and once at the end (``done=True``).

    The sender succeeds only once the data is here (the table built, or the
    files in ``dest``); if that fails, it gets this side's error. ``dest`` is
    written through a hidden folder next to it and appears only complete; it
    is checked before the code is used, and an offer whose size clearly does
    not fit the staging folder or ``dest`` is refused.
    """
    opts = _options(options, overrides)
    if format not in RECEIVE_FORMATS:
        raise TransferError(f"format={format!r}: choose {', '.join(RECEIVE_FORMATS)}")
    room = [opts.staging_root]
    if dest is not None:
        problem = dest_problem(Path(dest))
        if problem is not None:
            raise TransferError(problem)
        room.append(Path(dest))
    started = time.monotonic()
    spec = receive_session(code, opts, accept_file=False, room=room)
    assert not isinstance(spec, ReceivedFileResult)
    return receive_agreed(spec, dest, format=format, on_progress=on_progress, started=started)


def receive_agreed(
    spec: TransferSpec,
    dest: str | Path | None = None,
    *,
    format: str = "parquet",
    on_progress: ProgressCallback | None = None,
    interval: float = PROGRESS_INTERVAL,
    started: float | None = None,
    overwrite: bool = False,
) -> ReceivedDataset:
    """The rest of :func:`receive_dataset` once a session agreed on ``spec``.

    ``overwrite``: an existing ``dest`` is replaced, once the new files are complete.

    For callers that run the session themselves (the CLI, which also takes
    files and texts from the same code; see :func:`.session.accept_offer`).
    The lanes answer the final manifest only once the data is in its place
    (or with this side's error); the transfer's staging is removed either way.
    """
    opts = spec.options
    refusal = format_refusal(spec.schema, format) if dest is not None else None
    if refusal is not None:
        raise TransferError(refusal)
    started = time.monotonic() if started is None else started
    delivery = _Delivery()
    receivers = _start_lanes(spec, delivery)  # the transfer's staging is ours from here
    # The reading end of the transfer's directory: every lane here, epoch 0.
    reading = ReadingEnd(
        spec,
        sender_set(spec.transfer_id).add,
        on_abort=lambda abort: [r.sender_ended(abort, linger=0) for r in receivers],
    )
    reading.publish(dict.fromkeys(range(spec.lanes), 0))
    try:
        try:
            _wait_staged(receivers, reading, on_progress, interval)
            staging = {r.lane: r.staging for r in receivers}
            partitions = sorted(
                (c for r in receivers for c in _manifest(r).for_lane(r.lane)),
                key=lambda c: c.partition,
            )
            table: pa.Table | None = None
            files: list[Path] = []
            if dest is None:
                batches = [
                    b
                    for c in partitions
                    for b in read_staged(staging[c.lane].complete_path(c.partition))
                ]
                table = pa.Table.from_batches(batches, schema=spec.schema)
            else:
                files = _write_files(spec, partitions, staging, Path(dest), format, overwrite)
        except BaseException as e:
            delivery.give(_answer_text(e))  # the lanes answer the manifest with it
            if isinstance(e, KeyboardInterrupt) and not isinstance(e, Interrupted):
                raise Interrupted(interrupt_cause(e), "the sender was told") from None
            raise
        delivery.give(None)  # now the lanes answer "K": the data is where it was asked
        for r in receivers:
            error = r.wait_finished(timeout=ANSWER_WAIT)
            if error is not None:
                raise error
    finally:
        for r in receivers:
            if r.staged:  # let its answer go out before its connections close
                r.wait_finished(timeout=ANSWER_WAIT)
            # Idempotent; records paths and reconnects, and waits for its doors to
            # close their wormholes (a process exiting next would cut that close short).
            r.stop(linger=0)
        reading.close()
        forget(spec.transfer_id)
        shutil.rmtree(opts.staging_root / spec.transfer_id, ignore_errors=True)
    return ReceivedDataset(
        TransferReport(
            rows=sum(c.rows for c in partitions),
            bytes=sum(c.bytes for c in partitions),
            partitions=len(partitions),
            lanes=spec.lanes,
            connections=sum(r.connections_made for r in receivers),
            reconnects=sum(r.reconnects for r in receivers),
            path=combine_paths([p for r in receivers for p in r.paths]),
            seconds=time.monotonic() - started,
            compression=spec.compression,
        ),
        spec.schema,
        table,
        files,
    )


def _manifest(receiver: LaneReceiver) -> Manifest:
    manifest = receiver.book.manifest
    assert manifest is not None  # staged: the manifest came
    return manifest


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
    "RECEIVE_FORMATS",
    "DatasetSender",
    "Progress",
    "ReceivedDataset",
    "format_refusal",
    "receive_agreed",
    "receive_dataset",
    "receive_table",
    "send_dataset",
    "send_in_background",
]
