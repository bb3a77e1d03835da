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

Both keep their state in one folder (option ``state_dir``, or its older name
``pairing_dir``): the pairing record (mode 0600), and on the receiving side
the ledger and the staged partitions. That folder must outlive the driver
(:func:`pairing_dir` has the defaults).

The sending query is known to the receiving side by Spark's query id (its
checkpoint's, read from each write task's ``sql.streaming.queryId``): a
checkpoint deleted and made again is a new query, and its batches are
refused rather than taken for re-runs.
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
from . import faults
from .checkpoint import default_fs, local_checkpoint
from .locality import cluster_master
from .options import STREAM_READ_OPTIONS, OptionError
from .staged import cast_batch

log = logging.getLogger("spark_dilation.spark.stream")

DEFAULT_MAX_BYTES = 256 * 1024 * 1024  # maxBytesPerTrigger unless a limit is set
HOME_ENV = "SPARK_DILATION_HOME"
# Of the transfer's options, those a stream uses (the rest are a dataset's).
TRANSFER_STREAM_OPTIONS = ("mailbox", "relay", "no_listen", "peer_timeout", "reconnect_timeout")
# Spark itself passes checkpointLocation, queryName and a start(path)'s path to a sink.
STREAM_WRITE_OPTIONS = (
    "code",
    "pairing_dir",
    "state_dir",
    "checkpointlocation",
    "queryname",
    "path",
)
QUERY_ID_PROPERTY = "sql.streaming.queryId"  # a streaming task's local property (Spark's)
# Made by a sending query's batch 0 with no record: its later batches may commit while
# the first pairing still runs. A batch past 0 with no record and no mark: the record is lost.
FIRST_RUN_MARK = ".first-run"


def streams_home() -> Path:
    """``$SPARK_DILATION_HOME/streams``, else ``~/.spark-dilation/streams``."""
    home = os.environ.get(HOME_ENV) or os.path.join(os.path.expanduser("~"), ".spark-dilation")
    return Path(home) / "streams"


def named_state_dir(options: Mapping[str, str]) -> str | None:
    """The folder the options name for this side's state (``state_dir``, or its older
    name ``pairing_dir``; keys in any case), or None."""
    opts = {k.lower(): v for k, v in options.items()}
    return opts.get("state_dir") or opts.get("pairing_dir") or None


def pairing_dir(options: Mapping[str, str], role: str) -> Path:
    """Where this side keeps its pairing record (and, receiving, its stage).

    Option ``state_dir`` (or ``pairing_dir``); else, for a sending query with a
    local checkpoint, ``<checkpointLocation>/dilation`` (the record lives and
    goes with the query); else a folder under :func:`streams_home` named by the
    code and role. A sending query whose checkpoint is on remote storage
    (``dbfs:``, ``s3a:``, or a path on a remote default file system) must name
    ``state_dir``: a default on the driver's disk would not survive the driver,
    while the checkpoint does.
    """
    opts = {k.lower(): v for k, v in options.items()}
    named = named_state_dir(opts)
    if named:
        return Path(named).expanduser()
    checkpoint = opts.get("checkpointlocation", "")
    local = local_checkpoint(checkpoint, default_fs())
    if role == "sender" and local is not None:
        return local / "dilation"
    if role == "sender" and checkpoint:
        raise OptionError(
            f"the checkpoint {checkpoint} is on storage that outlives the driver, but this "
            "stream's pairing record would be kept on the driver's own disk, which a cluster "
            'restart loses: set option "state_dir" to a folder that survives it (on '
            "Databricks a Unity Catalog volume, /Volumes/<catalog>/<schema>/<volume>/<stream>)"
        )
    code = (opts.get("code") or "").strip()
    if not code:
        raise OptionError(
            f'option "code" is required to {"send" if role == "sender" else "receive"} a stream '
            '(or option "state_dir" naming the folder of an existing pairing)'
        )
    digest = hashlib.sha256(code.encode()).hexdigest()[:16]
    return streams_home() / f"{digest}-{role}"


def driver_state_warning(master: str) -> str:
    """The one line for a receiving stream on a cluster whose state is on the driver's disk."""
    return (
        f"this stream's receiving state (pairing record and staged batches) is kept on the "
        f"driver's disk, which a restart of the cluster ({master}) loses: pass "
        "state_dir=<a folder that survives it> (on Databricks a Unity Catalog volume, "
        "/Volumes/<catalog>/<schema>/<volume>/<stream>)"
    )


def warn_driver_state(options: Mapping[str, str]) -> str | None:
    """A receiving stream with no ``state_dir`` on a cluster: log :func:`driver_state_warning`
    (a driver's Python worker reaches the user only through the driver's log). The line, or None."""
    if named_state_dir(options):
        return None
    master = cluster_master()
    if master is None:
        return None
    line = driver_state_warning(master)
    log.warning(line)
    return line


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
    query: str | None = None  # Spark's id of the sending query (its checkpoint's)


def _task() -> tuple[int, str, str | None]:
    """This write task's partition, attempt and Spark's id of its streaming query."""
    from pyspark import TaskContext

    ctx = TaskContext.get()
    if ctx is None:
        return 0, "0", None
    return ctx.partitionId(), str(ctx.attemptNumber()), ctx.getLocalProperty(QUERY_ID_PROPERTY)


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
        # The checkpoint as the user named it (option, or Spark's conf and the query's
        # name): for messages; the query's identity is Spark's query id (commit()).
        checkpoint = opts.get("checkpointlocation") or ""
        self.checkpoint = checkpoint or (
            f"spark.sql.streaming.checkpointLocation/{opts['queryname']}"
            if opts.get("queryname")
            else None
        )
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
        record_path = self.pairing_dir / RECORD_NAME
        from ..transfer.send import load_record

        record = load_record(record_path)
        self.had_record = record is not None
        if record is None and _ran_before(checkpoint):
            raise OptionError(
                f"this sending query ran before (its checkpoint {checkpoint} has committed "
                f"micro-batches) but no pairing record is at {record_path}: it was lost or "
                "moved. Restore the record (state_dir), or start a new stream with a new code "
                "and a new checkpoint"
            )
        if record is None and self.start["code"] is None:
            raise OptionError(
                f'option "code" is required for a stream\'s first run: no pairing record is at '
                f"{record_path}. Give the code the receiving query uses, or state_dir naming "
                "the folder of this stream's pairing"
            )
        if record is not None and record.schema:
            check_schema(stream_schema(record, record_path), schema, record_path)

    def prestart(self) -> None:
        """Start the stream's sending process now (it pairs, or resumes, while the
        first micro-batch computes), unless one runs."""
        from ..transfer.send import ensure_stream_host

        self.pairing_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        ensure_stream_host(self.pairing_dir, self.start)

    def commit(self, messages: list[Any], batchId: int) -> None:
        from ..transfer.send import deliver_batch

        parts = sorted((m for m in messages if isinstance(m, BatchPart)), key=lambda m: m.partition)
        self.pairing_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        first_run = self.pairing_dir / FIRST_RUN_MARK
        if batchId == 0 and not self.had_record:
            first_run.touch()  # a query that starts at batch 0 pairs over its code
        if not parts:  # no write task ran: nothing to deliver, nothing to wait for
            log.info("micro-batch %d has no partitions: nothing to send", batchId)
            return
        if (
            batchId > 0
            and not self.had_record
            and not first_run.exists()
            and not (self.pairing_dir / RECORD_NAME).exists()
        ):
            raise OptionError(
                f"this sending query ran before (it is at micro-batch {batchId}) but its run "
                f"started with no pairing record at {self.pairing_dir / RECORD_NAME}: the "
                "record was lost or is in another folder. Restore it (state_dir), or start a "
                "new stream with a new code and a new checkpoint"
            )
        request = {
            "query": next((m.query for m in parts if m.query), None) or "unknown",
            "checkpoint": self.checkpoint,
            "batch": batchId,
            "parts": [{"partition": m.partition, "attempt": m.attempt} for m in parts],
            "rows": sum(m.rows for m in parts),
            "nbytes": sum(len(m.data) for m in parts),
        }
        seq = deliver_batch(self.pairing_dir, self.start, request, [m.data for m in parts])
        first_run.unlink(missing_ok=True)  # paired: a record lost from now on is told as that
        log.info(
            "micro-batch %d staged on the receiving side as %d (%d rows)",
            batchId,
            seq,
            request["rows"],
        )
        faults.reached(faults.SINK_STAGED, batchId)

    def abort(self, messages: list[Any], batchId: int) -> None:
        from ..transfer.send import abort_batch

        abort_batch(self.pairing_dir, batchId)


class DilationStreamRowWriter(_StreamSink, DataSourceStreamWriter):
    """``writeStream.format("dilation")`` on PySpark 4.0: its tasks get Rows."""

    def write(self, iterator: Iterator[Any]) -> BatchPart:
        partition, attempt, query = _task()
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
        return BatchPart(partition, attempt, rows, data, query)


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
            partition, attempt, query = _task()
            rows, data = _ipc(self.schema, (cast_batch(b, self.schema) for b in iterator))
            return BatchPart(partition, attempt, rows, data, query)


def _ran_before(checkpoint: str) -> bool:
    """Whether a local checkpoint holds committed micro-batches (a restarted query)."""
    local = local_checkpoint(checkpoint, default_fs())
    if local is None:
        return False  # not ours to look into: the first commit tells (commit())
    commits = local / "commits"
    return commits.is_dir() and any(p.name.isdigit() for p in commits.iterdir())


def check_schema(paired: pa.Schema, now: pa.Schema, where: Path) -> None:
    """Refuse a sending query whose columns are not the ones its stream was paired with:
    the receiving side would read renamed columns as nulls and drop added ones."""
    before = {f.name: f.type for f in paired}
    after = {f.name: f.type for f in now}
    if before == after and paired.names == now.names:
        return
    said = []
    gone = [n for n in paired.names if n not in after]
    new = [n for n in now.names if n not in before]
    changed = [n for n in now.names if n in before and before[n] != after[n]]
    if gone:
        said.append("no longer writes " + ", ".join(gone))
    if new:
        said.append("adds " + ", ".join(new))
    if changed:
        said.append(
            "changes the type of " + ", ".join(f"{n} ({before[n]} -> {after[n]})" for n in changed)
        )
    if not said:
        said.append(f"orders its columns {', '.join(now.names)}")
    raise OptionError(
        f"this sending query {'; '.join(said)}: its stream was paired with columns "
        f"{', '.join(paired.names)} (record {where}). A stream's schema is fixed when it pairs: "
        "select the paired columns, or start a new stream (a new code, state_dir and "
        "checkpoints on both sides) to send the new ones"
    )


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
        self._planned = 0  # the end of the last range planned (PySpark 4.0 gives no start)

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
        if start is None:  # PySpark 4.0/4.1: where the query is, as far as this side knows
            with receiver.lock:
                position = max(self._planned, receiver.stage.ledger.freed_below)
        else:
            position = int(start["seq"])
        receiver.finished(position)  # a revoked or refused stream ends once all is read
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
        # Planning reads only: Spark may plan a range twice, or an empty one (PySpark
        # 4.0/4.1 plan (L, L) on restart before the batch again); only commit() frees.
        receiver = self.receiver
        first, last = int(start["seq"]), int(end["seq"])
        self._planned = max(self._planned, last)
        faults.reached(faults.SOURCE_PLANNED, last)
        with receiver.lock:
            files = receiver.stage.files(first, last)
        return [InputPartition(path.read_bytes()) for _batch, paths in files for path in paths]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        reader = pa.ipc.open_stream(pa.py_buffer(partition.value))
        for batch in reader:
            yield cast_batch(batch, self.target)

    def commit(self, end: dict) -> None:
        faults.reached(faults.SOURCE_COMMIT, int(end["seq"]))
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
