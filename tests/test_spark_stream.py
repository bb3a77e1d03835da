"""Structured Streaming between two Spark applications, killed and restarted.

A sending application streams Parquet files (a file per micro-batch; event
time and nested columns) into ``writeStream.format("dilation")``; a receiving
one streams ``readStream.format("dilation")`` into Parquet. While rows move,
the receiving application is SIGKILLed (its whole process group: driver JVM,
Python workers) three times and the sending one once, and each is started
again with the same arguments: no new code. At the end the receiver's rows
equal the sender's by an order-independent digest, with every id once.

The kill points are read from the receiving side's ledger (how many
micro-batches it staged), not from timing.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from spark_dilation.transfer.meet.record import load_record

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

    def __init__(self, side: str, folder: Path, *args: str) -> None:
        self.side, self.folder = side, folder
        self.log = folder / f"{side}.log"
        with self.log.open("a") as log, (folder / f"{side}.out").open("w") as out:
            self.proc = subprocess.Popen(
                [*PEER, side, *args],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=log,
                start_new_session=True,
                env={**os.environ, "PYSPARK_PYTHON": sys.executable},
            )

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


def send_args(common: list[str], folder: Path, source: Path) -> list[str]:
    """A sending application's arguments: it streams the files in ``source``."""
    return [
        *common,
        *("--source", str(source), "--checkpoint", str(folder / "s-ck")),
        *("--pairing", str(folder / "s-pairing")),
    ]


def staged(pairing: Path) -> int:
    """How many micro-batches the receiving side staged so far (its durable ledger)."""
    try:
        return json.loads((pairing / "ledger.json").read_text())["next_seq"]
    except (OSError, ValueError):
        return 0


def wait_staged(pairing: Path, at_least: int, apps: list[App], timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while staged(pairing) < at_least:
        for app in apps:
            assert app.proc.poll() is None, f"the {app.side} application ended: {app.log}"
        assert time.monotonic() < deadline, f"{at_least} micro-batches not staged in {timeout} s"
        time.sleep(0.2)


@pytest.mark.timeout(900)
def test_stream_survives_kills_of_both_applications_exactly_once(
    mailbox_url: str, relay_url: str, tmp_path: Path
) -> None:
    code = "41-stream-restarts"
    common = ["--code", code, "--mailbox", mailbox_url, "--relay", relay_url]
    src = tmp_path / "src"
    gen = App("generate", tmp_path, "--rows", str(ROWS), "--files", str(FILES), "--out", str(src))
    expected = gen.result(300)
    assert expected.get("rows") == ROWS, expected

    r_pairing, s_pairing = tmp_path / "r-pairing", tmp_path / "s-pairing"
    receive = receive_args(common, tmp_path, ROWS, "--max-rows", str(MAX_ROWS))
    send = send_args(common, tmp_path, src)
    receiver = App("receive", tmp_path, *receive)
    sender = App("send", tmp_path, *send)

    # The receiving application dies three times, each after more batches arrived.
    for at in (3, 7, 11):
        wait_staged(r_pairing, at, [receiver, sender])
        receiver.kill()
        receiver = App("receive", tmp_path, *receive)
    wait_staged(r_pairing, 15, [receiver, sender])
    sender.kill()
    sender = App("send", tmp_path, *send)

    sent, got = sender.result(600), receiver.result(600)
    # The sending application's end reached the receiving one, which said so.
    said = "the sending run ended; the stream waits for its next run"
    assert said in (tmp_path / "receive.log").read_text(errors="replace")
    assert "error" not in sent, sent
    assert "error" not in got, got
    assert got["rows"] == ROWS and got["distinct_ids"] == ROWS, got
    assert got["digest"] == expected["digest"]
    assert 0 < got["largest_batch"] <= MAX_ROWS, got  # admission control, whole batches
    # Restarts met with no code: each side's runs counted on its record.
    assert load_record(r_pairing / "pairing.json").incarnation == 4
    assert load_record(s_pairing / "pairing.json").incarnation == 2

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
    files = sorted(src.glob("*.parquet"))
    (src / "part-more.parquet").write_bytes(files[0].read_bytes())  # a batch to send
    sender = App("send", tmp_path, *send)
    receiver = App("receive", tmp_path, *receive)
    sent, got = sender.result(300), receiver.result(300)
    assert "the receiver revoked this stream's pairing: rotating keys" in sent["error"], sent
    assert "revoked (rotating keys)" in got["error"], got


@pytest.mark.timeout(600)
def test_a_small_stream_arrives_exactly(mailbox_url: str, relay_url: str, tmp_path: Path) -> None:
    """The sink and the source on whatever PySpark runs (`make test-oldest`: 4.0, where
    the sink's tasks get Rows and Spark gives the source no read limit)."""
    common = ["--code", "42-stream-small", "--mailbox", mailbox_url, "--relay", relay_url]
    src = tmp_path / "src"
    expected = App("generate", tmp_path, "--rows", "6000", "--files", "3", "--out", str(src))
    expected = expected.result(300)
    receiver = App("receive", tmp_path, *receive_args(common, tmp_path, 6000))
    sent = App("send", tmp_path, *send_args(common, tmp_path, src)).result(300)
    got = receiver.result(300)
    assert "error" not in sent and "error" not in got, (sent, got)
    assert sent["batches"] == 3
    assert got["rows"] == got["distinct_ids"] == 6000
    assert got["digest"] == expected["digest"]


@pytest.mark.timeout(600)
def test_available_now_reads_what_is_staged_then_ends(
    mailbox_url: str, relay_url: str, tmp_path: Path
) -> None:
    """PySpark 4.2+: a receiving query that reads one sent batch a trigger, every 30 s,
    falls behind the sender (the sender stages all 3 long before its second trigger,
    whose progress shows the lag) and stops; one with Trigger.AvailableNow reads the
    rest and ends by itself."""
    common = ["--code", "43-stream-now", "--mailbox", mailbox_url, "--relay", relay_url]
    src = tmp_path / "src"
    expected = App("generate", tmp_path, "--rows", "6000", "--files", "3", "--out", str(src))
    expected = expected.result(300)
    receive = receive_args(common, tmp_path, 6000)
    slow = App(
        "receive",
        tmp_path,
        *receive,
        *("--max-rows", "1", "--stop-when-staged", "3", "--trigger-seconds", "30"),
    )
    sent = App("send", tmp_path, *send_args(common, tmp_path, src)).result(300)
    behind = slow.result(300)
    assert "error" not in sent and "error" not in behind, (sent, behind)
    assert behind["rows"] < 6000, behind  # one batch a trigger: it fell behind
    assert behind["largest_lag"] > 0, behind  # and its progress showed the lag
    now = App("receive", tmp_path, *receive, "--available-now").result(300)
    assert "error" not in now, now
    assert now["rows"] == now["distinct_ids"] == 6000
    assert now["digest"] == expected["digest"]
