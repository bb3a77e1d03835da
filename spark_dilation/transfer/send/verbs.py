"""The one sending interface the Spark layer calls: agree, send a partition, commit, abort.

Whether this machine's sender host carries the work (option ``sender_host``,
:mod:`.hostlink`) or this process does (:mod:`.pool`) is decided here and
nowhere else. The driver machine's host always runs the session, holds the
writing end of the directory (:mod:`..meet.hub`) and delivers the commit or the
abort. With ``sender_host`` (the default) every sending machine gets one
host, started by its first task, so a transfer opens at most one connection
per (sending machine, lane); with it off each task process sends itself; a
machine where no host can run (a socket path over the Unix socket limit and
no /proc to shorten it; one warning says so) sends in-process. Importing
this module loads no network stack.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator
from typing import Any

import pyarrow as pa

from ..rules.protocol import ABORT_TIMEOUT, CommittedPartition
from ..rules.report import ConnectionStats, TransferReport, with_choice
from ..rules.spec import TransferSpec

log = logging.getLogger(__name__)


def agree(schema: pa.Schema, options: Any, code: str) -> TransferSpec:
    """The session over the code, as the sender of a Spark DataFrame (blocks for the reader)."""
    from .hostlink import HostLaunch

    # The host runs the session, then holds the writing end of the directory
    # (every sending process meets the lanes through it) and serves the tasks
    # (sender_host) and the commit: the caller (a planner worker) waits
    # without loading the network stack itself.
    return HostLaunch(schema, options, code).wait_spec()


def send(
    spec: TransferSpec, partition: int, attempt: int, batches: Iterator[pa.RecordBatch]
) -> tuple[CommittedPartition, ConnectionStats]:
    """Send one partition; returns once its lane confirmed it (and the sender's stats)."""
    if spec.options.sender_host:
        from .hostlink import send_partition_via_host, start_sender_host

        via_host = send_partition_via_host(spec, partition, attempt, batches)
        if via_host is None and start_sender_host(spec):
            via_host = send_partition_via_host(spec, partition, attempt, batches)
        if via_host is not None:
            return via_host
    from .meter import choice_of
    from .pool import pool, send_partition

    connections = pool()
    committed = send_partition(spec, partition, attempt, batches, connections=connections)
    choice = choice_of(spec.transfer_id, partition)
    return committed, with_choice(connections.stats(spec.transfer_id), choice)


def commit(
    spec: TransferSpec,
    sent: Iterable[tuple[CommittedPartition, ConnectionStats]],
    started: float,
) -> TransferReport:
    """Deliver the final manifest to every lane; the transfer's report.

    The report counts every connection of every sending process: the tasks'
    hosts (or pools) and the host (or this process) that delivered the manifest.
    """
    from ..rules.protocol import Manifest

    sent = list(sent)
    manifest = Manifest.of(spec.transfer_id, (c for c, _ in sent))
    stats = [s for _, s in sent]
    control = 0
    from .hostlink import deliver_manifest_via_host

    host_stats = deliver_manifest_via_host(spec, manifest.partitions)
    if host_stats is not None:
        stats.append(host_stats)
    else:
        from .delivery import deliver_manifest

        _, control = deliver_manifest(spec, manifest.partitions)
    return TransferReport.of(
        manifest.partitions,
        stats,
        lanes=spec.lanes,
        compression=spec.compression,
        seconds=round(time.time() - started, 3),
        control=control,
        compression_detail=_detail(spec, stats, len(sent)),
    )


def _detail(spec: TransferSpec, stats: list[ConnectionStats], partitions: int) -> str:
    from ..rules.codec import AUTO, describe, fallback_detail, stats_choices

    if spec.compression == AUTO:
        return describe(stats_choices(stats))
    return fallback_detail(spec.compression, spec.parquet_refused(), partitions)


def abort(spec: TransferSpec, reason: str, timeout: float | None = None) -> None:
    """Tell every lane the transfer failed (best effort: the lanes' deadlines end them too)."""
    from .hostlink import deliver_abort_via_host

    timeout = ABORT_TIMEOUT if timeout is None else timeout
    try:
        if deliver_abort_via_host(spec, reason, timeout=timeout):
            return
    except Exception as e:  # best effort, like deliver_abort; try in-process
        log.warning("the sender host could not deliver the abort: %s", e)
    from .delivery import deliver_abort

    deliver_abort(spec, reason, timeout=timeout)
