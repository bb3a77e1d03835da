"""The CLI's progress output on a real reconnect: the relay dies mid-transfer.

``spark-dilation send --json`` and ``spark-dilation receive`` (plain progress:
its stderr is a pipe) run as processes over the relay only (``--no-listen``
on both sides), through a transit relay in a process of its own, reached
through a proxy at 0.5 MB/s (the slow link of issue 30's fault rows). Once rows
are arriving the test stops the relay process, kills it and starts it again
on the same port; Dilation reconnects and the dataset arrives intact. What
the two commands printed must say so: a ``reconnect`` JSON event and count
with the path on the sender, a human reconnect line on the receiver.

Nothing depends on how fast anything happens: the relay is frozen (SIGSTOP)
as soon as the receiver has staged its first bytes, so no more data can move
until it is killed, and the test checks that rows were still to come.
"""

from __future__ import annotations

import os
import re
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_cli import Running, assert_ok, wait_while_running
from test_cli_dataset import json_lines, procs, receive_cmd, send_cmd  # noqa: F401 (procs)
from test_dilation_redial import Restartable

from spark_dilation.testing import TcpProxy
from spark_dilation.testing.datasets import incompressible_parts

PARTS = 4
RATE = 0.5e6  # bytes/s through the relay proxy: the slow link of issue 30's rows
ROWS = 40_000  # per file: 1.4 MB (3 s at RATE), so one partition is far from done at its
# first bytes; the 5.6 MB take about 11 s


@pytest.fixture
def relay() -> Iterator[Restartable]:
    """A transit relay process of its own, to kill and restart on the same port."""
    r = Restartable()
    r.start()
    yield r
    r.kill()


def source(folder: Path) -> list[pa.Table]:
    """PARTS Parquet files (one partition each) of incompressible rows."""
    return incompressible_parts(folder, PARTS, ROWS, seed=7)


def staged(root: Path, pattern: str) -> list[Path]:
    return list(root.glob(f"spark-dilation/*/lane-*/{pattern}"))


def test_relay_killed_mid_transfer_shows_reconnects_in_json_and_plain_output(
    mailbox_url: str,
    relay: Restartable,
    procs: Callable[..., Running],  # noqa: F811 (the fixture imported above)
    tmp_path: Path,
    monkeypatch: Any,
) -> None:
    tables = source(tmp_path / "src")
    # The receiver stages partitions under $TMPDIR/spark-dilation: here, where the test looks.
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))
    # Through a rate-limited proxy, which connects to the relay's port anew each time.
    proxy = TcpProxy("127.0.0.1", relay.relay_port)
    proxy.limit_rate(RATE)
    relay_hint = f"tcp:127.0.0.1:{proxy.port}"
    sender = procs(
        send_cmd(
            mailbox_url,
            relay_hint,
            "--no-listen",
            "--json",
            "--compression",
            "none",
            str(tmp_path / "src"),
        )
    )
    code = sender.wait_for_code()
    receiver = procs(
        receive_cmd(mailbox_url, relay_hint, "--no-listen", code, "-o", str(tmp_path / "out"))
    )

    # Rows are arriving: freeze the relay at once, so nothing more moves until it dies.
    wait_while_running(
        "staged bytes",
        lambda: any(p.stat().st_size > 0 for p in staged(tmp, ".*.partial")),
        sender,
        receiver,
    )
    os.killpg(relay.proc.pid, signal.SIGSTOP)
    complete = staged(tmp, "p*.arrow")
    assert len(complete) < PARTS, "every partition had arrived: the kill would prove nothing"
    relay.kill()  # SIGKILL: its connections are reset, as in a crash
    relay.start()  # the same port: the peers' redials find it again

    try:
        sent, received = sender.finish(), receiver.finish()
    finally:
        proxy.close()
    assert_ok(sent)
    assert_ok(received)

    # (a) the dataset is exact, partition by partition.
    files = sorted((tmp_path / "out").iterdir())
    assert [f.name for f in files] == [f"part-{i:05d}.parquet" for i in range(PARTS)]
    for table, file in zip(tables, files, strict=True):
        assert pq.read_table(file).equals(table), file

    # (b) the sender's --json lines: a reconnect event with its count and path,
    # progress snapshots carrying them, and the final report.
    events = json_lines(sent.stdout)
    reconnects = [e for e in events if e["event"] == "reconnect"]
    assert reconnects, sent.describe()
    assert reconnects[-1]["reconnects"] >= 1 and reconnects[-1]["path"] == "relay", reconnects
    progress = [e for e in events if e["event"] == "progress"]
    assert progress[-1]["done"] and progress[-1]["reconnects"] >= 1, progress[-1]
    assert progress[-1]["path"] == "relay", progress[-1]
    done = events[-1]
    assert done["event"] == "done" and done["rows"] == PARTS * ROWS, sent.describe()
    assert done["reconnects"] >= 1 and done["path"] == "relay", done

    # ... and the receiver's human progress (stderr is not a terminal: event lines only).
    came_back = [
        line
        for line in received.stderr.splitlines()
        if line.startswith("connection dropped and came back (relay): ")
    ]
    assert came_back, received.describe()
    assert re.search(r": [1-9]\d* reconnect\(s\) so far$", came_back[-1]), came_back
    # Both summaries count the reconnects that happened (not "0 reconnect(s)").
    summary = [ln for ln in received.stderr.splitlines() if ln.startswith("Dataset received: ")]
    assert summary and re.search(r"\b[1-9]\d* reconnect\(s\)", summary[-1]), received.describe()


def test_mailbox_lost_for_good_mid_transfer_costs_nothing(
    relay: Restartable,
    procs: Callable[..., Running],  # noqa: F811 (the fixture imported above)
    tmp_path: Path,
    monkeypatch: Any,
) -> None:
    """Once the data connections are up the mailbox is not needed: killed for good
    mid-transfer, both sides still finish, the rows exact, with no traceback."""
    tables = source(tmp_path / "src")
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))
    mailbox = Restartable()  # a mailbox server of its own, to kill (its relay unused)
    mailbox.start()
    # The relay through a rate-limited proxy: the transfer is still under way when it dies.
    proxy = TcpProxy("127.0.0.1", relay.relay_port)
    proxy.limit_rate(RATE)
    try:
        url = f"ws://127.0.0.1:{mailbox.mailbox_port}/v1"
        hint = f"tcp:127.0.0.1:{proxy.port}"
        flags = ("--no-listen", "--compression", "none")
        sender = procs(send_cmd(url, hint, *flags, str(tmp_path / "src")))
        code = sender.wait_for_code()
        receiver = procs(receive_cmd(url, hint, "--no-listen", code, "-o", str(tmp_path / "out")))
        wait_while_running(
            "staged bytes",
            lambda: any(p.stat().st_size > 0 for p in staged(tmp, ".*.partial")),
            sender,
            receiver,
        )
        mailbox.kill()
        assert len(staged(tmp, "p*.arrow")) < PARTS, "every partition had arrived"
        sent = sender.finish()
        received = receiver.finish()
    finally:
        mailbox.kill()
        proxy.close()
    for result in (sent, received):
        assert_ok(result)
        raw = [
            line
            for line in result.stderr.splitlines()
            if line.split(" ", 1)[0] in ("Traceback", "CRITICAL", "ERROR", "WARNING", "INFO")
        ]
        assert raw == [], result.describe()  # no traceback, no raw log line
    files = sorted((tmp_path / "out").iterdir())
    assert [f.name for f in files] == [f"part-{i:05d}.parquet" for i in range(PARTS)]
    for table, file in zip(tables, files, strict=True):
        assert pq.read_table(file).equals(table), file
