"""One partition's stream on the sending side, without the network: no Twisted here.

A Spark task that hands its partition to the machine's sender host
(:mod:`.senderhost`) encodes it with this module alone, so it never loads
the wormhole and Dilation stack (about 0.4 CPU-s per process). The
in-process path (:func:`.pool.send_partition`) uses the same pieces.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator

import pyarrow as pa

from ..rules import codec
from ..rules.errors import InjectedFailure, ProtocolError, SchemaMismatchError
from ..rules.pqformat import FORMAT as PARQUET
from ..rules.protocol import CommittedPartition, Complete, PartitionEncoder, PartitionHeader
from ..rules.spec import TransferSpec
from . import meter


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

    def __init__(
        self,
        spec: TransferSpec,
        partition: int,
        attempt: int,
        link: Callable[[], codec.Link] | None = None,
    ) -> None:
        self.spec = spec
        self.partition = partition
        self.attempt = attempt
        # compression=auto: the encoder is made at the first batch, when the
        # codec is chosen; ``link`` says what the connection carries (default:
        # what this process observed; a sender host's tasks ask the host).
        self._link = link or (lambda: meter.current_link(spec.transfer_id))
        self.choice: codec.Choice | None = None
        self.encoder = PartitionEncoder(spec.schema, self._fixed_compression())

    def _fixed_compression(self) -> str:
        compression = self.spec.compression
        if compression == codec.AUTO:
            return "none"
        if compression == PARQUET and not self.spec.parquet_ok:
            return "zstd"  # an older receiver, or a type Parquet would not keep exactly
        return compression

    def _choose(self, first: pa.RecordBatch | None) -> None:
        """compression=auto: pick this partition's codec from the first batch and the link."""
        spec = self.spec
        link = self._link()
        costs: tuple[codec.CpuCost, ...] = ()
        if first is not None and link.mb_per_s < codec.FAST_LINK_MB_S:  # fast: pay nothing
            costs = meter.measure(first, spec.fingerprint, parquet=spec.parquet_ok)
        self.choice = codec.choose(costs, link)
        meter.note_choice(spec.transfer_id, self.partition, self.choice)
        self.encoder = PartitionEncoder(spec.schema, self.choice.encoder_compression())

    @property
    def rows(self) -> int:
        return self.encoder.rows

    @property
    def bytes(self) -> int:
        return self.encoder.bytes

    def messages(self, batches: Iterable[pa.RecordBatch]) -> Iterator[bytes]:
        spec = self.spec
        fail_after = injected_failure(spec.options.test_fail, "sender-mid-partition", self.attempt)
        batches = iter(batches)
        compression = self._fixed_compression()
        if spec.compression == codec.AUTO:
            # The header waits for the first batch: it names the codec chosen.
            first = next(batches, None)
            if first is not None:
                first = conform(first, spec.schema)
            self._choose(first)
            assert self.choice is not None
            compression = self.choice.codec
            if first is not None:
                batches = itertools.chain([first], batches)
        encoder = self.encoder
        yield PartitionHeader(
            spec.transfer_id, self.partition, self.attempt, spec.fingerprint, compression
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
