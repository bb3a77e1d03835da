"""What every process of a transfer needs, after the session: small and picklable."""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property

import pyarrow as pa

from .options import TransferOptions
from .protocol import schema_fingerprint, schema_from_bytes


@dataclass(frozen=True)
class TransferSpec:
    """Derived from the session over the human code; travels inside pickled readers/writers.

    Nothing in it lets anyone reach the other side without the mailbox, and
    the secret never leaves the two clusters (it is derived by both sides,
    never sent).
    """

    transfer_id: str
    secret: bytes
    lanes: int
    schema_ipc: bytes
    compression: str
    options: TransferOptions
    # The reading application's lane registry (addresses, port), set by
    # ``load()``; None: lanes hold their own staging only (the Python API).
    registry: tuple[tuple[str, ...], int] | None = None
    # Rows the sender announced in its offer (None: it did not know), for the
    # receiver's progress (percent and ETA).
    total_rows: int | None = None
    # Partition formats besides Arrow IPC the receiver decodes (its answer's
    # "formats"; empty for an older receiver): see transfer/pqformat.py.
    formats: tuple[str, ...] = ()
    # The writing end's sender hub (addresses, port) for the writing cluster's
    # other sending processes (transfer/hub.py); None where one process sends.
    hub: tuple[tuple[str, ...], int] | None = None
    # Both ends agreed to meet in an appid derived from the secret (protocol.DOORS_PRIVATE);
    # False: the public RENDEZVOUS_APPID (a peer that did not say it).
    private_doors: bool = False

    def with_hub(self, addresses: tuple[str, ...], port: int) -> TransferSpec:
        return replace(self, hub=(tuple(addresses), port))

    def with_registry(self, addresses: tuple[str, ...], port: int) -> TransferSpec:
        return replace(self, registry=(tuple(addresses), port))

    @cached_property
    def parquet_ok(self) -> bool:
        """Whether partitions may go as Parquet frames (the receiver decodes them, and the
        schema round-trips exactly)."""
        from . import pqformat

        return pqformat.FORMAT in self.formats and pqformat.supports(self.schema)

    def parquet_refused(self) -> str:
        """Why partitions may not go as Parquet frames ("" when they may)."""
        from . import pqformat

        if pqformat.FORMAT not in self.formats:
            return "the receiver does not decode Parquet frames (an older version)"
        column = pqformat.unsupported(self.schema)
        return f"column {column} would not round-trip exactly through Parquet" if column else ""

    @cached_property
    def schema(self) -> pa.Schema:
        return schema_from_bytes(self.schema_ipc)

    @cached_property
    def fingerprint(self) -> str:
        return schema_fingerprint(self.schema)

    def __getstate__(self) -> dict:
        # cached_property values are rebuilt after unpickling.
        return {
            k: v
            for k, v in self.__dict__.items()
            if k not in ("schema", "fingerprint", "parquet_ok")
        }

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
