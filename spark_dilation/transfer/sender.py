"""The sending side: the per-process connection pool, partition streams, manifest delivery.

A sender process (a Spark Python worker, or the single process of the
Python API) keeps at most one Dilation connection per lane of a transfer in
:class:`ConnectionPool`, made through the rendezvous and reused by every
partition it sends to that lane, each on its own subchannel. The pool is a
cache: Spark may kill the worker when it is idle, and a broken connection is
evicted and made again by the next partition.

Sender task states (``docs/transfer.md`` has the diagram)::

    CONNECTING --pool hit / paired--> STREAMING --trailer sent--> AWAITING_COMPLETE
    AWAITING_COMPLETE --"C"--> COMMITTED      (the task may succeed)
    any state --error / "E" / deadline--> FAILED (the lane drops the attempt)
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pyarrow as pa

from ..dilation.blocking import BlockingDilationError, DilationTimeout
from ..errors import DilationError
from .partition import (
    InjectedFailure,
    LaneLostError,
    LaneNotStartedError,
    LaneRefusedError,
    PartitionStream,
    ReceiverFailedError,
)
from .protocol import (
    CONTROL_SUBPROTOCOL,
    PARTITION_SUBPROTOCOL,
    ROLE_SENDER,
    TAG_ABORT,
    TAG_COMPLETE,
    TAG_ERROR,
    TAG_OK,
    CommittedPartition,
    Complete,
    Manifest,
    ProtocolError,
    decode_message,
    encode_json,
    lane_of,
)
from .rendezvous import RendezvousTimeout, dilate_paired, pair
from .report import ConnectionStats, is_reconnecting, path_of, reconnects_of
from .spec import TransferSpec

log = logging.getLogger(__name__)

__all__ = [
    "ConnectionPool",
    "InjectedFailure",
    "LaneLostError",
    "LaneNotStartedError",
    "LaneRefusedError",
    "ReceiverFailedError",
    "deliver_abort",
    "deliver_control",
    "deliver_manifest",
    "pool",
    "send_partition",
    "stream_partition",
]


def process_name() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


class ConnectionPool:
    """Dilation connections of this process, one per (transfer, lane); thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._conns: dict[tuple[str, int], Any] = {}
        self._making: dict[tuple[str, int], threading.Lock] = {}
        self.opened: dict[str, int] = {}  # transfer -> connections opened
        self.paths: dict[str, list[str]] = {}

    def get(self, spec: TransferSpec, lane: int, deadline: float, what: str = "a partition") -> Any:
        key = (spec.transfer_id, lane)
        with self._lock:
            making = self._making.setdefault(key, threading.Lock())
        with making:
            with self._lock:
                conn = self._conns.get(key)
            if conn is not None and conn._error is None and not conn._closed:
                return conn
            if conn is not None:
                self.evict(spec.transfer_id, lane, conn)
            conn = self._connect(spec, lane, deadline, what)
            with self._lock:
                self._conns[key] = conn
                self.opened[spec.transfer_id] = self.opened.get(spec.transfer_id, 0) + 1
            return conn

    def _connect(self, spec: TransferSpec, lane: int, deadline: float, what: str) -> Any:
        opts = spec.options
        try:
            paired = pair(
                mailbox_url=opts.mailbox_url,
                secret=spec.secret,
                transfer_id=spec.transfer_id,
                lane=lane,
                role=ROLE_SENDER,
                deadline=deadline,
                what=f"lane {lane}",
            )
        except RendezvousTimeout:
            raise LaneNotStartedError(lane, spec.lanes, opts.lane_start_timeout, what) from None
        conn = dilate_paired(
            paired,
            relay_url=opts.relay_url,
            no_listen=opts.no_listen,
            listen=(),
            peer_timeout=opts.reconnect_timeout,
            timeout=opts.reconnect_timeout,
        )
        log.info(
            "connected to lane %d of transfer %s (slot %d)", lane, spec.transfer_id, paired.slot
        )
        return conn

    def evict(self, transfer_id: str, lane: int, conn: Any = None) -> None:
        with self._lock:
            current = self._conns.get((transfer_id, lane))
            if conn is None or current is conn:
                self._conns.pop((transfer_id, lane), None)
            else:
                return
        if current is not None:
            threading.Thread(target=_quiet_close, args=(current,), daemon=True).start()

    def stats(self, transfer_id: str) -> ConnectionStats:
        with self._lock:
            conns = [c for (t, _), c in self._conns.items() if t == transfer_id]
            opened = self.opened.get(transfer_id, 0)
        paths: list[str] = []
        reconnects = reconnecting = fallbacks = 0
        for c in conns:
            try:
                status = c.status()
            except DilationError:
                continue
            paths.append(path_of(status.connection))
            reconnects += reconnects_of(status)
            reconnecting += is_reconnecting(status)
            fallbacks += status.relay_fallbacks
        return ConnectionStats(
            process_name(), opened, reconnects, tuple(paths), reconnecting, fallbacks
        )

    def close_transfer(self, transfer_id: str) -> None:
        with self._lock:
            keys = [k for k in self._conns if k[0] == transfer_id]
            conns = [self._conns.pop(k) for k in keys]
        for c in conns:
            _quiet_close(c)


def _quiet_close(conn: Any) -> None:
    try:
        conn.close(timeout=10, linger=2)
    except Exception as e:  # teardown
        log.info("closing a pooled connection: %s", e)


_POOL = ConnectionPool()


def pool() -> ConnectionPool:
    """This process's pool (one per Python worker; it survives between tasks)."""
    return _POOL


def send_partition(
    spec: TransferSpec,
    partition: int,
    attempt: int,
    batches: Iterable[pa.RecordBatch],
    *,
    connections: ConnectionPool | None = None,
) -> CommittedPartition:
    """Stream one partition to its lane and wait for "complete" (blocking).

    Raises :class:`LaneNotStartedError`, :class:`LaneLostError` (retryable:
    nothing of this attempt is kept by the lane), :class:`LaneRefusedError`.
    """
    stream = PartitionStream(spec, partition, attempt)
    done = stream_partition(spec, partition, stream.messages(batches), connections=connections)
    return stream.committed(done, lane_of(partition, spec.lanes))


def stream_partition(
    spec: TransferSpec,
    partition: int,
    messages: Iterable[bytes],
    *,
    connections: ConnectionPool | None = None,
) -> Complete:
    """Send a partition's messages (header first, trailer last) on a new subchannel.

    Returns the lane's "complete" answer. If ``messages`` raises before the
    trailer, the subchannel closes without it and the lane drops the attempt.
    """
    connections = connections or pool()
    opts = spec.options
    lane = lane_of(partition, spec.lanes)
    deadline = time.monotonic() + opts.lane_start_timeout
    conn = connections.get(spec, lane, deadline)
    try:
        channel = conn.open(PARTITION_SUBPROTOCOL, timeout=opts.lane_start_timeout)
    except BlockingDilationError as e:
        connections.evict(spec.transfer_id, lane, conn)
        raise LaneLostError(f"could not open a subchannel to lane {lane}: {e}") from e
    try:
        for message in messages:
            channel.send(message, timeout=opts.reconnect_timeout)
        reply = channel.receive(timeout=opts.reconnect_timeout + opts.lane_start_timeout)
    except DilationTimeout as e:
        channel.close()
        raise LaneLostError(f"lane {lane} did not confirm partition {partition}: {e}") from e
    except BlockingDilationError as e:
        early = _early_answer(channel)
        if early is not None:  # the lane refused mid-stream and closed: its reason
            channel.close()
            _answer(early, lane, TAG_COMPLETE, f"partition {partition}")
        connections.evict(spec.transfer_id, lane, conn)
        raise LaneLostError(
            f"the connection to lane {lane} failed while sending partition {partition}: {e}"
        ) from e
    except BaseException:
        channel.close()  # no trailer: the lane drops this attempt
        raise
    channel.close()
    return Complete.from_body(_answer(reply, lane, TAG_COMPLETE, f"partition {partition}"))


def _early_answer(channel: Any) -> bytes | None:
    """An ``E`` the lane sent before closing the subchannel under our sends, if any."""
    try:
        reply = channel.receive(timeout=0)
    except BlockingDilationError:
        return None
    return reply if reply is not None and reply[:1] == TAG_ERROR else None


def _answer(reply: bytes | None, lane: int, expected: bytes, what: str) -> dict:
    """The body of the lane's answer about ``what`` if it is ``expected``; else the error."""
    if reply is None:
        raise LaneLostError(f"lane {lane} closed without confirming {what}")
    tag, body = decode_message(reply)
    if tag == TAG_ERROR and body.get("failed"):
        raise ReceiverFailedError(str(body.get("error")))
    if tag == TAG_ERROR:
        raise LaneRefusedError(f"lane {lane} refused {what}: {body.get('error')}")
    if tag != expected:
        raise ProtocolError(f"lane {lane} answered {tag!r} about {what}")
    return body


def deliver_control(
    spec: TransferSpec,
    message: bytes,
    *,
    timeout: float,
    connections: ConnectionPool | None = None,
) -> int:
    """Send the manifest (or an abort) to every lane and wait for each to confirm.

    Returns how many Dilation connections it opened (one per lane, more if a
    lane went away meanwhile), which the transfer report counts.

    Runs in a fresh process (Spark's commit()/abort() worker) or at the end of
    the Python API's send, with a pool of its own (one connection per lane,
    in parallel), or in the sender host with the host's pool (``connections``,
    whose connections the partitions used; it is closed afterwards).
    """
    errors: list[BaseException] = []
    deadline = time.monotonic() + timeout
    opened_before = connections.opened.get(spec.transfer_id, 0) if connections else 0
    connections = connections or ConnectionPool()
    what = "the abort" if message[:1] == TAG_ABORT else "the final manifest"

    def once(lane: int) -> None:
        conn = connections.get(spec, lane, deadline, what=what)
        try:
            with conn.open(CONTROL_SUBPROTOCOL, timeout=timeout) as channel:
                channel.send(message, timeout=timeout)
                reply = channel.receive(timeout=max(1.0, deadline - time.monotonic()))
        except BlockingDilationError as e:
            connections.evict(spec.transfer_id, lane, conn)
            raise LaneLostError(f"lane {lane} went away during {what}: {e}") from e
        if reply is None:
            connections.evict(spec.transfer_id, lane, conn)
        _answer(reply, lane, TAG_OK, what)

    def one(lane: int) -> None:
        # A lane restarted meanwhile (a new incarnation in a new lobby) gets it again.
        while True:
            try:
                return once(lane)
            except LaneLostError as e:
                if time.monotonic() >= deadline:
                    errors.append(e)
                    return
                log.info("%s; trying again", e)
                time.sleep(0.5)
            except BaseException as e:
                errors.append(e)
                return

    with ThreadPoolExecutor(max_workers=min(16, spec.lanes)) as ex:
        list(ex.map(one, range(spec.lanes)))
    opened = connections.stats(spec.transfer_id).connections_opened - opened_before
    connections.close_transfer(spec.transfer_id)
    if errors:
        raise errors[0]
    return opened


def deliver_manifest(
    spec: TransferSpec,
    partitions: Iterable[CommittedPartition],
    connections: ConnectionPool | None = None,
) -> tuple[Manifest, int]:
    """Deliver the final manifest to every lane: (the manifest, connections opened)."""
    manifest = Manifest.of(spec.transfer_id, partitions)
    opened = deliver_control(
        spec, manifest.encode(), timeout=spec.options.lane_start_timeout, connections=connections
    )
    return manifest, opened


def deliver_abort(
    spec: TransferSpec,
    reason: str,
    timeout: float = 30.0,
    connections: ConnectionPool | None = None,
) -> None:
    """Tell every reachable lane the transfer failed (best effort, bounded)."""
    try:
        deliver_control(
            spec,
            encode_json(TAG_ABORT, {"reason": reason}),
            timeout=timeout,
            connections=connections,
        )
    except (DilationError, TimeoutError) as e:
        log.warning("could not tell every lane about the abort: %s", e)
