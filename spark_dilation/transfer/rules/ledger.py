"""Exactly once for a stream: what the receiving side holds, batch by batch (pure).

The sending query's micro-batch ``B`` arrives as partitions, each one attempt
of a Spark write task, and then, from the sink's ``commit(B)``, a
**manifest** naming the one attempt of each partition that Spark kept. The
receiving side, in :class:`ReceiverLedger`:

* keeps every partition as it arrives, durably, under ``(B, partition, attempt)``;
* answers a manifest with **have** once every attempt it names is kept (the
  batch is then *staged*; other attempts are dropped), and at once if ``B``
  is the last batch it staged: a sending query restarted from its checkpoint
  runs ``B`` again, and the re-run is dropped whole;
* refuses a manifest from another sending query (Spark's query id: a
  checkpoint deleted and made again at the same path is a new query) and one
  whose batch id lies below the last staged one (a checkpoint rolled back):
  either would be taken for re-runs and dropped, so it is a
  :class:`StreamResetError`, never a silent ``have``;
* gives each staged batch the next **sequence number**. The source's offsets
  count sequence numbers, so they only grow, whatever the sender's batch ids
  do, and a batch is read by the receiving query in the order it was staged;
* frees a batch when the receiving query commits an offset past it, and
  forgets it: what stays is the live batches and two numbers (the last staged
  batch id and its sequence number), so the ledger's size and each write's
  cost do not grow with the stream's history.

Reading a range (:meth:`ReceiverLedger.between`) changes nothing: Spark may
plan a range twice, or an empty one (PySpark 4.0/4.1 call ``partitions(L, L)``
on restart before they plan the batch again); only ``commit(end)`` frees.

The sink's ``commit(B)`` returns only after **have** for ``B``: a batch the
sending query logged as committed is staged on the receiving side, and its
offsets give it to the receiving query exactly once. The ledger is persisted
(:meth:`ReceiverLedger.to_json`) after each change and before any answer, so
a receiving side restarted at any point answers as it would have.

A ledger belongs to one sending query (its Spark query id): a new query
restarts batch ids at 0, and its batches would be taken for re-runs.

:class:`SinkLedger` is the sending side's half: what it must deliver (again,
to each new pair) until the receiver says **have**.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from .pairing import PairingError
from .states import BATCH, Batch, BatchEvent

Key = tuple[int, int, str]  # (batch, partition, attempt)
LEDGER_NAME = "ledger.json"  # the receiving side's ledger, in its state folder


class StreamResetError(PairingError):
    """The sending query is not the one this stream's receiving side belongs to, or its
    batch ids went back: its checkpoint was reset or rolled back."""


def reset_message(checkpoint: str | None, what: str) -> str:
    """What both queries are told when the sending query's checkpoint was reset."""
    where = f"at {checkpoint} " if checkpoint else ""
    return (
        f"the sending query's checkpoint {where}was reset or rolled back ({what}): its "
        "batches would be taken for ones already delivered and dropped, so they are refused. "
        "Restore that checkpoint, or start a new stream: a new code, a new pairing_dir or "
        "state_dir on each side, and a new receiving checkpoint"
    )


@dataclass
class Staged:
    """One batch on the receiving side."""

    batch: int
    state: Batch = BATCH.initial
    attempts: dict[int, str] = field(default_factory=dict)  # partition -> kept attempt
    seq: int | None = None  # once staged
    rows: int = 0  # the manifest's totals: admission control and lag
    nbytes: int = 0


@dataclass(frozen=True)
class Answer:
    """The receiver's answer to a manifest: ``have`` (with the batch's sequence number),
    or the partitions still awaited."""

    have: bool
    seq: int | None = None
    missing: tuple[int, ...] = ()


class ReceiverLedger:
    def __init__(self) -> None:
        self.query: str | None = None  # the sending query this ledger belongs to
        self.batches: dict[int, Staged] = {}
        # Sequence number -> staged batch: reading and committing look up the offsets'
        # range instead of sorting every batch the stream ever staged, per trigger.
        self.by_seq: dict[int, Staged] = {}
        self.kept: set[Key] = set()  # partitions held, staged or not
        self.next_seq = 0  # the source's latest offset
        self.freed_below = 0  # the receiving query committed offsets below this
        # The last batch staged and its sequence number: what remains of the freed
        # batches, enough to answer a re-run and to refuse a batch id that went back.
        self.top = -1
        self.top_seq: int | None = None

    # --- the sending side's messages -------------------------------------------------------

    def arrived(self, batch: int, partition: int, attempt: str) -> bool:
        """A partition arrived; whether to keep it (False: its batch is staged or freed,
        so this is a re-run's or a losing attempt's, and the caller drops it)."""
        entry = self.batches.get(batch)
        if batch <= self.top or (entry is not None and entry.state is not Batch.RECEIVING):
            return False
        self.kept.add((batch, partition, attempt))
        return True

    def manifest(
        self,
        query: str,
        batch: int,
        attempts: dict[int, str],
        rows: int = 0,
        nbytes: int = 0,
        checkpoint: str | None = None,
    ) -> Answer:
        """The sink committed ``batch`` with these attempts (``rows`` and ``nbytes`` in
        all); ``have`` once it is staged. ``checkpoint``: the sending query's, as its
        sink knows it, for the message of a reset."""
        if self.query is None:
            self.query = query
        elif query != self.query:
            raise StreamResetError(
                reset_message(
                    checkpoint,
                    f"Spark's query id is {query}, and this stream belongs to {self.query}",
                )
            )
        stale = self.batches.get(batch)
        if batch < self.top and stale is not None and stale.attempts == attempts:
            # The same manifest again, from a pair that ended (its batch is not freed yet).
            stale.state = BATCH.next(stale.state, BatchEvent.MANIFEST_AGAIN)
            return Answer(True, seq=stale.seq)
        if batch < self.top:
            raise StreamResetError(
                reset_message(
                    checkpoint, f"it committed micro-batch {batch} after micro-batch {self.top}"
                )
            )
        if batch == self.top:  # a re-run of the last staged batch: dropped whole
            entry = self.batches.get(batch)
            if entry is not None:
                entry.state = BATCH.next(entry.state, BatchEvent.MANIFEST_AGAIN)
            return Answer(True, seq=self.top_seq)
        entry = self.batches.setdefault(batch, Staged(batch))
        entry.attempts, entry.rows, entry.nbytes = dict(attempts), rows, nbytes
        missing = tuple(p for p, a in sorted(attempts.items()) if (batch, p, a) not in self.kept)
        if missing:
            return Answer(False, missing=missing)
        entry.state = BATCH.next(entry.state, BatchEvent.ALL_KEPT)
        entry.seq = self.next_seq
        self.by_seq[entry.seq] = entry
        self.next_seq += 1
        self.top, self.top_seq = batch, entry.seq
        # Dropped: the losing attempts, and whatever of an earlier batch id is not staged
        # (an aborted batch's leftovers: the sending query never goes back to it).
        staged = {b for b, e in self.batches.items() if b < batch and e.state is Batch.STAGED}
        self.kept = {
            k
            for k in self.kept
            if k[0] > batch or k[0] in staged or (k[0] == batch and attempts.get(k[1]) == k[2])
        }
        self.batches = {b: e for b, e in self.batches.items() if b >= batch or b in staged}
        return Answer(True, seq=entry.seq)

    def aborted(self, batch: int) -> list[Key]:
        """The sink aborted ``batch`` (it runs again); the partitions to delete."""
        entry = self.batches.get(batch)
        if batch <= self.top or (entry is not None and entry.state is not Batch.RECEIVING):
            return []  # staged already: an abort of a re-run changes nothing
        gone = sorted(k for k in self.kept if k[0] == batch)
        self.kept -= set(gone)
        self.batches.pop(batch, None)
        return gone

    # --- the receiving query's calls -------------------------------------------------------

    def between(self, start: int, end: int) -> list[Staged]:
        """The staged batches with sequence numbers in ``[start, end)``, in order.

        Reads only: Spark plans a range again after a restart, and PySpark 4.0/4.1
        plan the empty range ``(L, L)`` first."""
        if end > self.next_seq:
            raise PairingError(
                f"offsets {start}-{end} name batches this side never staged (it staged "
                f"{self.next_seq}): the receiving stage is not the one this query's "
                "checkpoint read from, or it was lost"
            )
        if start >= end:
            return []
        if start < self.freed_below:
            raise PairingError(
                f"offset {start} was committed by the receiving query and freed; its "
                "checkpoint is older than this stream's ledger"
            )
        return [self.by_seq[seq] for seq in range(start, end)]

    def end_within(
        self, start: int, max_rows: int | None = None, max_bytes: int | None = None
    ) -> int:
        """The latest offset a micro-batch from ``start`` may read under the limits
        (``maxRecordsPerTrigger``, ``maxBytesPerTrigger``): whole batches, and always at
        least one when one is staged, so a batch larger than the limit still moves."""
        end, rows, nbytes = start, 0, 0
        for entry in self.between(start, self.next_seq):
            rows, nbytes = rows + entry.rows, nbytes + entry.nbytes
            over = (max_rows is not None and rows > max_rows) or (
                max_bytes is not None and nbytes > max_bytes
            )
            if over and end > start:
                break
            end += 1
        return end

    def lag(self, start: int) -> dict[str, int]:
        """What is staged from ``start`` on and not yet read: batches, rows, bytes."""
        waiting = self.between(start, self.next_seq)
        return {
            "batches": len(waiting),
            "rows": sum(b.rows for b in waiting),
            "bytes": sum(b.nbytes for b in waiting),
        }

    def commit(self, end: int) -> list[Key]:
        """The receiving query is done with offsets below ``end``: the partitions to
        delete. Freed batches are forgotten (``top`` remembers the last one)."""
        gone: list[Key] = []
        # Below freed_below every batch is freed already (each commit frees all below it).
        end = min(end, self.next_seq)
        for seq in range(self.freed_below, end):
            entry = self.by_seq.pop(seq)
            entry.state = BATCH.next(entry.state, BatchEvent.CONSUMED)
            del self.batches[entry.batch]
            gone += [(entry.batch, p, a) for p, a in sorted(entry.attempts.items())]
        self.kept -= set(gone)
        self.freed_below = max(self.freed_below, end)
        return gone

    # --- durability ----------------------------------------------------------------------

    def to_json(self) -> str:
        return json.dumps(
            {
                "query": self.query,
                "next_seq": self.next_seq,
                "freed_below": self.freed_below,
                "top": [self.top, self.top_seq],
                "kept": sorted(self.kept),
                "batches": [
                    [
                        b.batch,
                        b.state.value,
                        {str(p): a for p, a in b.attempts.items()},
                        b.seq,
                        b.rows,
                        b.nbytes,
                    ]
                    for b in self.batches.values()
                ],
            }
        )

    @classmethod
    def from_json(cls, text: str) -> ReceiverLedger:
        body: dict[str, Any] = json.loads(text)
        ledger = cls()
        ledger.query, ledger.next_seq = body["query"], body["next_seq"]
        ledger.freed_below = body["freed_below"]
        ledger.top, ledger.top_seq = body.get("top", (-1, None))
        ledger.kept = {(b, p, a) for b, p, a in body["kept"]}
        for batch, state, attempts, seq, rows, nbytes in body["batches"]:
            attempts = {int(p): a for p, a in attempts.items()}
            entry = ledger.batches[batch] = Staged(batch, Batch(state), attempts, seq, rows, nbytes)
            if seq is not None:
                ledger.by_seq[seq] = entry
        return ledger


class SinkLedger:
    """The sending side: partitions and manifests to deliver until the receiver has them."""

    def __init__(self, query: str) -> None:
        self.query = query
        self.written: dict[Key, Any] = {}  # (batch, partition, attempt) -> where it is spooled
        self.manifests: dict[int, dict[int, str]] = {}  # committed by the sink, not yet had

    def wrote(self, key: Key, where: Any) -> None:
        self.written[key] = where

    def committed(self, batch: int, attempts: dict[int, str]) -> list[Key]:
        """The sink's commit: the manifest is due; the losing attempts, to delete."""
        self.manifests[batch] = dict(attempts)
        losers = [k for k in self.written if k[0] == batch and attempts.get(k[1]) != k[2]]
        for k in losers:
            del self.written[k]
        return losers

    def aborted(self, batch: int) -> list[Key]:
        """The sink aborted ``batch`` (it runs again): forget it; its spool, to delete."""
        return self._forget(batch)

    def have(self, batch: int) -> list[Key]:
        """The receiver staged ``batch``: the sink's commit returns; delete its spool."""
        return self._forget(batch)

    def _forget(self, batch: int) -> list[Key]:
        self.manifests.pop(batch, None)
        gone = [k for k in self.written if k[0] == batch]
        for k in gone:
            del self.written[k]
        return gone

    def to_deliver(self) -> tuple[list[Key], dict[int, dict[int, str]]]:
        """What a new pair must be sent, in order: every spooled partition, then the
        manifests (the receiver keeps what it has and answers have where it can)."""
        return sorted(self.written), dict(sorted(self.manifests.items()))
