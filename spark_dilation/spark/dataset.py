"""Spark dataset transfers: ``df.write.format("dilation")`` and the parallel lane reader.

What runs where (PySpark 4.3, see DESIGN.md):

- Sender: ``DilationDataSource.writer()`` (a planner worker) starts the
  sender host, which runs the session over the code (``sender_host=false``:
  the planner runs it), and returns a :class:`DilationArrowWriter` holding the
  :class:`~spark_dilation.transfer.rules.spec.TransferSpec`. Spark pickles it to the
  tasks; each ``write()``, ``commit()`` and ``abort()`` goes through
  :mod:`~spark_dilation.transfer.send.verbs`, which hands the work to the
  sender host of the machine (started by the first task on an executor
  machine) or does it in-process. ``write()`` returns when the lane
  confirmed the partition; ``commit()`` delivers the manifest to every lane
  and logs the transfer report; ``abort()`` tells the lanes.
- Receiver: ``schema()`` runs the session (or, if the code carries a plain
  file, receives it as before); :class:`DatasetReader` has one partition per
  lane; ``read()`` yields the lane's rows from its staging.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pyarrow as pa
from pyspark.sql.datasource import (
    DataSourceArrowWriter,
    DataSourceReader,
    InputPartition,
    WriterCommitMessage,
)

from ..transfer.rules.protocol import CommittedPartition
from ..transfer.rules.report import ConnectionStats, TransferReport
from ..transfer.rules.spec import TransferSpec
from .staged import cast_batch

log = logging.getLogger("spark_dilation.spark.dataset")
report_log = logging.getLogger("spark_dilation.report")

REPORT_PREFIX = "spark-dilation transfer report: "
ABORT_PREFIX = "spark-dilation: the writer's abort() told the lanes in "


def _task() -> tuple[int, int]:
    from pyspark import TaskContext

    ctx = TaskContext.get()
    if ctx is None:
        return 0, 0
    return ctx.partitionId(), ctx.attemptNumber()


@dataclass
class PartitionSent(WriterCommitMessage):
    """A sender task's commit message: what its lane confirmed, and its process's pool."""

    committed: CommittedPartition
    stats: ConnectionStats


class DilationArrowWriter(DataSourceArrowWriter):
    """Sends each Spark partition to its lane; built in a planner worker, pickled to tasks."""

    def __init__(self, spec: TransferSpec, started: float) -> None:
        self.spec = spec
        self.started = started  # wall clock (time.time()) of the session's end

    def write(self, iterator: Iterator[pa.RecordBatch]) -> PartitionSent:
        from ..transfer import send

        _quiet_logs()
        partition, attempt = _task()
        return PartitionSent(*send.send(self.spec, partition, attempt, iterator))

    def commit(self, messages: list[PartitionSent | None]) -> None:
        from ..transfer import send

        _quiet_logs()
        sent = [(m.committed, m.stats) for m in messages if m is not None]
        _log_report(send.commit(self.spec, sent, self.started))

    def abort(self, messages: list[PartitionSent | None]) -> None:
        from ..transfer import send

        started = time.monotonic()
        send.abort(self.spec, "the Spark job writing the dataset failed")
        # How long the lanes were tried (at most 10 s; none when the receiver ended it).
        _report_log().info("%s%.1f s", ABORT_PREFIX, time.monotonic() - started)


def _report_log() -> logging.Logger:
    # commit() and abort() run in a Python worker on the driver machine, whose
    # stderr Spark forwards to the driver's: give the report a handler there.
    if not report_log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        report_log.addHandler(handler)
        report_log.setLevel(logging.INFO)
        report_log.propagate = False
    return report_log


def _log_report(report: TransferReport) -> None:
    _report_log().info("spark-dilation: sent %s", report.summary())
    _report_log().info("%s%s", REPORT_PREFIX, report.to_json())


def _quiet_logs() -> None:
    # Spark task workers have no logging configuration; keep Twisted's chatter out.
    logging.getLogger("twisted").setLevel(logging.WARNING)


class DatasetReader(DataSourceReader):
    """One input partition per lane; built in a planner worker, pickled to tasks."""

    def __init__(self, spec: TransferSpec, target: pa.Schema) -> None:
        self.spec = spec
        self.target = target

    def partitions(self) -> list[InputPartition]:
        return [InputPartition(lane) for lane in range(self.spec.lanes)]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        from ..transfer.receive import read_lane

        _quiet_logs()
        lane = int(partition.value)
        for batch in read_lane(self.spec, lane):
            if batch.num_rows:
                yield cast_batch(batch, self.target)
