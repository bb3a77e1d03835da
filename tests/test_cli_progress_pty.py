"""Both progress bars on real terminals, over a relay throttled to 2 MB/s.

Sender and receiver CLIs each run on a pseudo-terminal (so they draw tqdm
bars, as for a user), both ``--no-listen`` so every byte crosses the
throttling proxy. Every chunk each terminal shows is kept with its arrival
time; the test then reads the bars as a user would:

- the sender's first tick is not ahead of what the receiver confirmed (it
  once showed 59 % at the first tick, counting what it had queued);
- the receiver shows an ETA within 3 s of its first bar, and 5 s after that
  its ETA is within 50 % of the time it really took to finish;
- the last bar shows the same bytes as the summary line (one byte measure).
"""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import signal
import struct
import termios
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_cli import OURS, TIMEOUT, child_env

from spark_dilation.testing import TcpProxy
from spark_dilation.testing.waiting import wait_until

RATE = 2e6  # bytes/s through the relay proxy
PARTS = 4
ROWS = 150_000  # per file: about 5 MB of incompressible rows; 20 MB take about 10 s
CODE_RE = re.compile(r"Wormhole code is: (\S+)")
BAR_RE = re.compile(r"(sending|receiving):\s+(\d+)%\|[^|]*\|\s*([^\[]*)\[([^<\]]+)<([^,\]]+)")
SIZE_RE = re.compile(r"([\d,.]+) (B|kB|MB|GB)\b")


@dataclass
class Terminal:
    """A command on a pseudo-terminal; what it shows is kept with arrival times."""

    argv: list[str]
    env: dict[str, str]
    shown: list[tuple[float, str]] = field(default_factory=list)

    def start(self) -> None:
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: the command, its stdio on the terminal
            os.execve(self.argv[0], self.argv, self.env)
        # 160 columns: tqdm draws the whole bar, postfix included.
        fcntl.ioctl(self.fd, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))
        self.status: int | None = None
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while True:
            if not select.select([self.fd], [], [], 0.1)[0]:
                continue
            try:
                chunk = os.read(self.fd, 65536)
            except OSError:  # the child closed the terminal (exited)
                return
            if not chunk:
                return
            self.shown.append((time.monotonic(), chunk.decode(errors="replace")))

    def text(self) -> str:
        return "".join(chunk for _, chunk in self.shown)

    def pieces(self) -> list[tuple[float, str]]:
        """Each line or bar redraw (tqdm redraws a bar after a carriage return), timed."""
        out = []
        for t, chunk in self.shown:
            out += [(t, p) for p in re.split(r"[\r\n]+", chunk) if p.strip()]
        return out

    def wait(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while self.status is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.status = os.waitstatus_to_exitcode(status)
                self._reader.join(5)
                break
            if time.monotonic() > deadline:
                self.kill()
                pytest.fail(f"{self.argv} still running after {timeout:g} s:\n{self.text()}")
            time.sleep(0.05)
        return self.status

    def kill(self) -> None:
        if self.status is None:
            os.kill(self.pid, signal.SIGKILL)
            self.status = os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1])


@dataclass
class Tick:
    at: float
    percent: int
    text: str
    elapsed: str
    eta: str

    @property
    def eta_seconds(self) -> float | None:
        if "?" in self.eta:
            return None
        parts = [int(x) for x in self.eta.strip().split(":")]
        return float(sum(v * 60**i for i, v in enumerate(reversed(parts))))


def ticks(term: Terminal, side: str) -> list[Tick]:
    found = []
    for t, piece in term.pieces():
        m = BAR_RE.search(piece)
        if m and m.group(1) == side:
            found.append(Tick(t, int(m.group(2)), piece, m.group(4), m.group(5)))
    return found


def megabytes(text: str) -> float:
    value, unit = SIZE_RE.search(text).groups()  # type: ignore[union-attr]
    return float(value.replace(",", "")) * {"B": 1e-6, "kB": 1e-3, "MB": 1.0, "GB": 1e3}[unit]


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("bars") / "src"
    folder.mkdir()
    rng = np.random.default_rng(5)
    for part in range(PARTS):
        table = pa.table(
            {
                "id": np.arange(part * ROWS, (part + 1) * ROWS, dtype=np.int64),
                "x": rng.random(ROWS),
                "s": pa.array(rng.integers(0, 2**63, ROWS).astype(str)),
            }
        )
        pq.write_table(table, folder / f"part-{part:05d}.parquet")
    return folder


@pytest.fixture
def slow_relay(wormhole_servers: Any) -> Iterator[str]:
    with TcpProxy("127.0.0.1", wormhole_servers.relay_port) as proxy:
        proxy.limit_rate(RATE)
        yield f"tcp:127.0.0.1:{proxy.port}"


def test_both_bars_tell_the_truth_at_2_mb_per_s(
    mailbox_url: str, slow_relay: str, source: Path, tmp_path: Path
) -> None:
    env = {**child_env(), "TMPDIR": str(tmp_path), "TERM": "xterm", "COLUMNS": "160"}
    common = ["--relay", slow_relay, "--no-listen", "--compression", "none"]
    sender = Terminal([OURS, "--mailbox", mailbox_url, "send", *common, str(source)], env)
    sender.start()
    receiver: Terminal | None = None
    try:

        def code() -> str | None:
            m = CODE_RE.search(sender.text())
            return m.group(1) if m else None

        wait_until("the sender's code", code, TIMEOUT, details=sender.text)
        receiver = Terminal(
            [OURS, "--mailbox", mailbox_url, "receive", "--relay", slow_relay, "--no-listen",
             "-o", str(tmp_path / "out"), str(code())],
            env,
        )  # fmt: skip
        receiver.start()
        assert receiver.wait(TIMEOUT) == 0, receiver.text()
        assert sender.wait(TIMEOUT) == 0, sender.text()
    finally:
        sender.kill()
        if receiver is not None:
            receiver.kill()

    sent, got = ticks(sender, "sending"), ticks(receiver, "receiving")
    assert sent and got, f"no bars:\n{sender.text()}\n{receiver.text()}"
    print(f"sender's first ticks: {[t.percent for t in sent[:5]]}")
    print(f"receiver's first ticks: {[(t.percent, t.eta) for t in got[:8]]}")

    # 1. No first tick ahead of the truth: not over 10 % on either side.
    assert sent[0].percent <= 10, sent[0].text
    assert got[0].percent <= 10, got[0].text

    # 2. The receiver's ETA: shown within 3 s of its first bar ...
    start = got[0].at
    finished = next(t.at for t in got if t.percent == 100)
    first_eta = next((t for t in got if t.eta_seconds is not None), None)
    shown = [(round(t.at - start, 1), t.eta) for t in got]
    assert first_eta is not None and first_eta.at - start <= 3, shown
    # ... and 5 s on, within 50 % of the time the transfer really still took.
    later = next(t for t in got if t.at - start >= 5)
    truth = finished - later.at
    assert truth > 1, "the transfer ended too soon to judge an ETA: make it larger"
    print(f"5 s on the receiver showed ETA {later.eta}; it finished {truth:.1f} s later")
    assert later.eta_seconds is not None
    assert abs(later.eta_seconds - truth) <= 0.5 * truth, (later.eta, truth)

    # 3. One byte measure: the last bar shows the bytes the summary reports (each side).
    sides = ((sender, sent, "Dataset sent: "), (receiver, got, "Dataset received: "))
    for term, bars, prefix in sides:
        summary = next((p for _, p in term.pieces() if p.startswith(prefix)), None)
        assert summary is not None, term.text()
        in_bar = megabytes(bars[-1].text)
        in_summary = megabytes(summary)
        assert abs(in_bar - in_summary) <= 0.1, (bars[-1].text, summary)
