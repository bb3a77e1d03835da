"""The streaming sink's and source's options and offsets, without Spark running."""

from __future__ import annotations

import threading
from pathlib import Path
from types import SimpleNamespace

import pyarrow as pa
import pytest

from spark_dilation.spark.options import OptionError
from spark_dilation.spark.stream import pairing_dir, stream_reader, stream_writer, streams_home
from spark_dilation.transfer.rules.ledger import ReceiverLedger

SCHEMA = pa.schema([("id", pa.int64())])


def test_where_each_side_keeps_its_pairing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SPARK_DILATION_HOME", str(tmp_path / "home"))
    ck = str(tmp_path / "ck")
    assert pairing_dir({"checkpointLocation": ck, "code": "7-a"}, "sender") == Path(ck) / "dilation"
    assert pairing_dir({"checkpointlocation": f"file://{ck}"}, "sender") == Path(ck) / "dilation"
    remote = pairing_dir({"checkpointlocation": "s3://b/ck", "code": "7-a"}, "sender")
    here = pairing_dir({"code": "7-a"}, "receiver")
    assert remote.parent == here.parent == streams_home() == tmp_path / "home" / "streams"
    assert remote.name.endswith("-sender") and here.name.endswith("-receiver")
    assert pairing_dir({"code": "7-b"}, "receiver") != here  # one folder per code
    assert pairing_dir({"pairing_dir": str(tmp_path / "p")}, "receiver") == tmp_path / "p"
    with pytest.raises(OptionError, match='option "code" is required to receive a stream'):
        pairing_dir({}, "receiver")


def test_the_sink_says_what_is_missing_or_unknown(tmp_path: Path) -> None:
    ck = str(tmp_path / "ck")
    with pytest.raises(OptionError, match='"checkpointLocation" is required'):
        stream_writer({"code": "7-a"}, SCHEMA)
    with pytest.raises(OptionError, match=r"unknown option lanes for a stream.*known options"):
        stream_writer({"code": "7-a", "checkpointLocation": ck, "lanes": "4"}, SCHEMA)
    with pytest.raises(OptionError, match="required for a stream's first run: no pairing record"):
        stream_writer({"checkpointLocation": ck}, SCHEMA)
    writer = stream_writer({"code": "7-a", "checkpointLocation": ck, "peer_timeout": "9"}, SCHEMA)
    assert writer.start["peer_timeout"] == 9.0 and writer.start["code"] == "7-a"
    other = stream_writer({"code": "7-a", "checkpointLocation": ck + "2"}, SCHEMA)
    assert writer.query != other.query  # a new checkpoint is a new sending query
    (tmp_path / "ck" / "commits").mkdir(parents=True)
    (tmp_path / "ck" / "commits" / "0").write_text("v1")
    with pytest.raises(OptionError, match=r"ran before .* but no pairing record is at"):
        stream_writer({"code": "7-a", "checkpointLocation": ck}, SCHEMA)


def _reader(ledger: ReceiverLedger, **options: str) -> object:
    reader = stream_reader({"code": "7-a", "pairing_dir": "/nonexistent", **options}, SCHEMA)
    stage = SimpleNamespace(ledger=ledger)
    reader._receiver = SimpleNamespace(
        latest=lambda: ledger.next_seq, lock=threading.Lock(), stage=stage
    )
    return reader


def test_offsets_follow_the_read_limits_in_whole_batches() -> None:
    from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadMaxBytes, ReadMaxRows

    ledger = ReceiverLedger()
    for batch in range(4):  # four staged batches of 100 rows, 1000 bytes
        ledger.arrived(batch, 0, "0")
        assert ledger.manifest("q", batch, {0: "0"}, rows=100, nbytes=1000).have
    reader = _reader(ledger, maxRecordsPerTrigger="250")
    assert reader.getDefaultReadLimit() == ReadMaxRows(250)
    assert reader.latestOffset({"seq": 0}, ReadMaxRows(250)) == {"seq": 2}
    assert reader.latestOffset({"seq": 0}, ReadMaxRows(1)) == {"seq": 1}  # at least one batch
    # Spark passes one limit; both options apply (maxRecordsPerTrigger too, here).
    assert reader.latestOffset({"seq": 1}, ReadMaxBytes(3000)) == {"seq": 3}
    assert _reader(ledger).latestOffset({"seq": 1}, ReadMaxBytes(2500)) == {"seq": 3}
    assert reader.latestOffset({"seq": 0}, ReadAllAvailable()) == {"seq": 4}
    assert reader.reportLatestOffset() == {"seq": 4}
    # Trigger.AvailableNow: what is staged when it starts, and nothing staged later.
    reader.prepareForTriggerAvailableNow()
    ledger.arrived(4, 0, "0")
    ledger.manifest("q", 4, {0: "0"}, rows=100, nbytes=1000)
    assert reader.latestOffset({"seq": 3}, ReadAllAvailable()) == {"seq": 4}
    with pytest.raises(OptionError, match="maxBytesPerTrigger='0' must be a positive"):
        _reader(ledger, maxBytesPerTrigger="0")
