"""Receiving a dataset into this process: every lane here, then a table or files."""

from __future__ import annotations

import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa

from ...errors import Interrupted, TransferError, interrupt_cause
from ..meet.rendezvous import ReadingEnd, tell_end
from ..meet.session import ReceivedFileResult, receive_session
from ..meet.views import forget, sender_set
from ..receive.lane import LaneReceiver, LocalCauses, lane_receiver
from ..receive.staging import read_staged
from ..rules.errors import OutputError
from ..rules.options import RECEIVE_FORMATS, TransferOptions, merge_options
from ..rules.protocol import ABORT_TIMEOUT, Abort, Manifest
from ..rules.report import ConnectionStats, TransferReport
from ..rules.spec import TransferSpec
from .output import dest_problem, format_refusal, write_files
from .progress import PROGRESS_INTERVAL, ProgressCallback, ReceiveMeter, Ticker

ANSWER_WAIT = 10.0  # seconds a lane gets to send the manifest's answer before it is stopped


@dataclass
class ReceivedDataset:
    """What :func:`receive_dataset` got: the report and the data where it was asked to go."""

    report: TransferReport
    schema: pa.Schema
    table: pa.Table | None = None
    files: list[Path] = field(default_factory=list)


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
    ticker = Ticker(ReceiveMeter(receivers, time.monotonic()).snapshot, on_progress, interval)
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


def _tell_sender(receivers: list[Any], reading: ReadingEnd, cause: str) -> str:
    """The receiver was cancelled: tell the sender through the directory link (ahead of
    the data queued toward us) and through every lane's connections; then stop."""
    abort = Abort(cause, cancelled=True)
    error = Interrupted(cause)
    deadline = time.monotonic() + ABORT_TIMEOUT
    heard = threading.Event()  # the writing end answered "end" on the directory link
    tell_end(reading.tell_abort, reading.wait_ended, abort, deadline, heard)
    outcomes: list[str] = []
    threads = [
        threading.Thread(
            target=lambda r=r: outcomes.append(r.end_transfer(abort, error, ABORT_TIMEOUT, heard)),
            daemon=True,
        )
        for r in receivers
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(ABORT_TIMEOUT + 1)
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
    opts = merge_options(options, overrides)
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
    senders = sender_set(spec.transfer_id)
    reading = ReadingEnd(
        spec,
        senders.add,
        on_abort=lambda abort: [r.sender_ended(abort, linger=0) for r in receivers],
        on_spoiled=senders.spoil,
    )
    senders.tell_spoiled = reading.report_spoiled
    senders.link_lost_state = reading.link.lost_state
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
                files = write_files(spec, partitions, staging, Path(dest), format, overwrite)
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
        TransferReport.of(
            partitions,
            [_lane_stats(r) for r in receivers],
            lanes=spec.lanes,
            compression=spec.compression,
            seconds=time.monotonic() - started,
        ),
        spec.schema,
        table,
        files,
    )


def _lane_stats(receiver: LaneReceiver) -> ConnectionStats:
    """What a stopped lane's connections did, for the report (each lane on its own)."""
    return ConnectionStats(
        f"lane {receiver.lane}",
        receiver.connections_made,
        receiver.reconnects,
        tuple(receiver.paths),
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
