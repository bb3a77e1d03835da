"""Spark dataset transfers end to end: real Spark, real mailbox server and relay.

A Spark application per side needs its own process: the ``spark_peer``
helper runs one side with ``subprocess``; the other side is that helper
again, this process's session-scoped ``local[2]`` session, or the Python API.
Cases that need only some kind of application (``local[2,2]``, where a task may
fail once; a local cluster) share long-lived ones (``stepped_writer``), which
serve one case after another, a failed one included.
Every test compares content, never only counts.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from spark_dilation.spark.dataset import REPORT_PREFIX
from spark_dilation.testing import TcpProxy
from spark_dilation.testing.leftovers import helper_processes
from spark_dilation.testing.peer_process import PeerProcess, transfer_report
from spark_dilation.testing.stepped_reader import SteppedReader
from spark_dilation.testing.stepped_writer import SteppedWriter
from spark_dilation.testing.waiting import wait_until
from spark_dilation.transfer import receive_dataset, send_in_background


def peer(side: str, code: str, servers: Any, tmp: Path, *args: str) -> PeerProcess:
    """One spark_peer process; its stderr goes to a file (Spark is chatty)."""
    return PeerProcess(
        side, code, servers.mailbox_url, servers.relay_url, tmp / f"{side}-{code}.stderr", *args
    )


def read_parquet(path: Path | str) -> pa.Table:
    return ds.dataset(str(path)).to_table().sort_by("id")


def assert_same_rows(python_written: Path, spark_written: Path) -> None:
    """Parquet from the Python API equals Parquet Spark wrote, row for row."""
    received, expected = read_parquet(python_written), read_parquet(spark_written)
    # Spark writes timestamps as INT96 (read back as zone-less ns); we keep UTC us.
    assert str(expected.schema.field("ts").type) == "timestamp[ns]"
    assert received.num_rows == expected.num_rows
    assert received.equals(expected.cast(received.schema))


def staging(tmp: Path) -> str:
    return f"staging_dir={tmp / 'staging'}"


def _start_app(argv: list[str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip


@contextlib.contextmanager
def _stepped(servers: Any, folder: Path, master: str, executors: int = 0) -> Iterator[Any]:
    """A long-lived ``stepped_writer`` application on ``master``, stopped at the end."""
    app = SteppedWriter(
        _start_app, folder / "control", folder / "app.log", mailbox=servers.mailbox_url,
        relay=servers.relay_url, master=master, executors=executors,
    )  # fmt: skip
    with app.running():
        yield app


@pytest.fixture(scope="module")
def local22(wormhole_servers: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """One ``local[2,2]`` application (a task may fail once) for the xdist group
    "local22": a retried sender task, a lane that fails before and after its rows."""
    with _stepped(wormhole_servers, tmp_path_factory.mktemp("local22"), "local[2,2]") as app:
        yield app


@pytest.fixture(scope="module")
def local_clusters(
    wormhole_servers: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Any, Any]]:
    """A writing and a reading ``local-cluster[2,1,1024]`` application (two executors
    each, both registered before the first case) for the xdist group "local_clusters"."""
    folder = tmp_path_factory.mktemp("local-clusters")
    cluster = "local-cluster[2,1,1024]"
    with (
        _stepped(wormhole_servers, folder / "writer", cluster, executors=2) as writer,
        _stepped(wormhole_servers, folder / "reader", cluster, executors=2) as reader,
    ):
        yield writer, reader


def _step_report(app: Any, since: int) -> dict[str, Any]:
    """The transfer report the app's ``commit()`` logged after byte ``since`` of its log
    (a Python worker's stderr reaches the JVM's on a thread of its own: a moment later)."""
    wait_until("the writer's transfer report", lambda: REPORT_PREFIX in app.logged(since), 15)
    return transfer_report(app.logged(since), app.log)


# --- Spark to Spark ----------------------------------------------------------------------


def test_spark_to_spark_all_types_exact(spark: Any, wormhole_servers: Any, tmp_path: Path) -> None:
    """200k rows of every common type and nulls (four partitions of several Arrow batches
    each); content, schema and nullability equal. The reading application is this
    process's session."""
    code = "80211-spark-to-spark"
    sender = peer(
        "send", code, wormhole_servers, tmp_path, "--rows", "200000", "--partitions", "4",
        "--expected", str(tmp_path / "expected"),
    )  # fmt: skip
    df = _load(spark, code, wormhole_servers, tmp_path)
    df.show(3, truncate=40)
    count = df.count()  # after show(): the second action reads staging
    df.write.mode("overwrite").parquet(str(tmp_path / "out"))
    sent = sender.result()
    assert "error" not in sent, sent
    # Spark's own schemas, field by field: names, types, nullability (nested too).
    assert json.loads(df.schema.json()) == json.loads(sent["schema"])
    assert count == 200_000
    expected, received = read_parquet(tmp_path / "expected"), read_parquet(tmp_path / "out")
    assert received.num_rows == 200_000
    assert received.equals(expected)
    report = sender.report()
    assert report["rows"] == 200_000 and report["partitions"] == 4 and report["lanes"] == 2
    # The tasks and the commit handed everything to the sender host (sender_host
    # defaults to true), whose one connection per lane carried every partition.
    assert report["connections"] == report["lanes"], report


@pytest.mark.parametrize("sender_host", ["true", "false"])
@pytest.mark.xdist_group("local_clusters")
def test_local_clusters_share_connections(
    local_clusters: tuple[Any, Any], tmp_path: Path, sender_host: str
) -> None:
    """Two executors per side: fewer Dilation connections than partitions."""
    code = f"80212-local-cluster-{sender_host}"
    writer, reader = local_clusters
    logged = writer.log_size()
    reader.receive(code, tmp_path / "out", lanes="2", staging_dir=str(tmp_path / "staging"))
    writer.send(
        code, rows=60000, partitions=12, shape="rich", expected=tmp_path / "expected",
        sender_host=sender_host,
    )  # fmt: skip
    sent, got = writer.result(), reader.result()
    assert "error" not in sent, sent
    assert "error" not in got, got
    assert read_parquet(tmp_path / "out").equals(read_parquet(tmp_path / "expected"))
    report = _step_report(writer, logged)
    assert report["partitions"] == 12
    if sender_host == "true":
        # Both executors run on this machine: their tasks and the commit used the
        # sender host started by save(), one connection per lane in all.
        assert report["connections"] == report["lanes"] == 2, report
        return
    # Each sending Python worker keeps one connection per lane it sent to and
    # reuses it (one worker per executor: 2 to 4 in all, depending on which
    # partitions Spark hands each), and the commit opens one per lane for the
    # manifest (2); a worker Spark replaced would add its own.
    assert 4 <= report["connections"] < report["partitions"], report


# --- Python API and Spark -------------------------------------------------------------------


def _options(servers: Any, tmp: Path, **extra: Any) -> dict[str, Any]:
    return {
        "mailbox": servers.mailbox_url,
        "relay": servers.relay_url,
        "staging_dir": str(tmp / "staging"),
        **extra,
    }


def _load(spark: Any, code: str, servers: Any, tmp: Path, **extra: Any) -> Any:
    return (
        spark.read.format("dilation")
        .option("code", code)
        .options(**{k: str(v) for k, v in _options(servers, tmp, **extra).items()})
        .load()
    )


def _rows(df: Any) -> pa.Table:
    return pa.Table.from_batches(df._collect_as_arrow()).sort_by("id")


def test_python_table_and_parquet_into_spark(spark: Any, wormhole_servers: Any, tmp_path: Path):
    table = pa.table(
        {
            "id": pa.array(range(50_000), pa.int64()),
            "name": pa.array([None if i % 9 == 0 else f"n{i}" for i in range(50_000)]),
            "score": pa.array([i / 4 for i in range(50_000)]),
        }
    )
    sender, thread, box = send_in_background(table, **_options(wormhole_servers, tmp_path))
    df = _load(spark, sender.code, wormhole_servers, tmp_path)
    df.show(2)
    assert df.count() == 50_000  # show() then count() on the same DataFrame
    assert _rows(df).equals(table)
    thread.join(60)
    assert box["report"].rows == 50_000, box

    path = tmp_path / "data.parquet"
    pq.write_table(table, path, row_group_size=10_000)
    sender, thread, box = send_in_background(path, **_options(wormhole_servers, tmp_path))
    df = _load(spark, sender.code, wormhole_servers, tmp_path, lanes=2)
    assert _rows(df).equals(table)
    thread.join(60)
    assert "error" not in box, box


def test_spark_writer_into_python_parquet(wormhole_servers: Any, tmp_path: Path) -> None:
    code = "80213-spark-to-python"
    # With spark_dilation.tune(spark): Spark hands the tasks its batches without
    # the byte cap (no per-row size check), and every row still arrives.
    sender = peer(
        "send", code, wormhole_servers, tmp_path, "--rows", "100000", "--partitions", "3",
        "--expected", str(tmp_path / "expected"), "--tune",
    )  # fmt: skip
    got = receive_dataset(code, tmp_path / "out", **_options(wormhole_servers, tmp_path))
    sent = sender.result()
    assert "error" not in sent
    assert sent["tuned"] == {"spark.sql.execution.arrow.maxBytesPerBatch": "2147483647"}, sent
    assert len(got.files) == 3 and got.report.rows == 100_000
    assert_same_rows(tmp_path / "out", tmp_path / "expected")
    # compression=auto (the default) through the sender host: the report says what
    # the tasks chose; on this direct loopback path, nothing.
    prefix = "spark-dilation transfer report: "
    lines = (tmp_path / f"send-{code}.stderr").read_text().splitlines()
    report = json.loads(next(x for x in lines if x.startswith(prefix))[len(prefix) :])
    assert report["compression"] == "auto", report
    if report["path"] == "direct":
        assert report["compression_detail"].startswith("none for 3 of 3 partitions"), report


def test_reference_wormhole_send_loads_without_accept(
    spark: Any, wormhole_servers: Any, tmp_path: Path
) -> None:
    table = pa.table({"id": pa.array(range(2000)), "v": pa.array([f"v{i}" for i in range(2000)])})
    source = tmp_path / "sent" / "data.parquet"
    source.parent.mkdir()
    pq.write_table(table, source)
    code = "80214-plain-file"
    cli = Path(sys.executable).parent / "wormhole"
    proc = subprocess.Popen(
        [
            str(cli), "--relay-url", wormhole_servers.mailbox_url, "--transit-helper",
            wormhole_servers.relay_url, "send", "--code", code, str(source),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        df = _load(spark, code, wormhole_servers, tmp_path, peer_timeout=60)
        assert _rows(df).equals(table)
        assert df.count() == 2000
        proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0


# --- faults -----------------------------------------------------------------------------------


def test_l2_connection_aborted_repeatedly(wormhole_servers: Any, tmp_path: Path) -> None:
    """Relay-only path through a proxy that resets every connection again and again."""
    proxy = TcpProxy("127.0.0.1", wormhole_servers.relay_port)
    try:
        opts = _options(wormhole_servers, tmp_path, relay=proxy.hint(), no_listen=True)
        opts["compression"] = "none"  # the 160 MB below must cross the proxy as they are
        # 160 MB cross the proxy twice (sender -> relay -> receiver): at 8 MB/s the
        # data would flow for 40 s, however fast the machine, so the transfer cannot
        # end before the four drops (each waits for every lane's connection to come
        # back, seconds on a busy machine); the limit is lifted after the last one.
        proxy.limit_rate(8e6)
        rows = 10_000_000
        table = pa.table(
            {"id": pa.array(range(rows), pa.int64()), "x": pa.array(range(rows), pa.float64())}
        )
        sender, thread, box = send_in_background(table, **opts)
        drops: list[int] = []
        stop = threading.Event()

        def chaos() -> None:
            # Reset the relay connections each time every lane's L2 is up again:
            # each reset hits a selected, busy connection, which must heal.
            from spark_dilation.transfer.receive.lane import lane_connection_statuses

            while len(drops) < 4 and not stop.wait(0.3):
                statuses = lane_connection_statuses()
                if statuses and all(s.connection for s in statuses) and proxy.connection_count:
                    drops.append(proxy.drop_connections())
            proxy.limit_rate(None)

        chaos_thread = threading.Thread(target=chaos, daemon=True)
        chaos_thread.start()
        try:
            got = receive_dataset(sender.code, lanes=2, **opts)
        finally:
            stop.set()
            chaos_thread.join(5)
        thread.join(60)
        assert "error" not in box, box
        assert got.table is not None and got.table.equals(table)
        assert len(drops) == 4, drops
        assert got.report.path == "relay" and box["report"].path == "relay"
        # Reconnects are connections that came back (each drop hits every lane's),
        # counted on both sides, also for connections that ended before the report.
        assert box["report"].reconnects >= 4, box["report"]
        assert got.report.reconnects >= 4, got.report
    finally:
        proxy.close()


@pytest.mark.xdist_group("local22")
def test_sender_task_fails_mid_partition_and_is_retried(
    local22: Any, wormhole_servers: Any, tmp_path: Path
) -> None:
    code = "80215-sender-retry"
    logged = local22.log_size()
    local22.send(
        code, rows=100000, partitions=4, shape="rich", expected=tmp_path / "expected",
        test_fail="sender-mid-partition:2",
    )  # fmt: skip
    got = receive_dataset(code, tmp_path / "out", **_options(wormhole_servers, tmp_path))
    sent = local22.result()
    assert "error" not in sent, sent
    assert "fails mid-partition" in local22.logged(logged)  # the first attempts really failed
    assert got.report.rows == 100_000
    assert_same_rows(tmp_path / "out", tmp_path / "expected")


def _python_sender(servers: Any, tmp: Path, rows: int, **extra: Any) -> tuple[pa.Table, Any]:
    table = pa.table({"id": pa.array(range(rows), pa.int64()), "x": pa.array(range(rows))})
    return table, send_in_background(table, **_options(servers, tmp, **extra))


@pytest.mark.xdist_group("local22")
def test_lane_fails_before_emitting_rows_and_heals(
    local22: Any, wormhole_servers: Any, tmp_path: Path
):
    table, (sender, thread, box) = _python_sender(wormhole_servers, tmp_path, 200_000)
    logged = local22.log_size()
    local22.receive(
        sender.code, tmp_path / "out", staging_dir=str(tmp_path / "staging"),
        test_fail="lane-before-rows",
    )  # fmt: skip
    got = local22.result()
    thread.join(60)
    assert "error" not in got, got
    assert "fails before emitting rows" in local22.logged(logged)
    assert read_parquet(tmp_path / "out").equals(table)
    assert "error" not in box, box


@pytest.mark.xdist_group("local22")
def test_lane_that_fails_after_emitting_rows_cannot_heal(
    local22: Any, wormhole_servers: Any, tmp_path: Path
):
    _table, (sender, thread, box) = _python_sender(
        wormhole_servers, tmp_path, 200_000, lane_start_timeout=60
    )
    local22.receive(
        sender.code, tmp_path / "out", staging_dir=str(tmp_path / "staging"),
        test_fail="lane-after-rows",
    )  # fmt: skip
    got = local22.result()
    thread.join(120)
    assert "cannot heal" in got.get("error", ""), got
    # If the loss came before the manifest, the sender hears it too (the
    # lane's answer to the manifest); if after, the sender had finished.
    assert "error" not in box or "cannot heal" in str(box["error"]), box
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").glob("*.parquet"))


def test_wrong_code_from_spark(spark: Any, wormhole_servers: Any, tmp_path: Path) -> None:
    _table, (sender, thread, box) = _python_sender(wormhole_servers, tmp_path, 10, peer_timeout=30)
    wrong = sender.code.split("-")[0] + "-wrong-guess"
    with pytest.raises(Exception, match="key confirmation failed: the code was mistyped"):
        _load(spark, wrong, wormhole_servers, tmp_path, peer_timeout=30).count()
    thread.join(30)
    assert "key confirmation failed" in str(box.get("error"))


def test_reader_never_comes(spark: Any, wormhole_servers: Any, tmp_path: Path) -> None:
    df = spark.range(10)
    started = time.monotonic()
    with pytest.raises(Exception, match="nobody used the code 80216-nobody-reads within 3 seconds"):
        df.write.format("dilation").options(
            code="80216-nobody-reads", mailbox=wormhole_servers.mailbox_url, peer_timeout="3"
        ).mode("append").save()
    assert time.monotonic() - started < 60


def test_writer_never_comes(spark: Any, wormhole_servers: Any, tmp_path: Path) -> None:
    with pytest.raises(
        Exception,
        match=r"nobody used the code 80217-nobody-writes within 3 seconds.* or raise "
        r'option\("peer_timeout", \.\.\.\)\.',
    ):
        _load(spark, "80217-nobody-writes", wormhole_servers, tmp_path, peer_timeout=3)


@pytest.mark.parametrize(("mode", "shown"), [("ignore", "Ignore"), ("error", "ErrorIfExists")])
def test_unsupported_save_mode(spark: Any, mode: str, shown: str) -> None:
    # Spark refuses these before calling writer(); its message says what to use.
    with pytest.raises(
        Exception,
        match=rf'cannot be written in the "{shown}" mode. Please use either the "Append" or '
        '"Overwrite" mode instead',
    ):
        spark.range(3).write.format("dilation").option("code", "80218-x").mode(mode).save()


def test_more_lanes_than_the_reader_can_run(spark: Any, wormhole_servers: Any, tmp_path: Path):
    """lanes=4 on a 2-slot reader whose lanes start with its tasks (early_lanes=false):
    the lanes no task slot could run are received by the lane registry on the
    driver's machine, so nothing waits for a slot; the read tasks copy them."""
    table, (sender, thread, box) = _python_sender(
        wormhole_servers, tmp_path, 40_000, lane_start_timeout=60
    )
    df = _load(spark, sender.code, wormhole_servers, tmp_path, lanes=4, early_lanes="false")
    assert df.count() == 40_000
    thread.join(60)
    assert "error" not in box, box
    assert box["report"].rows == 40_000
    assert _rows(df).equals(table.cast(_rows(df).schema))


def test_early_lanes_run_more_lanes_than_task_slots(
    spark: Any, wormhole_servers: Any, tmp_path: Path
) -> None:
    """A local-mode reader starts its lanes during load() (early_lanes=auto): lanes=4
    on 2 task slots works, the rows are staged before the first action runs,
    and show() then count() read them."""
    table, (sender, thread, box) = _python_sender(wormhole_servers, tmp_path, 40_000)
    df = _load(spark, sender.code, wormhole_servers, tmp_path, lanes=4)
    thread.join(120)  # the sender finished before any action: the lanes were up
    assert "error" not in box, box
    assert box["report"].rows == 40_000
    staged = sorted(p.name for p in (tmp_path / "staging").rglob("manifest.json"))
    assert staged == ["manifest.json"] * 4
    df.show(2)
    assert df.count() == 40_000
    assert _rows(df).equals(table.cast(_rows(df).schema))


def test_lane_host_killed_mid_transfer_is_replaced_in_seconds(
    wormhole_servers: Any, tmp_path: Path
) -> None:
    """SIGKILL of a lane host while partitions are in flight: the read task starts a
    new one, the sender's pool finds the new incarnation in the lane's lobby a few
    seconds after its connection went down (it would otherwise wait for its
    reconnect_timeout, 300 s here) and sends the partitions in flight again: exact rows."""
    table, (sender, thread, box) = _python_sender(
        wormhole_servers, tmp_path, 200_000, reconnect_timeout=300,
        test_fail="sender-pause:6",
    )  # fmt: skip
    receiver = peer(
        "receive", sender.code, wormhole_servers, tmp_path, "--master", "local[2,2]",
        "--no-show", "--out", str(tmp_path / "out"), "--option", staging(tmp_path),
    )  # fmt: skip
    wait_until(
        "a partition of lane 0 in flight",
        lambda: list((tmp_path / "staging").glob("*/lane-0/.p*.partial")),
        240,
        stop_if=lambda: "the receiver exited" if receiver.proc.poll() is not None else None,
    )
    pid_file = next((tmp_path / "staging").glob("*/lane-0/host.pid"))
    victim = int(pid_file.read_text())
    os.kill(victim, signal.SIGKILL)
    killed = time.monotonic()
    thread.join(200)
    sender_took = time.monotonic() - killed
    got = receiver.result()
    print(f"lane host {victim} killed; the sender ended {sender_took:.1f} s later")
    assert "error" not in box, box
    assert "error" not in got, got
    assert read_parquet(tmp_path / "out").equals(table)
    # Well inside the 300 s reconnect_timeout: the replacement was found by probing.
    assert sender_took < 150, sender_took


def test_staging_deleted_then_another_action_cannot_heal(
    wormhole_servers: Any, tmp_path: Path
) -> None:
    """The reader's staging is deleted under a loaded DataFrame (a temp cleaner, a user):
    the next action fails with "cannot heal" within seconds instead of waiting for a
    sender that has finished; when the application ends nothing of it is left."""
    table, (sender, thread, box) = _python_sender(wormhole_servers, tmp_path, 50_000)
    reader = SteppedReader(
        lambda argv, log: subprocess.Popen(argv, stdout=log.open("wb"), stderr=subprocess.STDOUT),
        tmp_path / "control", tmp_path / "reader.log", code=sender.code,
        mailbox=wormhole_servers.mailbox_url, relay=wormhole_servers.relay_url,
        master="local[2]", options=[staging(tmp_path)],
    )  # fmt: skip
    try:
        assert "error" not in reader.loaded()
        assert reader.step("count")["count"] == table.num_rows
        thread.join(60)
        assert "error" not in box, box
        transfers = [d for d in (tmp_path / "staging").iterdir() if "registry" not in d.name]
        assert len(transfers) == 1, transfers
        shutil.rmtree(transfers[0])
        started = time.monotonic()
        failed = reader.step("count", timeout=300)
        took = time.monotonic() - started
        print(f"the action after the staging was deleted failed in {took:.1f} s: {failed}")
        assert "cannot heal" in failed.get("error", ""), failed
        # The cause named is the deletion, not a lost machine or a killed process.
        assert "machine lost" not in failed["error"], failed
        assert "deleted under its lane host" in failed["error"] or (
            "staged data of partition" in failed["error"]
        ), failed
        assert reader.step("stop")["action"] == "stop"
        assert reader.proc.wait(60) == 0
        wait_until(
            "the application's helper processes to exit",
            lambda: not helper_processes(str(tmp_path)),
            30,
            details=lambda: str(helper_processes(str(tmp_path))),
        )
        assert not list((tmp_path / "staging").iterdir())
    finally:
        reader.proc.kill()
