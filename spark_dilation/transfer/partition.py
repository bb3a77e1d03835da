"""One partition's stream on the sending side, without the network: no Twisted here.

A Spark task that hands its partition to the machine's sender host
(:mod:`.senderhost`) encodes it with this module alone, so it never loads
the wormhole and Dilation stack (about 0.4 CPU-s per process). The
in-process path (:func:`.sender.send_partition`) uses the same pieces.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import pyarrow as pa

from ..errors import TransferError
from .options import TransferOptions
from .protocol import (
    CommittedPartition,
    Complete,
    PartitionEncoder,
    PartitionHeader,
    ProtocolError,
    SchemaMismatchError,
)
from .spec import TransferSpec


class LaneNotStartedError(TransferError, TimeoutError):
    def __init__(
        self,
        lane: int,
        lanes: int,
        timeout: float,
        what: str = "a partition",
        options: TransferOptions | None = None,
    ) -> None:
        text = f"lane {lane} of {lanes} did not start within {timeout:g} s (waited to send {what})"
        raise_it = options.spelled("lane_start_timeout") if options else "lane_start_timeout"
        if options is None or options.surface == "spark":
            text += (
                ". The reader runs its lanes when an action (count(), show(), write) runs, "
                "and all lanes must run at once: set option lanes to at most the reader's "
                f"task slots, start the reader's action sooner, or raise {raise_it}"
            )
        else:  # the Python API and the CLI run every lane at once: no Spark advice
            text += f". Check that the receiver is still running, or raise {raise_it}"
        super().__init__(text)


class LaneLostError(TransferError):
    """The lane went away before it confirmed the partition; a retry sends it again."""


class LaneRefusedError(TransferError):
    """The lane refused the partition (schema mismatch, aborted transfer, ...)."""


class ReceiverFailedError(LaneRefusedError):
    """The receiver could not keep the data (its disk, its output): its own words.

    Not transient: sending the partition again would fail the same way.
    """


class InjectedFailure(TransferError):
    """A test-only failure requested with option ``test_fail``."""


def conform(batch: pa.RecordBatch, schema: pa.Schema) -> pa.RecordBatch:
    """``batch`` with the transfer's schema (casts compatible types; else an error)."""
    if batch.schema.equals(schema):
        return batch
    try:
        return pa.RecordBatch.from_arrays(
            [batch.column(i).cast(f.type) for i, f in enumerate(schema)], schema=schema
        )
    except (pa.ArrowException, IndexError) as e:
        raise SchemaMismatchError(
            f"a batch with schema {batch.schema} does not match the transfer's schema {schema}: {e}"
        ) from e


def injected_failure(spec: str, kind: str, attempt: int) -> int | None:
    """Messages after which to fail, if option test_fail asks for ``kind`` on this attempt."""
    for item in filter(None, (s.strip() for s in spec.split(","))):
        name, _, rest = item.partition(":")
        if name == kind and attempt == 0:
            return int(rest or "2")
    return None


def injected_pause(spec: str) -> float:
    """Seconds a first attempt pauses after its header (``sender-pause:S``; tests only)."""
    for item in filter(None, (s.strip() for s in spec.split(","))):
        name, _, rest = item.partition(":")
        if name == "sender-pause":
            return float(rest or "10")
    return 0.0


class PartitionStream:
    """The messages of one partition attempt: header, ``D`` messages, trailer.

    :meth:`messages` is a generator; the caller sends each message on the
    partition's subchannel (or to the sender host). If it raises midway the
    caller must close without a trailer, so the lane drops the attempt.
    """

    def __init__(self, spec: TransferSpec, partition: int, attempt: int) -> None:
        self.spec = spec
        self.partition = partition
        self.attempt = attempt
        self.encoder = PartitionEncoder(spec.schema, spec.compression)

    @property
    def rows(self) -> int:
        return self.encoder.rows

    @property
    def bytes(self) -> int:
        return self.encoder.bytes

    def messages(self, batches: Iterable[pa.RecordBatch]) -> Iterator[bytes]:
        spec, encoder = self.spec, self.encoder
        fail_after = injected_failure(spec.options.test_fail, "sender-mid-partition", self.attempt)
        yield PartitionHeader(
            spec.transfer_id, self.partition, self.attempt, spec.fingerprint, spec.compression
        ).encode()
        pause = injected_pause(spec.options.test_fail)
        if pause and self.attempt == 0:
            import time

            time.sleep(pause)  # a slow sender: faults can strike mid-transfer
        for batch in batches:
            for message in encoder.encode(conform(batch, spec.schema)):
                yield message
                if fail_after is not None and encoder.messages >= fail_after:
                    raise InjectedFailure(
                        f"test_fail: sender partition {self.partition} attempt {self.attempt} "
                        "fails mid-partition"
                    )
        yield from encoder.finish()

    def committed(self, done: Complete, lane: int) -> CommittedPartition:
        """The manifest entry for this attempt, from the lane's "complete" answer."""
        if done.rows != self.rows and not done.duplicate:
            raise ProtocolError(f"lane {lane} counted {done.rows} rows of {self.rows}")
        return CommittedPartition(
            self.partition, self.attempt, lane, done.incarnation, self.rows, self.bytes
        )
