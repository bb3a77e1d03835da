"""The receiving side of a stream on disk: its ledger and the partitions it keeps.

Under the stream's state folder (next to the pairing record)::

    ledger.json                      the ReceiverLedger (written durably before any answer)
    batches/B-P-A.arrow              partition P of micro-batch B, write attempt A (Arrow IPC)

A partition is written whole (fsync, then rename) before the ledger counts it
kept, and the folder of the renames is synced before the ledger that names
them is written, so a side killed at any point (the machine too) restarts
with a ledger that names only files it has. Rules: :mod:`..rules.ledger`.
"""

from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path
from typing import BinaryIO

from ..machine import atomic_write, sync_folder
from ..rules.ledger import LEDGER_NAME, Answer, Key, ReceiverLedger

_ATTEMPT = re.compile(r"[0-9A-Za-z_]{1,40}")


class StreamStage:
    """One receiving side's ledger and files; not thread-safe (one caller at a time)."""

    def __init__(self, directory: str | Path) -> None:
        self.dir = Path(directory)
        self.batches = self.dir / "batches"
        self.batches.mkdir(parents=True, exist_ok=True, mode=0o700)
        for tmp in self.batches.glob("*.tmp"):  # a partition a killed run was writing
            tmp.unlink(missing_ok=True)
        path = self.dir / LEDGER_NAME
        self.ledger = (
            ReceiverLedger.from_json(path.read_text()) if path.exists() else ReceiverLedger()
        )
        self._drop_unkept()

    def path(self, key: Key) -> Path:
        batch, partition, attempt = key
        if not _ATTEMPT.fullmatch(attempt):
            raise ValueError(f"a write attempt named {attempt!r}")
        return self.batches / f"{batch}-{partition}-{attempt}.arrow"

    # --- the sending side's messages -------------------------------------------------------

    def accepting(self, batch: int) -> bool:
        """Whether a partition of ``batch`` is worth writing (not staged or freed yet)."""
        entry = self.ledger.batches.get(batch)
        return entry is None or entry.state.value == "receiving"

    def open_part(self, key: Key) -> BinaryIO:
        return open(self.path(key).with_suffix(".tmp"), "wb")

    def close_part(self, key: Key, f: BinaryIO) -> None:
        """The partition written to ``f`` is whole: on disk, then kept."""
        f.flush()
        os.fsync(f.fileno())
        f.close()
        final = self.path(key)
        os.replace(final.with_suffix(".tmp"), final)
        if not self.ledger.arrived(*key):
            final.unlink(missing_ok=True)

    def discard_part(self, key: Key, f: BinaryIO) -> None:
        """A partition cut off before its end (its pair's connection ended)."""
        with contextlib.suppress(OSError):
            f.close()
        self.path(key).with_suffix(".tmp").unlink(missing_ok=True)

    def manifest(
        self,
        query: str,
        batch: int,
        attempts: dict[int, str],
        rows: int,
        nbytes: int,
        checkpoint: str | None = None,
    ) -> Answer:
        before = set(self.ledger.kept)
        answer = self.ledger.manifest(query, batch, attempts, rows, nbytes, checkpoint)
        if answer.have:
            sync_folder(self.batches)  # the partitions' renames, before the ledger names them
            self._persist()  # before the answer leaves: have means staged durably
            self._delete(before - self.ledger.kept)  # the attempts Spark did not keep
        return answer

    # --- the receiving query's calls -------------------------------------------------------

    @property
    def latest(self) -> int:
        return self.ledger.next_seq

    def files(self, start: int, end: int) -> list[tuple[int, list[Path]]]:
        """The staged batches with sequence numbers in ``[start, end)``: (batch, its
        partitions' files in partition order)."""
        return [
            (b.batch, [self.path((b.batch, p, a)) for p, a in sorted(b.attempts.items())])
            for b in self.ledger.between(start, end)
        ]

    def commit(self, end: int) -> None:
        """The receiving query is done with every batch below ``end``: free them."""
        if end <= self.ledger.freed_below:
            return
        gone = self.ledger.commit(end)
        self._persist()
        self._delete(gone)

    def _persist(self) -> None:
        atomic_write(self.dir / LEDGER_NAME, self.ledger.to_json(), mode=0o600, durable=True)

    def _delete(self, keys: set[Key] | list[Key]) -> None:
        for key in keys:
            self.path(key).unlink(missing_ok=True)

    def _drop_unkept(self) -> None:
        """Files the ledger does not keep: written, then the run died before it said so."""
        kept = {self.path(k).name for k in self.ledger.kept}
        for f in self.batches.glob("*.arrow"):
            if f.name not in kept:
                f.unlink(missing_ok=True)
