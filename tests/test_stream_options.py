"""The streaming sink's and source's options and offsets, without Spark running."""

from __future__ import annotations

import threading
from pathlib import Path
from types import SimpleNamespace

import pyarrow as pa
import pytest
from pyspark.sql.types import LongType, StructField, StructType

from spark_dilation.spark.checkpoint import DEFAULT_FS_ENV, default_fs, local_checkpoint
from spark_dilation.spark.datasource import DilationDataSource
from spark_dilation.spark.options import OptionError
from spark_dilation.spark.stream import (
    BatchPart,
    check_schema,
    pairing_dir,
    stream_reader,
    stream_writer,
    streams_home,
)
from spark_dilation.transfer.receive.streamstage import StreamStage
from spark_dilation.transfer.rules.ledger import ReceiverLedger

SCHEMA = pa.schema([("id", pa.int64())])


def test_where_each_side_keeps_its_pairing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SPARK_DILATION_HOME", str(tmp_path / "home"))
    monkeypatch.delenv(DEFAULT_FS_ENV, raising=False)
    monkeypatch.delenv("DATABRICKS_RUNTIME_VERSION", raising=False)
    monkeypatch.delenv("HADOOP_CONF_DIR", raising=False)
    monkeypatch.setenv("SPARK_CONF_DIR", str(tmp_path / "no-conf"))
    ck = str(tmp_path / "ck")
    assert pairing_dir({"checkpointLocation": ck, "code": "7-a"}, "sender") == Path(ck) / "dilation"
    assert pairing_dir({"checkpointlocation": f"file://{ck}"}, "sender") == Path(ck) / "dilation"
    here = pairing_dir({"code": "7-a"}, "receiver")
    conf = pairing_dir({"code": "7-a", "queryname": "q"}, "sender")  # the conf's checkpoint
    assert conf.parent == here.parent == streams_home() == tmp_path / "home" / "streams"
    assert conf.name.endswith("-sender") and here.name.endswith("-receiver")
    assert pairing_dir({"code": "7-b"}, "receiver") != here  # one folder per code
    assert pairing_dir({"pairing_dir": str(tmp_path / "p")}, "receiver") == tmp_path / "p"
    assert pairing_dir({"state_dir": str(tmp_path / "s")}, "sender") == tmp_path / "s"
    with pytest.raises(OptionError, match='option "code" is required to receive a stream'):
        pairing_dir({}, "receiver")
    # A remote checkpoint outlives the driver: the record must too, in a folder named.
    for remote in ("s3a://b/ck", "dbfs:/ck"):
        with pytest.raises(OptionError, match=r'on storage that outlives the driver.*"state_dir"'):
            pairing_dir({"checkpointLocation": remote, "code": "7-a"}, "sender")
    monkeypatch.setenv(DEFAULT_FS_ENV, "hdfs://nn:8020")
    with pytest.raises(OptionError, match="/checkpoints/x is on storage that outlives"):
        pairing_dir({"checkpointLocation": "/checkpoints/x", "code": "7-a"}, "sender")


@pytest.mark.parametrize(
    ("location", "default", "local"),
    [
        ("dbfs:/x", None, None),
        ("s3a://b/x", None, None),
        ("abfss://c@acct.dfs.core.windows.net/x", None, None),
        ("gs://b/x", "file:///", None),
        ("hdfs://nn:8020/x", None, None),
        ("/x", "hdfs://nn:8020", None),  # no scheme: on the default file system
        ("/x", "dbfs:/", None),
        ("/x", None, "/x"),
        ("/x", "file:///", "/x"),
        ("file:/x", "hdfs://nn:8020", "/x"),
        ("file:///x", None, "/x"),
        ("file://localhost/x", None, "/x"),
        ("file://otherhost/x", None, None),
        ("", None, None),
    ],
)
def test_checkpoint_locations_read_as_spark_reads_them(
    location: str, default: str | None, local: str | None
) -> None:
    got = local_checkpoint(location, default)
    assert got == (None if local is None else Path(local))


def test_a_relative_checkpoint_is_the_driver_working_folders(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.chdir(tmp_path)
    assert local_checkpoint("ck/q", None) == tmp_path / "ck" / "q"
    assert local_checkpoint("ck/q", "s3a://b") is None


def test_the_default_file_system_as_a_driver_worker_learns_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    for name in (DEFAULT_FS_ENV, "DATABRICKS_RUNTIME_VERSION", "HADOOP_CONF_DIR", "SPARK_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SPARK_CONF_DIR", str(tmp_path))
    assert default_fs() is None
    (tmp_path / "core-site.xml").write_text(
        "<configuration><property><name>fs.defaultFS</name><value>hdfs://nn:8020</value>"
        "</property></configuration>"
    )
    monkeypatch.setenv("HADOOP_CONF_DIR", str(tmp_path))
    assert default_fs() == "hdfs://nn:8020"
    (tmp_path / "spark-defaults.conf").write_text("spark.hadoop.fs.defaultFS   s3a://lake\n")
    assert default_fs() == "s3a://lake"
    monkeypatch.setenv("DATABRICKS_RUNTIME_VERSION", "17.3")
    assert default_fs() == "dbfs:/"


def test_the_sink_says_what_is_missing_or_unknown(tmp_path: Path) -> None:
    ck = str(tmp_path / "ck")
    with pytest.raises(OptionError, match=r"unknown option lanes for a stream.*known options"):
        stream_writer({"code": "7-a", "checkpointLocation": ck, "lanes": "4"}, SCHEMA)
    with pytest.raises(OptionError, match="required for a stream's first run: no pairing record"):
        stream_writer({"checkpointLocation": ck}, SCHEMA)
    # What Spark itself passes: checkpointLocation, queryName, a start(path)'s path.
    writer = stream_writer(
        {
            "code": "7-a",
            "checkpointLocation": ck,
            "queryName": "q",
            "path": "/p",
            "peer_timeout": "9",
        },
        SCHEMA,
    )
    assert writer.start["peer_timeout"] == 9.0 and writer.start["code"] == "7-a"
    assert writer.checkpoint == ck
    # spark.sql.streaming.checkpointLocation alone: Spark passes no option, the name tells.
    conf = stream_writer(
        {"code": "7-a", "queryname": "q", "state_dir": str(tmp_path / "s")}, SCHEMA
    )
    assert conf.checkpoint == "spark.sql.streaming.checkpointLocation/q"
    (tmp_path / "ck" / "commits").mkdir(parents=True)
    (tmp_path / "ck" / "commits" / "0").write_text("v1")
    with pytest.raises(OptionError, match=r"ran before .* but no pairing record is at"):
        stream_writer({"code": "7-a", "checkpointLocation": ck}, SCHEMA)


def test_a_sink_whose_run_began_with_no_record_refuses_a_later_batch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lost record with a remote checkpoint: told as that, not as an unused code."""
    writer = stream_writer({"code": "7-a", "state_dir": str(tmp_path / "s")}, SCHEMA)
    part = BatchPart(0, "0", 1, b"", "q-1")
    with pytest.raises(OptionError, match=r"at micro-batch 7.*no pairing record.*lost"):
        writer.commit([part], 7)
    writer.commit([], 3)  # no partitions: nothing to send, nothing to refuse
    # A first run whose batch 0 had no partitions: batch 1 may commit before it paired.
    writer.commit([], 0)
    delivered = []
    monkeypatch.setattr(
        "spark_dilation.transfer.send.deliver_batch", lambda *a: delivered.append(a) or 0
    )
    writer.commit([part], 1)
    assert [a[2]["batch"] for a in delivered] == [1]
    assert delivered[0][2]["query"] == "q-1"


def test_complete_mode_is_refused_at_start() -> None:
    source = DilationDataSource({"code": "7-a"})
    with pytest.raises(OptionError, match=r'appended rows only: outputMode\("complete"\)'):
        source.streamWriter(StructType([StructField("id", LongType())]), True)


def test_a_schema_other_than_the_paired_one_is_refused_naming_the_columns() -> None:
    paired = pa.schema([("id", pa.int64()), ("name", pa.string()), ("v", pa.float64())])
    check_schema(paired, paired, Path("r"))
    renamed = pa.schema([("id", pa.int64()), ("label", pa.string()), ("v", pa.float64())])
    with pytest.raises(OptionError, match="no longer writes name; adds label: its stream was"):
        check_schema(paired, renamed, Path("r"))
    added = pa.schema([*paired, ("extra", pa.int32())])
    with pytest.raises(OptionError, match=r"adds extra: .*paired with columns id, name, v"):
        check_schema(paired, added, Path("r"))
    retyped = pa.schema([("id", pa.string()), ("name", pa.string()), ("v", pa.float64())])
    with pytest.raises(OptionError, match=r"changes the type of id \(int64 -> string\)"):
        check_schema(paired, retyped, Path("r"))
    reordered = pa.schema([("name", pa.string()), ("id", pa.int64()), ("v", pa.float64())])
    with pytest.raises(OptionError, match="orders its columns name, id, v"):
        check_schema(paired, reordered, Path("r"))


def test_planning_frees_nothing_on_a_real_stage(tmp_path: Path) -> None:
    """The source's partitions() on PySpark 4.0's restart: (L, L), then the range again."""
    stage = StreamStage(tmp_path)
    for batch in range(3):
        f = stage.open_part((batch, 0, "0"))
        f.write(b"rows of %d" % batch)
        stage.close_part((batch, 0, "0"), f)
        stage.manifest("q", batch, {0: "0"}, 1, 1)
    reader = stream_reader({"code": "7-a", "pairing_dir": str(tmp_path)}, SCHEMA)
    reader._receiver = SimpleNamespace(lock=threading.Lock(), stage=stage)
    stage.commit(1)  # the last committed micro-batch read offsets 0-1
    assert reader.partitions({"seq": 3}, {"seq": 3}) == []
    again = [p.value for p in reader.partitions({"seq": 1}, {"seq": 3})]
    assert again == [b"rows of 1", b"rows of 2"]
    assert [p.value for p in reader.partitions({"seq": 1}, {"seq": 3})] == again
    assert stage.ledger.freed_below == 1 and len(list((tmp_path / "batches").iterdir())) == 2


def test_a_revoked_stream_is_read_to_its_end_before_the_query_ends(tmp_path: Path) -> None:
    from spark_dilation.transfer.receive.streamreceiver import StreamReceiver
    from spark_dilation.transfer.rules.pairing import PairingError

    receiver = StreamReceiver(tmp_path / "pairing.json", tmp_path)
    for batch in range(2):
        receiver.stage.manifest("q", batch, {}, 0, 0)
    receiver.ended = PairingError("the sender revoked this stream's pairing: done")
    reader = stream_reader({"code": "7-a", "pairing_dir": str(tmp_path)}, SCHEMA)
    reader._receiver = receiver
    assert reader.latestOffset({"seq": 0}, None) == {"seq": 2}  # what it acknowledged
    with pytest.raises(PairingError, match=r"revoked.*: done; the receiving query read every"):
        reader.latestOffset({"seq": 2}, None)
    receiver.drain = False  # a later run of this side took the stage over: at once
    with pytest.raises(PairingError, match="revoked"):
        reader.latestOffset({"seq": 0}, None)


def _reader(ledger: ReceiverLedger, **options: str) -> object:
    reader = stream_reader({"code": "7-a", "pairing_dir": "/nonexistent", **options}, SCHEMA)
    stage = SimpleNamespace(ledger=ledger)
    reader._receiver = SimpleNamespace(
        latest=lambda: ledger.next_seq,
        lock=threading.Lock(),
        stage=stage,
        finished=lambda position: None,
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


def test_a_receiving_stage_without_its_record_is_told_as_that(tmp_path: Path) -> None:
    """Not as a code nobody uses: the record of a stream that staged batches is lost."""
    from spark_dilation.transfer.rules.pairing import PairingError

    StreamStage(tmp_path).manifest("q", 0, {}, 0, 0)
    source = DilationDataSource({"code": "7-a", "state_dir": str(tmp_path)})
    with pytest.raises(PairingError, match=r"receiving stage is at .* pairing record .* is gone"):
        source.schema()


def test_a_receiving_stream_on_a_cluster_is_told_where_its_state_should_live() -> None:
    from spark_dilation.notebook import warn_driver_state

    def session(master: str) -> object:
        return SimpleNamespace(conf=SimpleNamespace(get=lambda key, default=None: master))

    assert warn_driver_state(session("local[2]"), {}) is None
    with pytest.warns(UserWarning, match=r"driver's disk.*\(spark://m:7077\).*state_dir="):
        assert "Unity Catalog volume" in warn_driver_state(session("spark://m:7077"), {})
    assert warn_driver_state(session("yarn"), {"state_dir": "/Volumes/c/s/v/x"}) is None


def test_the_cluster_master_as_a_driver_worker_learns_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """No Spark conf reaches a driver's Python worker: the runtime, the JVM, spark-defaults."""
    from spark_dilation.spark import locality

    monkeypatch.delenv("DATABRICKS_RUNTIME_VERSION", raising=False)
    monkeypatch.delenv("SPARK_HOME", raising=False)
    monkeypatch.setenv("SPARK_CONF_DIR", str(tmp_path))
    jvm: list[str | None] = [None]
    monkeypatch.setattr(locality, "driver_master", lambda: jvm[0])
    assert locality.cluster_master() is None
    for master, cluster in [
        ("local[2]", None),
        ("local-cluster[2,1,1024]", None),  # one machine: its disk is the cluster's
        ("spark://m:7077", "spark://m:7077"),
        ("yarn", "yarn"),
        ("k8s://h:443", "k8s://h:443"),
    ]:
        jvm[0] = master
        assert locality.cluster_master() == cluster, master
    jvm[0] = None
    (tmp_path / "spark-defaults.conf").write_text("# cluster\nspark.master\tspark://d:7077\n")
    assert locality.cluster_master() == "spark://d:7077"
    jvm[0] = "local[*]"
    assert locality.cluster_master() is None  # the JVM's own master wins
    monkeypatch.setenv("DATABRICKS_RUNTIME_VERSION", "17.3")
    assert locality.cluster_master() == "Databricks"


def test_a_raw_receiving_source_on_a_cluster_logs_where_its_state_should_live(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    """readStream.format("dilation") without receive_stream: a line in the driver log from
    schema(), on a restarted run here (a first run logs it once paired)."""
    import base64

    import spark_dilation.spark.stream as stream
    from spark_dilation.transfer.meet.record import save_record
    from spark_dilation.transfer.rules.pairing import RECEIVER, RECORD_NAME, new_record

    monkeypatch.setattr(stream, "cluster_master", lambda: "spark://m:7077")
    monkeypatch.setenv("SPARK_DILATION_HOME", str(tmp_path))
    folder = pairing_dir({"code": "7-a"}, "receiver")
    folder.mkdir(parents=True)
    schema = base64.b64encode(SCHEMA.serialize().to_pybytes()).decode()
    save_record(folder / RECORD_NAME, new_record(bytes(32), RECEIVER, "ws://m", schema))
    with caplog.at_level("WARNING", logger="spark_dilation.spark.stream"):
        DilationDataSource({"code": "7-a"}).schema()
        DilationDataSource({"code": "7-a", "state_dir": str(folder)}).schema()
        monkeypatch.setattr(stream, "cluster_master", lambda: None)
        DilationDataSource({"code": "7-a"}).schema()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1, lines
    assert "driver's disk" in lines[0] and "(spark://m:7077)" in lines[0]
    assert "state_dir=" in lines[0] and "Unity Catalog volume" in lines[0]
