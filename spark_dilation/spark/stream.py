"""Structured Streaming: ``writeStream``/``readStream.format("dilation")``.

What runs where (PySpark 4.0-4.3; docs/transfer.md section 7 has the protocol):

- **Sink.** ``DilationDataSource.streamWriter()`` returns a
  :class:`DilationStreamWriter`. Each micro-batch's ``write()`` (a task)
  returns its partition as Arrow IPC in the commit message; ``commit(messages,
  batchId)`` (a driver worker) hands the batch to the stream's sending process
  on the driver machine (:mod:`~spark_dilation.transfer.send.streamclient`)
  and returns only when the receiving side has it staged durably. So a slow or
  stopped receiver holds the sending query at its commit, with one
  micro-batch in memory, and a batch in the sending query's commit log is on
  the receiving side.
- **Source.** ``DilationDataSource.schema()`` pairs over the code (the first
  run) or reads the schema from the pairing record (later runs).
  :class:`DilationStreamReader` runs the receiving run in Spark's long-lived
  streaming worker on the driver (started on the first offset call); its
  offsets are ``{"seq": N}``, N counting staged micro-batches, and each input
  partition carries one staged partition's Arrow IPC to the task that reads it.

Both keep their state in ``pairing_dir``: the pairing record (mode 0600), and
on the receiving side the ledger and the staged partitions.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
from pyspark.sql.datasource import (
    DataSourceStreamReader,
    DataSourceStreamWriter,
    InputPartition,
    WriterCommitMessage,
)

try:  # PySpark 4.1+
    from pyspark.sql.datasource import DataSourceStreamArrowWriter
except ImportError:
    DataSourceStreamArrowWriter = None  # type: ignore[assignment, misc]
try:  # PySpark 4.2+: admission control and Trigger.AvailableNow for Python sources
    from pyspark.sql.streaming.datasource import SupportsTriggerAvailableNow
except ImportError:
    SupportsTriggerAvailableNow = None  # type: ignore[assignment, misc]

from ..transfer.rules.options import TransferOptions
from ..transfer.rules.pairing import RECORD_NAME
from .options import STREAM_READ_OPTIONS, OptionError
from .staged import cast_batch

log = logging.getLogger("spark_dilation.spark.stream")

DEFAULT_MAX_BYTES = 256 * 1024 * 1024  # maxBytesPerTrigger unless a limit is set
HOME_ENV = "SPARK_DILATION_HOME"
# Of the transfer's options, those a stream uses (the rest are a dataset's).
TRANSFER_STREAM_OPTIONS = ("mailbox", "relay", "no_listen", "peer_timeout", "reconnect_timeout")
STREAM_WRITE_OPTIONS = ("code", "pairing_dir", "checkpointlocation", "path")


def streams_home() -> Path:
    """``$SPARK_DILATION_HOME/streams``, else ``~/.spark-dilation/streams``."""
    home = os.environ.get(HOME_ENV) or os.path.join(os.path.expanduser("~"), ".spark-dilation")
    return Path(home) / "streams"


def pairing_dir(options: Mapping[str, str], role: str) -> Path:
    """Where this side keeps its pairing record (and, receiving, its stage).

    Option ``pairing_dir``; else, for a sending query with a local checkpoint,
    ``<checkpointLocation>/dilation`` (the record lives and goes with the
    query); else a folder under :func:`streams_home` named by the code and role.
    """
    opts = {k.lower(): v for k, v in options.items()}
    if opts.get("pairing_dir"):
        return Path(opts["pairing_dir"]).expanduser()
    local = _local_checkpoint(opts.get("checkpointlocation", ""))
    if role == "sender" and local is not None:
        return local / "dilation"
    code = (opts.get("code") or "").strip()
    if not code:
        raise OptionError(
            f'option "code" is required to {"send" if role == "sender" else "receive"} a stream '
            '(or option "pairing_dir" naming the folder of an existing pairing)'
        )
    digest = hashlib.sha256(code.encode()).hexdigest()[:16]
    return streams_home() / f"{digest}-{role}"


def transfer_options(options: Mapping[str, str], allowed: tuple[str, ...]) -> TransferOptions:
    opts = {k.lower(): v for k, v in options.items()}
    known = set(allowed) | set(TRANSFER_STREAM_OPTIONS)
    unknown = sorted(set(opts) - known)
    if unknown:
        raise OptionError(
            f'unknown option {", ".join(unknown)} for a stream of format("dilation"); '
            f"known options are {', '.join(sorted(known))}"
        )
    return TransferOptions.from_strings(
        {k: v for k, v in opts.items() if k not in allowed}, ignore=()
    )


def _limit(opts: Mapping[str, str], name: str) -> int | None:
    raw = opts.get(name.lower())
    if raw is None:
        return None
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise OptionError(f"option {name}={raw!r} must be a positive whole number")
    return value


# --- the sink ------------------------------------------------------------------------------


@dataclass
class BatchPart(WriterCommitMessage):
    """One write task's partition of a micro-batch, as Arrow IPC."""

    partition: int
    attempt: str
    rows: int
    data: bytes


def _task() -> tuple[int, str]:
    from pyspark import TaskContext

    ctx = TaskContext.get()
    return (0, "0") if ctx is None else (ctx.partitionId(), str(ctx.attemptNumber()))


def _ipc(schema: pa.Schema, batches: Iterator[pa.RecordBatch]) -> tuple[int, bytes]:
    sink = pa.BufferOutputStream()
    rows = 0
    with pa.ipc.new_stream(sink, schema) as out:
        for batch in batches:
            rows += batch.num_rows
            out.write_batch(batch)
    return rows, sink.getvalue().to_pybytes()


class _StreamSink:
    """What the Row and the Arrow writers share: the commit and the abort."""

    def __init__(self, options: Mapping[str, str], schema: pa.Schema) -> None:
        opts = {k.lower(): v for k, v in options.items()}
        self.schema = schema
        self.pairing_dir = pairing_dir(opts, "sender")
        checkpoint = opts.get("checkpointlocation") or ""
        if not checkpoint:
            raise OptionError(
                'option "checkpointLocation" is required by writeStream.format("dilation"): '
                "the sending query resumes from it, and it names the query to the receiving "
                "side (its batch ids are the stream's)"
            )
        # The sending query's identity, as the receiving side's ledger knows it: a
        # new checkpoint is a new query, whose batch ids start again at 0.
        self.query = hashlib.sha256(checkpoint.encode()).hexdigest()[:16]
        options_ = transfer_options(opts, STREAM_WRITE_OPTIONS)
        self.start = {
            "code": (opts.get("code") or "").strip() or None,
            "schema": base64.b64encode(schema.serialize().to_pybytes()).decode(),
            "mailbox_url": options_.mailbox_url,
            "peer_timeout": options_.peer_timeout,
            "timeout_option": options_.spelled("peer_timeout"),
            "dilation": {
                "relay_url": options_.relay_url,
                "no_listen": options_.no_listen,
                "reconnect_timeout": options_.reconnect_timeout,
            },
        }
        record = self.pairing_dir / RECORD_NAME
        if not record.exists() and _ran_before(checkpoint):
            raise OptionError(
                f"this sending query ran before (its checkpoint {checkpoint} has committed "
                f"micro-batches) but no pairing record is at {record}: restore the record, or "
                "start a new stream with a new code and a new checkpoint"
            )
        if not record.exists() and self.start["code"] is None:
            raise OptionError(
                f'option "code" is required for a stream\'s first run: no pairing record is at '
                f"{record}. Give the code the receiving query uses, or pairing_dir naming the "
                "folder of this stream's pairing"
            )

    def prestart(self) -> None:
        """Start the stream's sending process now (it pairs, or resumes, while the
        first micro-batch computes), unless one runs."""
        from ..transfer.send import ensure_stream_host

        self.pairing_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        ensure_stream_host(self.pairing_dir, self.start)

    def commit(self, messages: list[Any], batchId: int) -> None:
        from ..transfer.send import deliver_batch

        parts = sorted((m for m in messages if isinstance(m, BatchPart)), key=lambda m: m.partition)
        request = {
            "query": self.query,
            "batch": batchId,
            "parts": [{"partition": m.partition, "attempt": m.attempt} for m in parts],
            "rows": sum(m.rows for m in parts),
            "nbytes": sum(len(m.data) for m in parts),
        }
        self.pairing_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        seq = deliver_batch(self.pairing_dir, self.start, request, [m.data for m in parts])
        log.info(
            "micro-batch %d staged on the receiving side as %d (%d rows)",
            batchId,
            seq,
            request["rows"],
        )

    def abort(self, messages: list[Any], batchId: int) -> None:
        from ..transfer.send import abort_batch

        abort_batch(self.pairing_dir, batchId)


class DilationStreamRowWriter(_StreamSink, DataSourceStreamWriter):
    """``writeStream.format("dilation")`` on PySpark 4.0: its tasks get Rows."""

    def write(self, iterator: Iterator[Any]) -> BatchPart:
        partition, attempt = _task()
        names = self.schema.names

        def batches() -> Iterator[pa.RecordBatch]:
            rows: list[dict[str, Any]] = []
            for row in iterator:
                rows.append(dict(zip(names, _plain(tuple(row)), strict=True)))
                if len(rows) >= 10_000:
                    yield pa.RecordBatch.from_pylist(rows, schema=self.schema)
                    rows = []
            if rows:
                yield pa.RecordBatch.from_pylist(rows, schema=self.schema)

        rows, data = _ipc(self.schema, batches())
        return BatchPart(partition, attempt, rows, data)


def _plain(value: Any) -> Any:
    """A Row's values as Arrow takes them: nested Rows as dicts."""
    from pyspark.sql import Row

    if isinstance(value, Row):
        return value.asDict(recursive=True)
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


if DataSourceStreamArrowWriter is not None:

    class DilationStreamWriter(_StreamSink, DataSourceStreamArrowWriter):
        """``writeStream.format("dilation")`` on PySpark 4.1+: its tasks get Arrow batches."""

        def write(self, iterator: Iterator[pa.RecordBatch]) -> BatchPart:
            partition, attempt = _task()
            rows, data = _ipc(self.schema, (cast_batch(b, self.schema) for b in iterator))
            return BatchPart(partition, attempt, rows, data)


def _local_checkpoint(checkpoint: str) -> Path | None:
    """A checkpoint location on this machine's file system as a path; None for none or
    for remote storage (``s3://...``)."""
    if not checkpoint or ("://" in checkpoint and not checkpoint.startswith("file:")):
        return None
    return Path(checkpoint.removeprefix("file://").removeprefix("file:"))


def _ran_before(checkpoint: str) -> bool:
    """Whether a local checkpoint holds committed micro-batches (a restarted query)."""
    local = _local_checkpoint(checkpoint)
    if local is None:
        return False  # not ours to look into; the first-run path applies
    commits = local / "commits"
    return commits.is_dir() and any(p.name.isdigit() for p in commits.iterdir())


def stream_writer(options: Mapping[str, str], schema: pa.Schema) -> Any:
    """The sink's writer: Arrow batches on 4.1+, Rows (made Arrow here) on 4.0."""
    if DataSourceStreamArrowWriter is None:
        return DilationStreamRowWriter(options, schema)
    return DilationStreamWriter(options, schema)


# --- the source ----------------------------------------------------------------------------


def stream_schema(record: Any, where: Path) -> pa.Schema:
    """The stream's Arrow schema from its pairing record (the sender's, kept on pairing)."""
    from ..transfer.rules.pairing import PairingError

    if not record.schema:
        raise PairingError(
            f"the pairing record at {where} holds no schema: its sender did not name one"
        )
    return pa.ipc.read_schema(pa.py_buffer(base64.b64decode(record.schema)))


class DilationStreamReader(DataSourceStreamReader):
    """``readStream.format("dilation")``: the receiving run, in Spark's streaming worker.

    Spark builds one in a planner worker too, pickled for the read tasks: nothing
    starts until the first offset call, which only the streaming worker makes.
    """

    def __init__(self, options: Mapping[str, str], target: pa.Schema) -> None:
        opts = {k.lower(): v for k, v in options.items()}
        self.dir = pairing_dir(opts, "receiver")
        self.target = target
        self.max_rows = _limit(opts, "maxRecordsPerTrigger")
        self.max_bytes = _limit(opts, "maxBytesPerTrigger")
        if self.max_rows is None and self.max_bytes is None:
            # Each trigger's staged bytes pass through this driver worker and the
            # tasks: bounded by default, so a backlog does not arrive as one batch.
            self.max_bytes = DEFAULT_MAX_BYTES
        o = transfer_options(opts, ("code", "path", *STREAM_READ_OPTIONS))
        self.dilation = {
            "relay_url": o.relay_url,
            "no_listen": o.no_listen,
            "reconnect_timeout": o.reconnect_timeout,
        }
        self._receiver: Any = None
        self._until: int | None = None  # Trigger.AvailableNow: the latest at its start

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_receiver": None}

    @property
    def receiver(self) -> Any:
        if self._receiver is None:
            from ..transfer.receive import StreamReceiver

            receiver = StreamReceiver(self.dir / RECORD_NAME, self.dir, **self.dilation)
            receiver.start()
            self._receiver = receiver
        return self._receiver

    def initialOffset(self) -> dict:
        # A new receiving query starts where the stream's last one freed its batches.
        return {"seq": self.receiver.stage.ledger.freed_below}

    def latestOffset(self, start: dict | None = None, limit: Any = None) -> dict:
        receiver = self.receiver
        latest = receiver.latest()
        if self._until is not None:
            latest = min(latest, self._until)
        if start is None:
            return {"seq": latest}
        max_rows, max_bytes = self.max_rows, self.max_bytes
        kind = type(limit).__name__
        if kind == "ReadMaxRows":
            max_rows = limit.max_rows
        elif kind == "ReadMaxBytes":
            max_bytes = limit.max_bytes
        elif kind == "ReadAllAvailable":
            max_rows = max_bytes = None
        with receiver.lock:
            end = receiver.stage.ledger.end_within(int(start["seq"]), max_rows, max_bytes)
        return {"seq": min(end, latest)}

    def getDefaultReadLimit(self) -> Any:
        from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadMaxBytes, ReadMaxRows

        if self.max_rows is not None:
            return ReadMaxRows(self.max_rows)
        if self.max_bytes is not None:
            return ReadMaxBytes(self.max_bytes)
        return ReadAllAvailable()  # not reached: max_bytes has a default

    def reportLatestOffset(self) -> dict:
        return {"seq": self.receiver.latest()}

    def prepareForTriggerAvailableNow(self) -> None:
        self._until = self.receiver.latest()

    def partitions(self, start: dict, end: dict) -> list[InputPartition]:
        receiver = self.receiver
        first, last = int(start["seq"]), int(end["seq"])
        # Below the first offset Spark reads now, everything was read: freed, if the
        # last run ended between Spark's commit log and this source's commit.
        receiver.commit(first)
        with receiver.lock:
            files = receiver.stage.files(first, last)
        return [InputPartition(path.read_bytes()) for _batch, paths in files for path in paths]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        reader = pa.ipc.open_stream(pa.py_buffer(partition.value))
        for batch in reader:
            yield cast_batch(batch, self.target)

    def commit(self, end: dict) -> None:
        self.receiver.commit(int(end["seq"]))

    def stop(self) -> None:
        if self._receiver is not None:
            self._receiver.stop()
            self._receiver = None


if SupportsTriggerAvailableNow is not None:

    class DilationStreamReaderNow(DilationStreamReader, SupportsTriggerAvailableNow):
        """The source on PySpark 4.2+, where Spark runs Trigger.AvailableNow with it."""


def stream_reader(options: Mapping[str, str], target: pa.Schema) -> DilationStreamReader:
    """The source's reader, with Trigger.AvailableNow where Spark has it (4.2+)."""
    if SupportsTriggerAvailableNow is None:
        return DilationStreamReader(options, target)
    return DilationStreamReaderNow(options, target)
