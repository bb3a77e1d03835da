"""Both progress bars on real terminals, over a relay throttled to 2 MB/s.

Sender and receiver CLIs each run on a pseudo-terminal (so they draw tqdm
bars, as for a user), both ``--no-listen`` so every byte crosses the
throttling proxy. Every chunk each terminal shows is kept with its arrival
time; the test then reads the bars as a user would:

- the sender's first tick is not ahead of what the receiver confirmed (it
  once showed 59 % at the first tick, counting what it had queued);
- the receiver shows an ETA within 3 s of its first rows, and 5 s after
  that its ETA is within 50 % of the time it really took to finish (the
  clock starts at the first rows: meeting and connecting before them take
  what a loaded machine gives, and no rate exists to estimate from);
- the last bar shows the same bytes as the summary line (one byte measure).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from test_cli import OURS, TIMEOUT, child_env

from spark_dilation.testing import throttled_relay
from spark_dilation.testing.datasets import incompressible_parts
from spark_dilation.testing.terminal import Terminal
from spark_dilation.testing.waiting import wait_until

RATE = 2e6  # bytes/s through the relay proxy
PARTS = 4
ROWS = 150_000  # per file: about 5 MB of incompressible rows; 20 MB take about 10 s
CODE_RE = re.compile(r"Wormhole code is: (\S+)")
BAR_RE = re.compile(r"(sending|receiving):\s+(\d+)%\|[^|]*\|\s*([^\[]*)\[([^<\]]+)<([^,\]]+)")
SIZE_RE = re.compile(r"([\d,.]+) (B|kB|MB|GB)\b")


@dataclass
class Tick:
    at: float
    percent: int
    text: str
    elapsed: str
    eta: str

    @property
    def moving(self) -> bool:
        """Whether the bar counts any rows yet ("26.9k/600k", not "0/600k")."""
        done = BAR_RE.search(self.text).group(3).split("/")[0]  # type: ignore[union-attr]
        return float(re.sub(r"[^\d.]", "", done) or 0) > 0

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
    incompressible_parts(folder, PARTS, ROWS, seed=5)
    return folder


@pytest.fixture
def slow_relay(wormhole_servers: Any) -> Iterator[str]:
    with throttled_relay(wormhole_servers.relay_port, RATE) as hint:
        yield hint


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

    # 2. The receiver's ETA: shown within 3 s of its first rows ...
    start = next(t.at for t in got if t.moving)
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
