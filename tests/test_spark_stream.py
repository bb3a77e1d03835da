"""Structured Streaming between two Spark applications, killed and restarted.

A sending application streams Parquet files (a file per micro-batch; event
time and nested columns) into ``writeStream.format("dilation")``; a receiving
one streams ``readStream.format("dilation")`` into Parquet. While rows move,
each application is SIGKILLed (its whole process group: driver, JVM, Python
workers) at a step of Spark's batch phases, and started again with the same
arguments: no new code. At the end the receiver's rows equal the sender's by
an order-independent digest, with every id once.

The kill points are fault points in the product's code
(:mod:`spark_dilation.spark.faults`), each reached once (a marker file):

* the receiving query in its source's ``partitions()``: after Spark wrote the
  micro-batch's offset log entry, before its commit log entry (PySpark 4.0
  then plans ``(L, L)`` on restart);
* the receiving query in its source's ``commit(end)``: after the commit log
  entry, before the source frees the range;
* the sending query in its sink's ``commit(B)`` once the receiving side
  answered "have": the batch is staged there, not in the sender's commit log.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from spark_dilation.spark import faults
from spark_dilation.testing.leftovers import own_temp
from spark_dilation.transfer.machine import alive
from spark_dilation.transfer.meet.record import load_record
from spark_dilation.transfer.send.streamclient import stream_host_path

PEER = [sys.executable, "-m", "spark_dilation.testing.stream_peer"]
ROWS = int(os.environ.get("SPARK_DILATION_STREAM_ROWS", "200000"))
FILES = 24
MAX_ROWS = 2 * ROWS // FILES + 1  # maxRecordsPerTrigger: two sent micro-batches a trigger
# Each sent micro-batch's commit starts a fresh Python worker, which Spark gives a
# fixed 10 s to connect back ("Python worker failed to connect back"); two of
# these two-application tests at once on 2 cores came near it. One worker runs
# them (and the stream notebook's) in turn.
STREAM_GROUP = "spark_stream"
pytestmark = pytest.mark.xdist_group(STREAM_GROUP)


class App:
    """One stream_peer application in a process group of its own (to kill it whole)."""

    def __init__(self, side: str, folder: Path, *args: str, fault: str = "") -> None:
        self.side, self.folder, self.args, self.fault = side, folder, args, fault
        self.log = folder / f"{side}.log"
        # Killed with -9 (no clean-up): its temp files in the test's folder, not the run's.
        (folder / "tmp").mkdir(exist_ok=True)
        env = {**os.environ, **own_temp(folder / "tmp"), "PYSPARK_PYTHON": sys.executable}
        if fault:
            env[faults.FAULTS_ENV] = fault
        with self.log.open("a") as log, (folder / f"{side}.out").open("w") as out:
            self.proc = subprocess.Popen(
                [*PEER, side, *args],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=log,
                start_new_session=True,
                env=env,
            )

    def again(self) -> App:
        """The same application started again (its fault points fired once already)."""
        return App(self.side, self.folder, *self.args, fault=self.fault)

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def result(self, timeout: float) -> dict[str, Any]:
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"the {self.side} application did not end in {timeout:g} s: {self.log}")
        lines = (self.folder / f"{self.side}.out").read_text().splitlines()
        assert lines, f"the {self.side} application printed nothing: {self.log}"
        return json.loads(lines[-1])


def receive_args(common: list[str], folder: Path, rows: int, *more: str) -> list[str]:
    """A receiving application's arguments: its output, checkpoint and pairing in ``folder``."""
    return [
        *common,
        *("--out", str(folder / "out"), "--checkpoint", str(folder / "r-ck")),
        *("--pairing", str(folder / "r-pairing"), "--rows", str(rows), *more),
    ]


def send_args(common: list[str], folder: Path, rows: int, files: int) -> list[str]:
    """A sending application's arguments: it streams ``rows`` rows in ``files`` Parquet
    files, which its first run generates in ``folder / "src"`` (in its own session: no
    application of its own for the input) and reports as ``expected``."""
    return [
        *common,
        *("--source", str(folder / "src"), "--rows", str(rows), "--files", str(files)),
        *("--checkpoint", str(folder / "s-ck"), "--pairing", str(folder / "s-pairing")),
    ]


def fault(folder: Path, *points: tuple[str, int]) -> str:
    """``SPARK_DILATION_FAULTS`` for these points, each once (its marker in ``folder``)."""
    return ";".join(f"{point}@{n}={folder / f'{point}.fired'}" for point, n in points)


def run_through_kills(apps: list[App], kills: int, timeout: float) -> list[App]:
    """Until every app has ended: one killed at its fault point (-9) starts again."""
    deadline, killed = time.monotonic() + timeout, 0
    while any(app.proc.poll() is None for app in apps):
        for i, app in enumerate(apps):
            if app.proc.poll() == -signal.SIGKILL:
                killed += 1
                apps[i] = app.again()
        if time.monotonic() > deadline:
            for app in apps:
                app.kill()
            pytest.fail(f"the applications did not end within {timeout:g} s")
        time.sleep(0.5)
    assert killed == kills, f"{killed} kills, {kills} planned"
    return apps


def stream_host_ends(pairing: Path, within: float = 10.0) -> None:
    """The sending side's stream host ends within seconds of its application (the last
    one a dying application launched included), and its folder in $TMPDIR goes with
    it: nothing is left running or in the temp folder."""
    folder = stream_host_path(pairing, str(pairing.parent / "tmp"))  # App's temp folder
    deadline = time.monotonic() + within
    while True:
        try:
            pid = int((folder / "host.pid").read_text())
        except (OSError, ValueError):
            pid = None  # the host removed its pid file on its way out
        if (pid is None or not alive(pid)) and not folder.exists():
            return
        assert time.monotonic() < deadline, (
            f"stream host {pid} still runs {within:g} s on"
            if pid is not None and alive(pid)
            else f"its folder {folder} is still there: {sorted(p.name for p in folder.iterdir())}"
        )
        time.sleep(0.2)


def admission_control() -> bool:
    """Whether this PySpark gives Python sources read limits (4.2+)."""
    from spark_dilation.spark.stream import SupportsTriggerAvailableNow

    return SupportsTriggerAvailableNow is not None


@pytest.mark.timeout(900)
def test_stream_survives_kills_at_each_batch_phase_exactly_once(
    mailbox_url: str, relay_url: str, tmp_path: Path
) -> None:
    code = "41-stream-restarts"
    common = ["--code", code, "--mailbox", mailbox_url, "--relay", relay_url]

    r_pairing, s_pairing = tmp_path / "r-pairing", tmp_path / "s-pairing"
    receive = receive_args(common, tmp_path, ROWS, "--max-rows", str(MAX_ROWS))
    send = send_args(common, tmp_path, ROWS, FILES)
    # Offsets count staged micro-batches; the sink's points count Spark's batch ids.
    receiver_faults = fault(tmp_path, (faults.SOURCE_PLANNED, 3), (faults.SOURCE_COMMIT, 9))
    sender_faults = fault(tmp_path, (faults.SINK_STAGED, 14))
    apps = [
        App("receive", tmp_path, *receive, fault=receiver_faults),
        App("send", tmp_path, *send, fault=sender_faults),
    ]
    receiver, sender = run_through_kills(apps, kills=3, timeout=700)
    for point in (faults.SOURCE_PLANNED, faults.SOURCE_COMMIT, faults.SINK_STAGED):
        assert (tmp_path / f"{point}.fired").exists(), point

    sent, got = sender.result(10), receiver.result(10)
    # The sending application's end reached the receiving one, which said so.
    said = "the sending run ended; the stream waits for its next run"
    assert said in (tmp_path / "receive.log").read_text(errors="replace")
    assert "error" not in sent, sent
    assert "error" not in got, got
    assert got["rows"] == ROWS and got["distinct_ids"] == ROWS, got
    assert sent["expected"]["rows"] == ROWS and got["digest"] == sent["expected"]["digest"]
    if admission_control():
        assert 0 < got["largest_batch"] <= MAX_ROWS, got  # whole batches, under the limit
    # Restarts met with no code: each side's runs counted on its record.
    assert load_record(r_pairing / "pairing.json").incarnation == 3
    assert load_record(s_pairing / "pairing.json").incarnation == 2

    # The sending query's columns changed on the same pairing: refused, naming them.
    changed = App("send-changed", tmp_path, *send).result(300)["errors"]
    assert "no longer writes s; adds text" in changed["renamed"], changed
    assert "adds extra: its stream was paired with columns id, i" in changed["added"], changed

    # The sending checkpoint deleted and made again at the same path: a new Spark query,
    # whose batch ids start at 0 again. Both queries fail saying so; nothing is dropped.
    shutil.rmtree(tmp_path / "s-ck")
    receiver = App("receive", tmp_path, *receive)
    sent = App("send", tmp_path, *send).result(300)
    got = receiver.result(300)
    reset = f"checkpoint at {tmp_path / 's-ck'} was reset or rolled back"
    assert reset in sent.get("error", ""), sent
    assert reset in got.get("error", ""), got
    assert "read every micro-batch staged before" in got["error"], got

    # The receiving side revokes the pairing: neither side can resume, each says why.
    revoke = subprocess.run(
        [
            sys.executable,
            "-m",
            "spark_dilation.cli",
            "revoke",
            str(r_pairing),
            "--reason",
            "rotating keys",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert revoke.returncode == 0, revoke.stderr
    assert "revoked stream" in revoke.stdout and "new code" in revoke.stdout
    shutil.rmtree(tmp_path / "s-ck")
    sender = App("send", tmp_path, *send)
    receiver = App("receive", tmp_path, *receive)
    sent, got = sender.result(300), receiver.result(300)
    assert "the receiver revoked this stream's pairing: rotating keys" in sent["error"], sent
    assert "revoked (rotating keys)" in got["error"], got
    assert "read every micro-batch staged before" in got["error"], got
    stream_host_ends(s_pairing)


@pytest.mark.timeout(600)
def test_a_small_stream_arrives_exactly(mailbox_url: str, relay_url: str, tmp_path: Path) -> None:
    """The sink and the source on whatever PySpark runs (`make test-oldest`: 4.0, where
    the sink's tasks get Rows and Spark gives the source no read limit)."""
    common = ["--code", "42-stream-small", "--mailbox", mailbox_url, "--relay", relay_url]
    receiver = App("receive", tmp_path, *receive_args(common, tmp_path, 6000))
    sent = App("send", tmp_path, *send_args(common, tmp_path, 6000, 3)).result(300)
    got = receiver.result(300)
    assert "error" not in sent and "error" not in got, (sent, got)
    assert sent["batches"] == 3
    assert got["rows"] == got["distinct_ids"] == 6000
    assert got["digest"] == sent["expected"]["digest"]


@pytest.mark.timeout(600)
def test_available_now_reads_what_is_staged_then_ends(
    mailbox_url: str, relay_url: str, tmp_path: Path
) -> None:
    """PySpark 4.2+: a receiving query that reads one sent batch a trigger, every 30 s,
    falls behind the sender (the sender stages all 3 long before its second trigger,
    whose progress shows the lag) and stops; one with Trigger.AvailableNow reads the
    rest and ends by itself."""
    common = ["--code", "43-stream-now", "--mailbox", mailbox_url, "--relay", relay_url]
    receive = receive_args(common, tmp_path, 6000)
    slow = App(
        "receive",
        tmp_path,
        *receive,
        *("--max-rows", "1", "--stop-when-staged", "3", "--trigger-seconds", "30"),
    )
    sent = App("send", tmp_path, *send_args(common, tmp_path, 6000, 3)).result(300)
    behind = slow.result(300)
    assert "error" not in sent and "error" not in behind, (sent, behind)
    assert behind["rows"] < 6000, behind  # one batch a trigger: it fell behind
    assert behind["largest_lag"] > 0, behind  # and its progress showed the lag
    now = App("receive", tmp_path, *receive, "--available-now").result(300)
    assert "error" not in now, now
    assert now["rows"] == now["distinct_ids"] == 6000
    assert now["digest"] == sent["expected"]["digest"]


@pytest.mark.timeout(600)
def test_the_guide_examples_on_the_sink_and_the_source(
    mailbox_url: str, relay_url: str, tmp_path: Path
) -> None:
    """Spark's Structured Streaming guide, on both sides: named queries, checkpoints
    from ``spark.sql.streaming.checkpointLocation``, Trigger.Once and processing-time
    triggers, output modes, ``foreachBatch`` downstream, stop and restart; a continuous
    trigger and the complete and update modes refused at start with a reason."""
    common = ["--code", "44-stream-guide", "--mailbox", mailbox_url, "--relay", relay_url]
    common += ["--sync", str(tmp_path)]
    receiver = App(
        "guide-receive",
        tmp_path,
        *common,
        *("--out", str(tmp_path / "out"), "--checkpoint", str(tmp_path / "r-ck")),
        *("--pairing", str(tmp_path / "r-pairing"), "--rows", "8000", "--first-rows", "4000"),
    )
    sender = App(
        "guide-send",
        tmp_path,
        *common,
        *("--rows", "8000", "--files", "4", "--checkpoint", str(tmp_path / "s-ck")),
        *("--pairing", str(tmp_path / "s-pairing")),
    )
    sent, got = sender.result(500), receiver.result(500)
    assert "error" not in sent and "error" not in got, (sent, got)
    assert 'appended rows only: outputMode("complete")' in sent["complete"], sent
    assert "does not support Update mode" in sent["update"], sent
    assert sent["once_batches"] == 1 and sent["batches"] >= 3, sent  # Once, then the rest
    # The named queries' checkpoints are the conf's, under their names.
    assert (tmp_path / "s-ck" / "orders_out" / "commits").is_dir()
    assert (tmp_path / "r-ck" / "orders_in" / "commits").is_dir()
    assert got["first_rows"] >= 4000 and got["rows"] == got["distinct_ids"] == 8000, got
    assert got["digest"] == sent["digest"]
    ids = got["batch_ids"]
    assert ids == sorted(set(ids)), ids  # foreachBatch saw each batch id once, in order
    assert 0 < got["restarted_from"] < len(ids), got  # the restart went on from its checkpoint
    assert got["once_batches"] == 0 and got["once_error"] == "", got  # nothing new: it ends
    assert "does not support continuous processing" in got["continuous"], got
    stream_host_ends(tmp_path / "s-pairing")
