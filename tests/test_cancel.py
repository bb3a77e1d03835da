"""Ctrl-C, SIGTERM and SIGHUP on either side of a dataset transfer: both sides end and
say why, within the bound docs/transfer.md states, on a 0.5 MB/s link.

The CLI runs as real processes over the real mailbox server and a transit
relay reached through a rate-limited proxy (``--no-listen`` on both sides,
so every byte goes through it). The transfer starts at 16 MB/s, so the
signal lands mid-transfer once the receiver has staged bytes; the proxy is
then cut to 0.5 MB/s, with megabytes queued on the connections (the 8 MB
Dilation queue alone would take 16 s there). The Python API tests do the
same in this process.

An end does not queue behind that data: the ending side tells the other
through the transfer's directory link on the mailbox (see
``transfer/directory.py``), and in-band on its connections as before. Each
side's time to end is taken from the test's own log: when its last line (the
one error or "cancelled" line) arrived, against ``END_BOUND``; the process
exits within ``BOUND`` (a hang fails at ``TIMEOUT``). Before this, the other
side waited out the queued data (8-13 s), or reconnected for ever.
"""

from __future__ import annotations

import _thread
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from test_cli import (
    TIMEOUT,
    Result,
    Running,
    assert_failed,
    child_env,
    ours,
    wait_while_running,
)
from test_cli_dataset import procs, receive_cmd, send_cmd  # noqa: F401 (procs)

from spark_dilation.errors import Interrupted, TransferCancelledError
from spark_dilation.testing import TcpProxy
from spark_dilation.testing.datasets import incompressible_parts
from spark_dilation.testing.terminal import Terminal
from spark_dilation.testing.waiting import wait_until
from spark_dilation.transfer import TransferOptions, receive_dataset
from spark_dilation.transfer.api import DatasetSender
from spark_dilation.transfer.rules.errors import TransferAbortedError

pytestmark = pytest.mark.liveness  # END_BOUND and BOUND

PARTS = 4
ROWS = 300_000  # per file: about 10 MB of incompressible rows
RATE = 16e6  # bytes/s through the relay proxy: the 40 MB take about 3 s
SLOW_RATE = 0.5e6  # bytes/s once the signal is near: the Dilation queue alone holds 16 s
END_BOUND = 2.0  # s: docs/transfer.md "Liveness" (measured: 0.3-0.6 s)
BOUND = 20.0  # s for a process to exit after the signal


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("cancel") / "src"
    incompressible_parts(folder, PARTS, ROWS, seed=11)
    return folder


@pytest.fixture
def relay_proxy(wormhole_servers: Any) -> Iterator[TcpProxy]:
    with TcpProxy("127.0.0.1", wormhole_servers.relay_port) as proxy:
        proxy.limit_rate(RATE)
        yield proxy


@pytest.fixture
def slow_relay(relay_proxy: TcpProxy) -> str:
    return f"tcp:127.0.0.1:{relay_proxy.port}"


@pytest.fixture
def staging(tmp_path: Path, monkeypatch: Any) -> Path:
    """The receiver stages under $TMPDIR/spark-dilation: here, where the test looks."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))
    return tmp / "spark-dilation"


def staged_bytes(root: Path) -> bool:
    return any(p.stat().st_size > 0 for p in root.glob("*/lane-*/.*.partial"))


def end_times(since: float, **running: Running) -> dict[str, float]:
    """Seconds from ``since`` until each process exited (polled; a hang fails at TIMEOUT)."""
    ended: dict[str, float] = {}
    while len(ended) < len(running):
        for name, r in running.items():
            if name not in ended and r.proc.poll() is not None:
                ended[name] = time.monotonic() - since
        if time.monotonic() - since > TIMEOUT:
            for r in running.values():
                r.kill()
            outputs = "".join(r.finish().describe() for r in running.values())
            pytest.fail(
                f"still running {TIMEOUT:g} s after the signal: {sorted(running)}\n{outputs}"
            )
        time.sleep(0.02)
    print(f"time to end after the signal: {ended}")
    return ended


def said_at(since: float, **running: Running) -> dict[str, float]:
    """Seconds from ``since`` until each process printed its last line (its end, told)."""
    said = {name: r.stamped[-1][0] - since for name, r in running.items() if r.stamped}
    print(f"time to say it ended: {said}")
    return said


def assert_prompt(since: float, **running: Running) -> None:
    """Each process said it ended within END_BOUND of ``since``, and exited within BOUND."""
    took = end_times(since, **running)
    said = said_at(since, **running)
    assert all(said.get(name, BOUND) < END_BOUND for name in running), (said, took)
    assert all(t < BOUND for t in took.values()), took


RAW = ("Traceback", "CRITICAL", "ERROR", "WARNING", "Unhandled error")


def last_line(result: Result, returncode: int) -> str:
    """The one ``spark-dilation:`` line, last; no traceback and no raw log line above it
    (INFO lines only where ``-v`` asked for them)."""
    assert_failed(result, returncode)
    lines = result.stderr.splitlines()
    assert lines and lines[-1].startswith("spark-dilation: "), result.describe()
    assert sum(line.startswith("spark-dilation: ") for line in lines) == 1, result.describe()
    verbose = "-v" in result.args
    raw = [ln for ln in lines if ln.startswith(RAW) or (ln.startswith("INFO") and not verbose)]
    assert raw == [], result.describe()
    return lines[-1]


def no_process_with(marker: str) -> list[str]:
    """Command lines of live processes whose environment holds ``marker`` (helpers left)."""
    left = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if marker.encode() in Path(f"/proc/{pid}/environ").read_bytes():
                left.append(Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"))
        except OSError:
            continue
    return left


def start_mid_transfer(
    procs: Callable[..., Running],  # noqa: F811
    mailbox_url: str,
    proxy: TcpProxy,
    source: Path,
    staging: Path,
    out: Path,
) -> tuple[Running, Running]:
    """Sender and receiver mid-transfer, the link cut to SLOW_RATE with data queued on it."""
    relay = f"tcp:127.0.0.1:{proxy.port}"
    # compression none: the rate limit must hold the transfer under way, whatever auto chose.
    flags = ("--no-listen", "--compression", "none", "-v")
    sender = procs(send_cmd(mailbox_url, relay, *flags, str(source)))
    code = sender.wait_for_code()
    receiver = procs(receive_cmd(mailbox_url, relay, "--no-listen", code, "-o", str(out)))
    wait_while_running("staged bytes", lambda: staged_bytes(staging), sender, receiver)
    proxy.limit_rate(SLOW_RATE)
    return sender, receiver


@pytest.mark.parametrize(
    ("signum", "code", "cause"),
    [
        (signal.SIGINT, 130, "Ctrl-C"),
        (signal.SIGTERM, 143, "SIGTERM"),
        (signal.SIGHUP, 129, "SIGHUP"),
    ],
)
def test_receiver_signal_mid_transfer_ends_both_and_tells_the_sender(
    mailbox_url: str,
    relay_proxy: TcpProxy,
    source: Path,
    staging: Path,
    procs: Callable[..., Running],  # noqa: F811
    tmp_path: Path,
    signum: int,
    code: int,
    cause: str,
) -> None:
    out = tmp_path / "out"
    sender, receiver = start_mid_transfer(procs, mailbox_url, relay_proxy, source, staging, out)
    t0 = time.monotonic()
    receiver.proc.send_signal(signum)
    assert_prompt(t0, sender=sender, receiver=receiver)
    sent, received = sender.finish(), receiver.finish()

    assert last_line(received, code) == f"spark-dilation: cancelled ({cause}); the sender was told"
    assert last_line(sent, 1) == (
        f"spark-dilation: error: the receiver cancelled the transfer ({cause})"
    ), sent.describe()
    assert "Dataset sent" not in sent.stderr
    # Nothing left behind: no staging, no partial output, no process of ours.
    assert not any(staging.glob("*")), list(staging.rglob("*"))
    assert not out.exists()
    assert no_process_with(str(staging.parent)) == []


def test_sender_ctrl_c_on_a_slow_link_tells_the_receiver_ahead_of_queued_data(
    mailbox_url: str,
    relay_proxy: TcpProxy,
    source: Path,
    staging: Path,
    procs: Callable[..., Running],  # noqa: F811
    tmp_path: Path,
) -> None:
    """The data queued ahead of an in-band abort would take over 16 s at 0.5 MB/s:
    the abort goes through the directory link and is heard in a mailbox round trip."""
    out = tmp_path / "out"
    sender, receiver = start_mid_transfer(procs, mailbox_url, relay_proxy, source, staging, out)
    t0 = time.monotonic()
    sender.proc.send_signal(signal.SIGINT)
    assert_prompt(t0, sender=sender, receiver=receiver)
    sent, received = sender.finish(), receiver.finish()

    assert last_line(sent, 130) == ("spark-dilation: cancelled (Ctrl-C); the receiver was told"), (
        sent.describe() + received.describe()
    )
    assert "Dataset sent" not in sent.stderr
    assert last_line(received, 1) == (
        "spark-dilation: error: the sender cancelled the transfer (Ctrl-C)"
    )
    # Heard through the directory, not by waiting out the queue or pairing anew.
    assert "confirmed the abort through the directory link" in sent.stderr, sent.describe()
    assert not any(staging.glob("*")) and not out.exists()
    assert no_process_with(str(staging.parent)) == []


def test_second_ctrl_c_exits_at_once_and_still_cleans_up(
    mailbox_url: str,
    relay_proxy: TcpProxy,
    source: Path,
    staging: Path,
    procs: Callable[..., Running],  # noqa: F811
    tmp_path: Path,
) -> None:
    out = tmp_path / "out"
    _sender, receiver = start_mid_transfer(procs, mailbox_url, relay_proxy, source, staging, out)
    t0 = time.monotonic()
    receiver.proc.send_signal(signal.SIGINT)
    time.sleep(0.05)  # the first is telling the sender
    receiver.proc.send_signal(signal.SIGINT)
    took = end_times(t0, receiver=receiver)
    received = receiver.finish()
    line = last_line(received, 130)
    # Usually the second signal cut the first short; a fast first may have finished.
    assert line in (
        "spark-dilation: interrupted again: exiting now",
        "spark-dilation: cancelled (Ctrl-C); the sender was told",
    ), received.describe()
    assert took["receiver"] < 5.0, took
    assert not any(staging.glob("*")) and not out.exists()


def test_sigterm_while_the_sender_waits_for_a_receiver(
    mailbox_url: str,
    source: Path,
    procs: Callable[..., Running],  # noqa: F811
) -> None:
    sender = procs(send_cmd(mailbox_url, "tcp:127.0.0.1:9", str(source)))
    sender.wait_for_stderr("waiting for the receiver")
    t0 = time.monotonic()
    sender.proc.send_signal(signal.SIGTERM)
    took = end_times(t0, sender=sender)
    assert last_line(sender.finish(), 143) == (
        "spark-dilation: cancelled (SIGTERM); no receiver had taken the dataset"
    )
    assert took["sender"] < 5.0, took


@pytest.mark.parametrize(
    ("key", "status", "last"),
    [
        (b"\x03", 130, "spark-dilation: cancelled (Ctrl-C)"),
        (b"\x04", 1, "spark-dilation: error: no code given (end of input at the prompt)"),
    ],
    ids=["ctrl-c", "ctrl-d"],
)
def test_ctrl_c_or_d_at_the_code_prompt_exits_with_one_press(
    mailbox_url: str, key: bytes, status: int, last: str
) -> None:
    term = Terminal([*ours(mailbox_url), "receive"], child_env()).start()
    try:
        term.wait_for("Enter receive wormhole code: ", TIMEOUT)
        t0 = time.monotonic()
        term.type(key)  # once
        ended = term.wait(TIMEOUT)
        took = time.monotonic() - t0
    finally:
        term.kill()
    print(f"prompt: ended {took:.2f} s after one {key!r}")
    text = term.text()
    assert ended == status, text
    assert took < 5.0, took
    assert "Traceback" not in text, text
    assert text.rstrip().endswith(last), text


# --- the Python API: cancel() and Ctrl-C take the same paths ------------------------------


@pytest.fixture
def api_opts(mailbox_url: str, slow_relay: str, tmp_path: Path) -> dict[str, Any]:
    return {
        "mailbox": mailbox_url,
        "relay": slow_relay,
        "no_listen": True,
        "staging_dir": str(tmp_path / "staging"),
        "compression": "none",  # the rate limit holds it under way, whatever auto chose
    }


def test_api_sender_cancel_tells_the_receiver(
    api_opts: dict[str, Any], relay_proxy: TcpProxy, source: Path, tmp_path: Path
) -> None:
    sender = DatasetSender(source, options=TransferOptions(**api_opts))
    box: dict[str, Any] = {}

    def send() -> None:
        try:
            sender.wait()
        except BaseException as e:
            box["error"] = e
            box["ended"] = time.monotonic()

    threading.Thread(target=send, daemon=True).start()
    staging = tmp_path / "staging"

    def cancel_once_staged() -> None:
        deadline = time.monotonic() + TIMEOUT
        while not staged_bytes(staging) and time.monotonic() < deadline:
            time.sleep(0.01)
        relay_proxy.limit_rate(SLOW_RATE)
        box["cancelled"] = time.monotonic()
        sender.cancel("the test")

    threading.Thread(target=cancel_once_staged, daemon=True).start()
    with pytest.raises(TransferAbortedError) as got:
        receive_dataset(sender.code, tmp_path / "out", lanes=2, **api_opts)
    received = time.monotonic() - box["cancelled"]
    wait_until("the sender to end", lambda: "ended" in box, TIMEOUT, interval=0.01)
    print(f"api cancel: receiver {received:.2f} s, sender {box['ended'] - box['cancelled']:.2f} s")
    assert str(got.value) == "the sender cancelled the transfer (the test)"
    assert isinstance(box["error"], TransferCancelledError), box
    assert str(box["error"]).endswith("was cancelled (the test); the receiver was told")
    assert received < END_BOUND and box["ended"] - box["cancelled"] < END_BOUND
    assert not any(staging.glob("*")) and not (tmp_path / "out").exists()


@pytest.fixture
def python_sigint() -> Iterator[None]:
    """Python's own Ctrl-C handler, as in a terminal. A process started in the
    background by a shell without job control (``cmd &`` in a script, as a CI job
    may start the suite) begins with SIGINT ignored, and then ``interrupt_main()``
    does nothing: the test saw no KeyboardInterrupt in such runs only."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.mark.usefixtures("python_sigint")
def test_api_ctrl_c_in_receive_dataset_tells_the_sender(
    api_opts: dict[str, Any], relay_proxy: TcpProxy, source: Path, tmp_path: Path
) -> None:
    sender = DatasetSender(source, options=TransferOptions(**api_opts))
    box: dict[str, Any] = {}

    def send() -> None:
        try:
            sender.wait()
        except BaseException as e:
            box["error"] = e
            box["ended"] = time.monotonic()

    threading.Thread(target=send, daemon=True).start()
    staging = tmp_path / "staging"

    def ctrl_c_once_staged() -> None:
        deadline = time.monotonic() + TIMEOUT
        while not staged_bytes(staging) and time.monotonic() < deadline:
            time.sleep(0.01)
        relay_proxy.limit_rate(SLOW_RATE)
        box["pressed"] = time.monotonic()
        _thread.interrupt_main()  # what Ctrl-C does: KeyboardInterrupt in the main thread

    threading.Thread(target=ctrl_c_once_staged, daemon=True).start()
    with pytest.raises(KeyboardInterrupt) as got:
        receive_dataset(sender.code, tmp_path / "out", lanes=2, **api_opts)
    received = time.monotonic() - box["pressed"]
    wait_until("the sender to end", lambda: "ended" in box, TIMEOUT, interval=0.01)
    print(f"api Ctrl-C: receiver {received:.2f} s, sender {box['ended'] - box['pressed']:.2f} s")
    assert isinstance(got.value, Interrupted)
    assert str(got.value) == "cancelled (Ctrl-C); the sender was told"
    assert isinstance(box["error"], TransferAbortedError), box
    assert str(box["error"]) == "the receiver cancelled the transfer (Ctrl-C)"
    assert received < END_BOUND and box["ended"] - box["pressed"] < END_BOUND
    assert not any(staging.glob("*")) and not (tmp_path / "out").exists()
