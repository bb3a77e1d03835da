"""Ctrl-C and SIGTERM on either side of a dataset transfer: both sides end and say why.

The CLI runs as real processes over the real mailbox server and a transit
relay reached through a rate-limited proxy (``--no-listen`` on both sides,
so every byte goes through it), which keeps a 40 MB dataset moving for a
few seconds: the signal lands mid-transfer, once the receiver has staged
bytes. The Python API tests do the same in this process.

Bounds (each side's time to end is printed; asserted with generous slack):
the signalled side stops its streams at once and ends once the other side
confirmed the end; the other side ends once it heard it. The end message
travels behind the data already queued on the connection (up to about
20 MB between the Dilation queue and the socket buffers here: about a
second at the proxy's rate; instant on a fast link); the sender's end also
goes over a new connection when it is not confirmed at once, so at 0.25 MB/s
too both sides end within a few seconds (``CANCEL_TELL_TIMEOUT`` +
``CANCEL_LINGER`` at worst). Before this, the other side reconnected for ever.
"""

from __future__ import annotations

import _thread
import os
import pty
import select
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_cli import TIMEOUT, Result, Running, assert_failed, ours, wait_while_running
from test_cli_dataset import procs, receive_cmd, send_cmd  # noqa: F401 (procs)

from spark_dilation.errors import Interrupted, TransferCancelledError
from spark_dilation.testing import TcpProxy
from spark_dilation.testing.waiting import wait_until
from spark_dilation.transfer import TransferOptions, receive_dataset
from spark_dilation.transfer.api import DatasetSender
from spark_dilation.transfer.staging import TransferAbortedError

PARTS = 4
ROWS = 300_000  # per file: about 10 MB of incompressible rows
RATE = 16e6  # bytes/s through the relay proxy: the 40 MB take about 3 s
SLOW_RATE = 0.25e6  # bytes/s: the Dilation queue alone (8 MB) would hold an abort 32 s
BOUND = 20.0  # seconds for a side to end after the signal (measured: 1-3 s)


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("cancel") / "src"
    folder.mkdir()
    rng = np.random.default_rng(11)
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


def last_line(result: Result, returncode: int) -> str:
    assert_failed(result, returncode)
    lines = result.stderr.splitlines()
    assert lines and lines[-1].startswith("spark-dilation: "), result.describe()
    assert sum(line.startswith("spark-dilation: ") for line in lines) == 1, result.describe()
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
    relay: str,
    source: Path,
    staging: Path,
    out: Path,
) -> tuple[Running, Running]:
    # compression none: the rate limit must hold the transfer under way, whatever auto chose.
    flags = ("--no-listen", "--compression", "none", "-v")
    sender = procs(send_cmd(mailbox_url, relay, *flags, str(source)))
    code = sender.wait_for_code()
    receiver = procs(receive_cmd(mailbox_url, relay, "--no-listen", code, "-o", str(out)))
    wait_while_running("staged bytes", lambda: staged_bytes(staging), sender, receiver)
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
    slow_relay: str,
    source: Path,
    staging: Path,
    procs: Callable[..., Running],  # noqa: F811
    tmp_path: Path,
    signum: int,
    code: int,
    cause: str,
) -> None:
    out = tmp_path / "out"
    sender, receiver = start_mid_transfer(procs, mailbox_url, slow_relay, source, staging, out)
    t0 = time.monotonic()
    receiver.proc.send_signal(signum)
    took = end_times(t0, sender=sender, receiver=receiver)
    sent, received = sender.finish(), receiver.finish()

    assert last_line(received, code) == f"spark-dilation: cancelled ({cause}); the sender was told"
    assert last_line(sent, 1) == (
        f"spark-dilation: error: the receiver cancelled the transfer ({cause})"
    ), sent.describe()
    assert "Dataset sent" not in sent.stderr
    assert took["receiver"] < BOUND and took["sender"] < BOUND, took
    # Nothing left behind: no staging, no partial output, no process of ours.
    assert not any(staging.glob("*")), list(staging.rglob("*"))
    assert not out.exists()
    assert no_process_with(str(staging.parent)) == []


def test_sender_ctrl_c_on_a_slow_link_tells_the_receiver_ahead_of_queued_data(
    mailbox_url: str,
    relay_proxy: TcpProxy,
    slow_relay: str,
    source: Path,
    staging: Path,
    procs: Callable[..., Running],  # noqa: F811
    tmp_path: Path,
) -> None:
    """At 0.25 MB/s the data queued ahead of an in-band abort would take over 30 s:
    the abort goes over a new connection too and is heard in seconds."""
    out = tmp_path / "out"
    sender, receiver = start_mid_transfer(procs, mailbox_url, slow_relay, source, staging, out)
    relay_proxy.limit_rate(SLOW_RATE)
    t0 = time.monotonic()
    sender.proc.send_signal(signal.SIGINT)
    took = end_times(t0, sender=sender, receiver=receiver)
    sent, received = sender.finish(), receiver.finish()

    assert last_line(sent, 130) == ("spark-dilation: cancelled (Ctrl-C); the receiver was told"), (
        sent.describe() + received.describe()
    )
    assert "Dataset sent" not in sent.stderr
    assert last_line(received, 1) == (
        "spark-dilation: error: the sender cancelled the transfer (Ctrl-C)"
    )
    assert took["sender"] < BOUND and took["receiver"] < BOUND, took
    assert not any(staging.glob("*")) and not out.exists()
    assert no_process_with(str(staging.parent)) == []


def test_second_ctrl_c_exits_at_once_and_still_cleans_up(
    mailbox_url: str,
    slow_relay: str,
    source: Path,
    staging: Path,
    procs: Callable[..., Running],  # noqa: F811
    tmp_path: Path,
) -> None:
    out = tmp_path / "out"
    _sender, receiver = start_mid_transfer(procs, mailbox_url, slow_relay, source, staging, out)
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
    pid, fd = pty.fork()
    if pid == 0:  # the child: the command on a terminal of its own
        os.execv(ours(mailbox_url)[0], [*ours(mailbox_url), "receive"])
    shown = b""

    def read(until: float) -> None:
        nonlocal shown
        while time.monotonic() < until:
            if select.select([fd], [], [], 0.05)[0]:
                try:
                    shown += os.read(fd, 4096)
                except OSError:  # the child closed the terminal
                    return
            if b"Enter receive wormhole code: " in shown and not pressed:
                return

    pressed = False
    try:
        read(time.monotonic() + TIMEOUT)
        assert b"Enter receive wormhole code: " in shown, shown
        pressed = True
        t0 = time.monotonic()
        os.write(fd, key)  # once
        ended = None
        while ended is None and time.monotonic() - t0 < TIMEOUT:
            read(time.monotonic() + 0.1)
            done, raw = os.waitpid(pid, os.WNOHANG)
            ended = os.waitstatus_to_exitcode(raw) if done else None
        took = time.monotonic() - t0
        print(f"prompt: ended {took:.2f} s after one {key!r}")
        text = shown.decode(errors="replace")
        assert ended == status, text
        assert took < 5.0, took
        assert "Traceback" not in text, text
        assert text.rstrip().endswith(last), text
    finally:
        if not pressed or ended is None:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        os.close(fd)


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
    api_opts: dict[str, Any], source: Path, tmp_path: Path
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
    assert received < BOUND and box["ended"] - box["cancelled"] < BOUND
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
    api_opts: dict[str, Any], source: Path, tmp_path: Path
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
    assert received < BOUND and box["ended"] - box["pressed"] < BOUND
    assert not any(staging.glob("*")) and not (tmp_path / "out").exists()
