"""Spark dataset transfers: ``df.write.format("dilation")`` and the parallel lane reader.

What runs where (PySpark 4.3, see DESIGN.md):

- Sender: ``DilationDataSource.writer()`` (a planner worker) starts the
  sender host, which runs the session over the code (``sender_host=false``:
  the planner runs it), and returns a :class:`DilationArrowWriter` holding the
  :class:`~spark_dilation.transfer.spec.TransferSpec`. Spark pickles it to the
  tasks; each ``write()`` hands its partition to the host on this machine
  (:mod:`~spark_dilation.transfer.hostlink`) or, with no host here, streams it
  to lane ``p mod lanes`` over the process's shared Dilation connection to
  that lane; either way it returns when the lane confirmed it. ``commit()``
  (another worker) delivers the manifest to every lane (through the host if
  one runs here) and logs the transfer report; ``abort()`` tells the lanes.
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

from ..transfer.protocol import CommittedPartition
from ..transfer.report import ConnectionStats, TransferReport, merge_stats
from ..transfer.spec import TransferSpec
from .staged import cast_batch

log = logging.getLogger("spark_dilation.spark.dataset")
report_log = logging.getLogger("spark_dilation.report")

REPORT_PREFIX = "spark-dilation transfer report: "


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
        partition, attempt = _task()
        if self.spec.options.sender_host:
            from ..transfer.hostlink import send_partition_via_host

            # The machine's sender host, if one runs here (started by writer()).
            via_host = send_partition_via_host(self.spec, partition, attempt, iterator)
            if via_host is not None:
                return PartitionSent(*via_host)
        from ..transfer.sender import pool, send_partition

        _quiet_logs()
        connections = pool()
        committed = send_partition(self.spec, partition, attempt, iterator, connections=connections)
        return PartitionSent(committed, connections.stats(self.spec.transfer_id))

    def commit(self, messages: list[PartitionSent | None]) -> None:
        from ..transfer.protocol import Manifest

        sent = [m for m in messages if m is not None]
        manifest = Manifest.of(self.spec.transfer_id, (m.committed for m in sent))
        control = None
        if self.spec.options.sender_host:
            from ..transfer.hostlink import deliver_manifest_via_host

            control = deliver_manifest_via_host(self.spec, manifest.partitions)
        if control is None:
            from ..transfer.sender import deliver_manifest

            _quiet_logs()
            _, control = deliver_manifest(self.spec, manifest.partitions)
        connections, reconnects, path = merge_stats(m.stats for m in sent)
        report = TransferReport(
            rows=manifest.rows,
            bytes=sum(m.committed.bytes for m in sent),
            partitions=len(sent),
            lanes=self.spec.lanes,
            connections=connections + control,
            reconnects=reconnects,
            path=path,
            seconds=round(time.time() - self.started, 3),
            compression=self.spec.compression,
        )
        _log_report(report)

    def abort(self, messages: list[PartitionSent | None]) -> None:
        reason = "the Spark job writing the dataset failed"
        if self.spec.options.sender_host:
            from ..transfer.hostlink import deliver_abort_via_host

            try:
                if deliver_abort_via_host(self.spec, reason, timeout=30):
                    return
            except Exception as e:  # best effort, like deliver_abort; try in-process
                log.warning("the sender host could not deliver the abort: %s", e)
        from ..transfer.sender import deliver_abort

        deliver_abort(self.spec, reason, timeout=30)


def _log_report(report: TransferReport) -> None:
    # commit() runs in a Python worker on the driver machine, whose stderr
    # Spark forwards to the driver's: give the report a handler there.
    if not report_log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        report_log.addHandler(handler)
        report_log.setLevel(logging.INFO)
        report_log.propagate = False
    report_log.info("spark-dilation: sent %s", report.summary())
    report_log.info("%s%s", REPORT_PREFIX, report.to_json())


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
        from ..transfer.lane import read_lane

        _quiet_logs()
        lane = int(partition.value)
        for batch in read_lane(self.spec, lane):
            if batch.num_rows:
                yield cast_batch(batch, self.target)
