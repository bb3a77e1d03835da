"""Spark Connect: ``format("dilation")`` from a thin client, both directions.

One side is a Spark Connect session (``SparkSession.builder.remote(url)``: a
gRPC client with no ``SparkContext``), the other a classic session; each is its
own ``spark_peer`` process. The Connect clients share one Spark Connect server,
started by ``spark-submit`` for the module (as a cluster runs one), instead of
each starting a local one of its own. The Connect side registers the source with
the explicit ``spark_dilation.register(spark)`` line, as a notebook on Databricks
serverless would.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from test_spark_transfer import peer, read_parquet, staging

from spark_dilation.spark.register import SparkVersionError, check_pyspark, register
from spark_dilation.testing.peer_process import transfer_report
from spark_dilation.testing.waiting import wait_until
from spark_dilation.transfer import receive_table, send_in_background

ROWS = "200000"

# One worker: the module's Connect server serves its tests.
pytestmark = pytest.mark.xdist_group("spark_connect")


@dataclass
class ConnectServer:
    url: str
    log: Path

    def size(self) -> int:
        return self.log.stat().st_size

    def since(self, offset: int) -> str:
        """What the server logged from ``offset`` on."""
        with self.log.open("rb") as f:
            f.seek(offset)
            return f.read().decode(errors="replace")


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


@pytest.fixture(scope="module")
def connect_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ConnectServer]:
    """A Spark Connect server (local[2]) for the module's clients, stopped by SIGTERM
    (Spark's shutdown hook removes its local folders)."""
    import pyspark

    folder = tmp_path_factory.mktemp("connect-server")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    submit = Path(pyspark.__file__).parent / "bin" / "spark-submit"
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable, "SPARK_LOCAL_IP": "127.0.0.1"}
    log = folder / "server.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [str(submit), "--class", "org.apache.spark.sql.connect.service.SparkConnectServer",
             "--master", "local[2]", "--name", "spark-dilation-connect-tests",
             "--conf", f"spark.connect.grpc.binding.port={port}",
             "--conf", "spark.ui.enabled=false", "--conf", "spark.sql.session.timeZone=UTC",
             "--conf", "spark.sql.shuffle.partitions=4", "--conf", "spark.log.level=WARN"],
            stdin=subprocess.DEVNULL, stdout=out, stderr=out, env=env, process_group=0,
            cwd=folder,  # its spark-warehouse, if any
        )  # fmt: skip
    try:
        wait_until(
            "the Spark Connect server to listen",
            lambda: _listening(port) or proc.poll() is not None,
            180,
        )
        assert proc.poll() is None, log.read_text(errors="replace")[-3000:]
        yield ConnectServer(f"sc://127.0.0.1:{port}", log)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                pytest.fail(f"the Connect server ignored SIGTERM for 60 s ({log})")


def test_register_refuses_a_pyspark_without_python_data_sources() -> None:
    with pytest.raises(SparkVersionError, match=r"needs PySpark 4\.0 or later .* PySpark 3\.5\.1"):
        check_pyspark("3.5.1")
    check_pyspark("4.0.0")
    check_pyspark("4.3.0.dev1")


def test_register_on_a_classic_session_is_idempotent(spark: Any) -> None:
    assert register(spark) == "dilation"
    assert register(spark) == "dilation"


def test_register_refuses_a_session_without_a_data_source_registry() -> None:
    class NotASession:
        pass

    with pytest.raises(SparkVersionError, match="no dataSource registry"):
        register(NotASession())


def _check(sent: dict[str, Any], got: dict[str, Any], tmp: Path) -> None:
    assert "error" not in sent, sent
    assert "error" not in got, got
    assert json.loads(got["schema"]) == json.loads(sent["schema"])  # names, types, nullability
    assert got["count"] == int(ROWS)  # count() after show() on the same DataFrame
    expected, received = read_parquet(tmp / "expected"), read_parquet(tmp / "out")
    assert received.num_rows == int(ROWS)
    assert received.equals(expected)  # content, not counts


def test_connect_writer_to_classic_reader(
    wormhole_servers: Any, connect_server: ConnectServer, tmp_path: Path
) -> None:
    code = "80221-connect-to-classic"
    logged = connect_server.size()
    receiver = peer(
        "receive", code, wormhole_servers, tmp_path, "--out", str(tmp_path / "out"),
        "--option", staging(tmp_path),
    )  # fmt: skip
    sender = peer(
        "send", code, wormhole_servers, tmp_path, "--remote", connect_server.url, "--rows", ROWS,
        "--partitions", "4", "--expected", str(tmp_path / "expected"), "--tune",
    )  # fmt: skip
    sent, got = sender.result(), receiver.result()
    assert sent["session"] == "pyspark.sql.connect.session", sent
    # spark_dilation.tune(spark) through Connect's conf API, before the write.
    assert sent["tuned"] == {"spark.sql.execution.arrow.maxBytesPerBatch": "2147483647"}, sent
    assert got["session"] == "pyspark.sql.session", got
    _check(sent, got, tmp_path)
    # commit() ran on the Connect server's driver and logged the report in its log.
    report = transfer_report(connect_server.since(logged), connect_server.log)
    assert report["rows"] == int(ROWS) and report["partitions"] == 4


def test_classic_writer_to_connect_reader(
    wormhole_servers: Any, connect_server: ConnectServer, tmp_path: Path
) -> None:
    code = "80222-classic-to-connect"
    receiver = peer(
        "receive", code, wormhole_servers, tmp_path, "--remote", connect_server.url,
        "--out", str(tmp_path / "out"), "--option", staging(tmp_path),
        # Before the real load: an error raised on the server must reach the
        # client with our message.
        "--probe-option", "lanes=0",
    )  # fmt: skip
    sender = peer(
        "send", code, wormhole_servers, tmp_path, "--rows", ROWS, "--partitions", "4",
        "--expected", str(tmp_path / "expected"),
    )  # fmt: skip
    sent, got = sender.result(), receiver.result()
    assert got["session"] == "pyspark.sql.connect.session", got
    assert "option lanes=0 must be between 1 and 4096" in got["probe_error"], got
    _check(sent, got, tmp_path)
    report = sender.report()  # the classic writer's commit() logged its report
    assert report["rows"] == int(ROWS) and report["partitions"] == 4


# --- the notebook API from a Connect session --------------------------------------

NOTEBOOK = [sys.executable, "-m", "spark_dilation.testing.connect_notebook"]
NB_ROWS = 50_000


def expected_rows(rows: int = NB_ROWS) -> pa.Table:
    ids = list(range(rows))
    return pa.table(
        {
            "id": pa.array(ids, pa.int64()),
            "twice": pa.array([i * 2 for i in ids], pa.int64()),
            "name": pa.array([f"row {i}" for i in ids], pa.string()),
        }
    )


def test_notebook_send_from_a_connect_session(
    wormhole_servers: Any, connect_server: ConnectServer, tmp_path: Path
) -> None:
    """send() returns the code at once (no receiver exists yet); the rows arrive exactly."""
    err = (tmp_path / "send.stderr").open("w")
    proc = subprocess.Popen(
        [*NOTEBOOK, "send", "--remote", connect_server.url,
         "--mailbox", wormhole_servers.mailbox_url, "--relay", wormhole_servers.relay_url,
         "--rows", str(NB_ROWS)],
        stdout=subprocess.PIPE, stderr=err, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        first = json.loads(proc.stdout.readline())  # before anyone received anything
        got = receive_table(
            first["code"],
            mailbox=wormhole_servers.mailbox_url,
            relay=wormhole_servers.relay_url,
            staging_dir=str(tmp_path / "staging"),
        )
        last = json.loads(proc.stdout.readline())
        assert proc.wait(120) == 0, last
    finally:
        if proc.poll() is None:
            proc.kill()
    assert last == {"session": "pyspark.sql.connect.session", "done": True}
    assert got.sort_by("id").equals(expected_rows().cast(got.schema))


def test_notebook_receive_into_a_connect_session(
    wormhole_servers: Any, connect_server: ConnectServer, tmp_path: Path
) -> None:
    table = expected_rows()
    sender, thread, box = send_in_background(
        table, mailbox=wormhole_servers.mailbox_url, relay=wormhole_servers.relay_url
    )
    out = subprocess.run(
        [*NOTEBOOK, "receive", "--remote", connect_server.url,
         "--mailbox", wormhole_servers.mailbox_url,
         "--relay", wormhole_servers.relay_url, "--code", sender.code,
         "--out", str(tmp_path / "out"), "--staging-dir", str(tmp_path / "staging")],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    thread.join(120)
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    assert lines, out.stderr[-3000:]
    got = json.loads(lines[-1])
    assert "error" not in got, got
    assert got["session"] == "pyspark.sql.connect.session"
    assert got["count"] == NB_ROWS  # count() after show() on the same DataFrame
    assert "error" not in box and box["report"].rows == NB_ROWS, box
    received = read_parquet(tmp_path / "out")
    assert received.equals(table.cast(received.schema))
