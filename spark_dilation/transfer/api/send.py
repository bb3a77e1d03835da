"""Sending a dataset from this process: the sender, its partitions' retries, the report."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from typing import Any

import pyarrow as pa

from ...dilation.manager import DilationNoPath
from ...errors import Interrupted, TransferCancelledError, interrupt_cause
from ..meet.hub import SenderHub
from ..meet.session import SenderSession
from ..rules import codec
from ..rules.errors import TransferAbortedError
from ..rules.options import TransferOptions, merge_options
from ..rules.protocol import ABORT_TIMEOUT, CommittedPartition
from ..rules.report import TransferReport
from ..rules.spec import TransferSpec
from ..send import meter
from ..send.delivery import deliver_abort, deliver_manifest
from ..send.pool import ConnectionPool, LaneLostError, send_partition
from .progress import PROGRESS_INTERVAL, ProgressCallback, SendMeter, Ticker
from .sources import Source, as_dataset, partitions_of, total_bytes, total_rows

log = logging.getLogger(__name__)

CANCEL_LINGER = 5.0  # for our answer to the receiver's end to get through
DIRECTORY_ANSWER_WAIT = 0.5  # s: the receiver's end through the mailbox, if in-band came first
MAX_ATTEMPTS = 3


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
            source if isinstance(source, pa.Table | pa.RecordBatch) else as_dataset(source)
        )
        self.total_rows = total_rows(self._source)  # if the source knows it cheaply
        self._session = SenderSession.open(
            self._source.schema,
            self.options,
            code=code,
            code_length=code_length,
            rows=self.total_rows,
            nbytes=total_bytes(self._source),
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
        parts = partitions_of(self._source, spec.lanes)
        parts.makers = self._unless_cancelled(parts.makers)
        with self._lock:
            self._under_way = (spec.transfer_id, connections)
        if self._cancelled.is_set():  # cancel() came just before
            connections.fail(spec.transfer_id, self._cancelled_error())
        meter = SendMeter(spec.transfer_id, connections, self.total_rows, started)
        ticker = Ticker(meter.snapshot, on_progress, interval)
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
            _, control = deliver_manifest(spec, committed, connections)
        finally:
            connections.close_transfer(spec.transfer_id)
        return TransferReport.of(
            committed,
            [stats],
            lanes=spec.lanes,
            compression=spec.compression,
            seconds=time.monotonic() - started,
            control=control,
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
                spec, cause, ABORT_TIMEOUT, connections, cancelled=True, reached_only=True
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
    detail = codec.describe(meter.choices(spec.transfer_id))
    meter.forget(spec.transfer_id)
    return detail


def _send_all(
    spec: TransferSpec,
    makers: list[Callable[[], Iterator[pa.RecordBatch]]],
    connections: ConnectionPool,
    meter: SendMeter | None = None,
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
    sender = DatasetSender(source, code=code, options=merge_options(options, overrides))
    if on_code is not None:
        on_code(sender.code)
    else:
        log.warning("wormhole code: %s", sender.code)
    return sender.wait(on_progress)


def send_in_background(
    source: Source, code: str | None = None, **overrides: Any
) -> tuple[DatasetSender, threading.Thread, dict[str, Any]]:
    """Start a send in a thread: (sender with .code, thread, box with "report"/"error")."""
    sender = DatasetSender(source, code=code, options=merge_options(None, overrides))
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["report"] = sender.wait()
        except BaseException as e:
            box["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return sender, thread, box
