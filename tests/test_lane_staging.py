"""The lane's staging folder: once sealed (its owner removes it next), no stream
creates or renames a file in it, so removing it leaves nothing behind (a partition
completing as the reading application ends once left `lane-N/` files after the
removal). A fake channel plays the stream and seals at the moment of the race."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from spark_dilation.errors import TransferError
from spark_dilation.transfer.lane import LaneReceiver
from spark_dilation.transfer.options import TransferOptions
from spark_dilation.transfer.partition import PartitionStream
from spark_dilation.transfer.protocol import TAG_TRAILER, decode_message, schema_bytes
from spark_dilation.transfer.spec import TransferSpec
from spark_dilation.transfer.staging import LaneStaging

TABLE = pa.table({"id": pa.array(range(1000), pa.int64())})


class Channel:
    """A partition stream's subchannel: ``messages`` in order; ``before_trailer`` runs
    just before the trailer is handed over."""

    def __init__(self, messages: list[bytes], before_trailer: Any = None) -> None:
        self._messages = list(messages)
        self._before_trailer = before_trailer
        self.sent: list[bytes] = []

    def receive(self, timeout: float) -> bytes | None:
        if not self._messages:
            return None
        message = self._messages.pop(0)
        if message[:1] == TAG_TRAILER and self._before_trailer is not None:
            self._before_trailer()
        return message

    def send(self, message: bytes, timeout: float | None = None) -> None:
        self.sent.append(message)


def lane(tmp_path: Path) -> tuple[LaneReceiver, LaneStaging, list[bytes]]:
    spec = TransferSpec(
        "cd" * 16, b"s" * 32, 1, schema_bytes(TABLE.schema), "none",
        TransferOptions(staging_dir=str(tmp_path)),
    )  # fmt: skip
    staging = LaneStaging(tmp_path, spec.transfer_id, 0)
    staging.ensure()
    messages = list(PartitionStream(spec, 0, 0).messages(TABLE.to_batches(250)))
    return LaneReceiver(spec, 0, staging, -1), staging, messages


def test_a_partition_completes_into_the_staging(tmp_path: Path) -> None:
    receiver, staging, messages = lane(tmp_path)
    channel = Channel(messages)
    receiver._partition(channel)
    assert [p.name for p in staging.dir.iterdir() if not p.name.startswith(".")] == [
        staging.complete_path(0).name
    ]
    assert decode_message(channel.sent[-1])[1]["rows"] == TABLE.num_rows


def test_a_partition_completing_after_the_seal_is_not_kept(tmp_path: Path) -> None:
    receiver, staging, messages = lane(tmp_path)
    channel = Channel(messages, before_trailer=receiver.seal)
    with pytest.raises(TransferError, match="lane 0 is ending: partition 0 was not kept"):
        receiver._partition(channel)
    assert list(staging.dir.iterdir()) == []  # no complete file, no partial left
    assert channel.sent == []  # never told the sender it has the rows


def test_a_partition_starting_after_the_seal_creates_no_file(tmp_path: Path) -> None:
    receiver, staging, messages = lane(tmp_path)
    receiver.seal()
    with pytest.raises(TransferError, match="was not kept"):
        receiver._partition(Channel(messages))
    assert list(staging.dir.iterdir()) == []
