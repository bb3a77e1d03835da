"""Every wait ends by its deadline and says which option to raise (issue 18).

Real mailbox server, real processes: a transfer with no path at all ends in
seconds with one message; readers that meet a spent code or each other end
by their ``peer_timeout`` (or at once, with the true cause); the timeout
error names the option the way the calling API spells it. Each side's time
to end is printed and asserted against the stated bound with wide slack.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_cli import Running, last_error_line, new_code, ours

from spark_dilation.errors import PeerTimeoutError, TransferError, WrongCodeError
from spark_dilation.testing.waiting import wait_until
from spark_dilation.transfer.rules.options import TransferOptionError, TransferOptions

pytestmark = pytest.mark.liveness  # each case bounds how long an end takes


@pytest.fixture
def background() -> Iterator[Callable[[Sequence[str]], Running]]:
    """Background processes, killed at teardown if still running (as test_cli's)."""
    started: list[Running] = []

    def start(args: Sequence[str]) -> Running:
        started.append(Running(args))
        return started[-1]

    yield start
    for running in started:
        running.kill()


# --- no path at all ------------------------------------------------------------------------

NO_PATH_TIMEOUT = TransferOptions().no_path_timeout
# First round of attempts (refused at once) + no_path_timeout + pairing and exit;
# generous slack, far below the old 300 s (reconnect_timeout) it replaces.
NO_PATH_BOUND = NO_PATH_TIMEOUT + 30.0


def closed_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_no_path_relay_only_ends_both_sides_in_seconds_with_one_message(
    mailbox_url: str, background: Callable[..., Running], tmp_path: Path
) -> None:
    """Relay-only (``--no-listen`` both sides), the relay a closed port: both CLIs end
    within the bound with one error naming the relay and why, never "reconnecting"."""
    pq.write_table(pa.table({"id": list(range(100))}), tmp_path / "a.parquet")
    relay = f"tcp:127.0.0.1:{closed_port()}"
    code = new_code()
    common = ("--relay", relay, "--no-listen")
    started = time.monotonic()
    sender = background(
        ours(mailbox_url, "send", *common, "--json", "--code", code, str(tmp_path / "a.parquet"))
    )
    receiver = background(ours(mailbox_url, "receive", *common, code, "-o", str(tmp_path / "out")))
    received = receiver.finish()
    received_at = time.monotonic() - started
    sent = sender.finish()
    sent_at = time.monotonic() - started
    print(f"no path: receiver ended after {received_at:.1f} s, sender after {sent_at:.1f} s")

    for result, took in ((received, received_at), (sent, sent_at)):
        line = last_error_line(result)  # printed once, and last
        assert line.startswith(
            f"spark-dilation: error: could not reach the other side: relay {relay} refused"
        ), result.describe()
        assert f"Check that the transit relay {relay} is running" in line
        assert "Spark" not in line and "lanes" not in line, line
        assert "reconnect" not in result.stderr, result.describe()
        assert took < NO_PATH_BOUND, (took, result.describe())
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())

    # The sender's --json events: "connecting" while it tries, never "reconnecting".
    import json

    events = [json.loads(line) for line in sent.stdout.splitlines() if line.strip()]
    progress = [e for e in events if e["event"] == "progress"]
    assert not any(e["reconnecting"] for e in progress), progress
    assert any(e["connecting"] for e in progress), progress
    errors = [e for e in events if e["event"] == "error"]
    assert len(errors) == 1 and errors[0]["message"].startswith("could not reach"), events


# --- wrong code, then the right code -------------------------------------------------------


def test_wrong_code_spends_it_and_the_right_code_reader_ends_by_its_peer_timeout(
    mailbox_url: str,
) -> None:
    """The reference spends a code on a failed PAKE: the sender ends at once with
    the wrong-code error; a reader with the right code then finds nobody and ends
    by its ``peer_timeout`` with PeerTimeoutError naming ``peer_timeout=``."""
    from spark_dilation.transfer.api import DatasetSender, receive_dataset

    code = new_code()
    sender = DatasetSender(
        pa.table({"id": [1, 2, 3]}),
        code=code,
        options=TransferOptions(mailbox=mailbox_url, peer_timeout=60),
    )
    outcome: dict[str, object] = {}

    def wait() -> None:
        started = time.monotonic()
        try:
            sender.wait()
        except Exception as e:
            outcome["error"] = e
        outcome["took"] = time.monotonic() - started

    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    nameplate = code.split("-", 1)[0]
    with pytest.raises(WrongCodeError):
        receive_dataset(f"{nameplate}-absurd-adroitness", mailbox=mailbox_url, peer_timeout=10)
    waiter.join(30)
    assert not waiter.is_alive(), "the sender did not end after the wrong code"
    print(f"wrong code: the sender ended after {outcome['took']:.1f} s")
    assert isinstance(outcome["error"], WrongCodeError), outcome

    started = time.monotonic()
    with pytest.raises(PeerTimeoutError) as raised:
        receive_dataset(code, mailbox=mailbox_url, peer_timeout=3)
    took = time.monotonic() - started
    print(f"right code after a wrong one: the reader ended after {took:.1f} s (peer_timeout 3)")
    assert 2.5 < took < 3 + 15, took
    assert str(raised.value).endswith("or raise peer_timeout=."), raised.value


def test_two_readers_on_one_code_end_at_once_saying_so(mailbox_url: str) -> None:
    """Two readers typing the same code meet each other, not the sender: both end at
    once with that cause instead of each waiting for an offer forever."""
    from spark_dilation.transfer.api import receive_dataset

    code = new_code()
    errors: list[BaseException] = []
    took: list[float] = []

    def read() -> None:
        started = time.monotonic()
        try:
            receive_dataset(code, mailbox=mailbox_url, peer_timeout=20)
        except BaseException as e:
            errors.append(e)
        took.append(time.monotonic() - started)

    readers = [threading.Thread(target=read, daemon=True) for _ in range(2)]
    for r in readers:
        r.start()
    for r in readers:
        r.join(60)
    print(f"two readers on one code: ended after {[f'{t:.1f}' for t in took]} s")
    assert not any(r.is_alive() for r in readers), "a reader still waits"
    assert len(errors) == 2, errors
    for e in errors:
        assert isinstance(e, TransferError), e
        assert "another receiver, not the sender" in str(e), e
    assert max(took) < 15, took  # at once, not by peer_timeout (20 s)


# --- PeerTimeoutError names the caller's option ----------------------------------------------


def test_peer_timeout_error_names_the_option_of_each_api() -> None:
    from spark_dilation.cli import _transfer_options, build_parser

    python = TransferOptions()
    spark = TransferOptions.from_strings({"peer_timeout": "5"})
    cli = _transfer_options(build_parser().parse_args(["receive", "1-a-b"]))
    assert (python.surface, spark.surface, cli.surface) == ("python", "spark", "cli")
    spelled = [o.spelled("peer_timeout") for o in (python, spark, cli)]
    assert spelled == ["peer_timeout=", 'option("peer_timeout", ...)', "--timeout"]
    texts = [str(PeerTimeoutError("7-a-b", 5, s)) for s in spelled]
    assert texts[0].endswith("or raise peer_timeout=.")
    assert texts[1].endswith('or raise option("peer_timeout", ...).')
    assert texts[2].endswith("or raise --timeout.")
    # Not an option anyone can set through Spark, and it survives with_() and pickling.
    with pytest.raises(TransferOptionError, match="unknown option 'surface'"):
        TransferOptions.from_strings({"surface": "cli"})
    import pickle

    assert pickle.loads(pickle.dumps(spark.with_(lanes=3))).surface == "spark"


# --- a sender host whose socket path is longer than sun_path --------------------------------


def test_sender_host_works_under_a_tmpdir_longer_than_the_socket_limit(
    mailbox_url: str, relay_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TMPDIR of 150+ characters: the host binds its socket through its directory's
    descriptor, and tasks hand it their partitions as usual."""
    import tempfile

    from test_sender_host import agree, table

    from spark_dilation.transfer.send.hostlink import (
        deliver_manifest_via_host,
        host_dir,
        send_partition_via_host,
        socket_path,
        start_sender_host,
    )

    long_tmp = tmp_path / ("t" * 60) / ("m" * 60) / ("p" * 40)
    long_tmp.mkdir(parents=True)
    assert len(str(long_tmp)) >= 150
    monkeypatch.setenv("TMPDIR", str(long_tmp))  # the host process's tempdir
    monkeypatch.setattr(tempfile, "tempdir", str(long_tmp))  # and this one's
    opts = {"mailbox": mailbox_url, "relay": relay_url, "staging_dir": str(tmp_path / "s")}
    parts = [table(1000, start=p * 1000) for p in range(2)]
    spec, receiver, received = agree(parts[0].schema, opts)
    assert len(str(socket_path(spec)).encode()) > 108

    started = time.monotonic()
    assert start_sender_host(spec)
    wait_until("the sender host's socket", socket_path(spec).exists, 60)
    assert socket_path(spec).stat().st_mode & 0o077 == 0  # still this user's alone
    committed = []
    for p in range(2):
        got = send_partition_via_host(spec, p, 0, iter(parts[p].to_batches()))
        assert got is not None, "the task did not reach the host"
        committed.append(got[0])
    assert deliver_manifest_via_host(spec, committed) is not None
    receiver.join(120)
    from test_sender_host import _hubs

    while _hubs:  # the writing end agree() started in this process
        _hubs.pop().close()
    print(f"long socket path: sent through the host in {time.monotonic() - started:.1f} s")
    assert "error" not in received, received.get("error")
    assert received["result"].table.sort_by("id").equals(pa.concat_tables(parts))
    wait_until("the sender host to exit", lambda: not host_dir(spec).exists(), 60)


# --- spark-dilation cleanup ------------------------------------------------------------------


@pytest.mark.integration  # starts processes of its own
def test_cleanup_removes_stale_transfers_and_keeps_live_ones(tmp_path: Path) -> None:
    """A fabricated stale transfer (dead host, free lock) and a sender host dir go; a
    lane whose lock another process holds, a live host.pid and received files stay."""
    import subprocess
    import sys

    from test_cli import run

    root = tmp_path / ("r" * 20)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = root / "0f0f" / "lane-0"
    stale.mkdir(parents=True)
    (stale / "p000000.arrow").write_bytes(b"x" * 5000)
    (stale / "host.pid").write_text(str(dead.pid))
    (stale / "error.json").write_text("{}")
    (stale / ".lock").write_text("")
    sender = root / "send-0f0f"
    sender.mkdir()
    (sender / "host.sock").write_text("")
    (sender / "host.pid").write_text(str(dead.pid))
    (sender / "host.log").write_bytes(b"y" * 1000)

    locked = root / "1a1a" / "lane-0"
    locked.mkdir(parents=True)
    (locked / "p000000.arrow").write_bytes(b"z" * 100)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, os, sys, time\n"
            f"fd = os.open({str(locked / '.lock')!r}, os.O_RDWR | os.O_CREAT)\n"
            "fcntl.flock(fd, fcntl.LOCK_EX)\nprint('locked', flush=True)\ntime.sleep(60)\n",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "locked\n"
        running = root / "send-2b2b"
        running.mkdir()
        (running / "host.pid").write_text(str(sleeper.pid))
        received = root / "receive-abc"
        received.mkdir()
        (received / "data.csv").write_text("a\n1\n")

        dry = run(ours("ws://127.0.0.1:1/v1", "cleanup", "--staging-root", str(root), "--dry-run"))
        assert dry.returncode == 0, dry.describe()
        print(dry.stdout)
        assert f"would remove {root / '0f0f'} (5.0 kB)" in dry.stdout
        assert f"would remove {root / 'send-0f0f'} (1.0 kB)" in dry.stdout
        assert (root / "0f0f").exists() and (root / "send-0f0f").exists()

        started = time.monotonic()
        done = run(ours("ws://127.0.0.1:1/v1", "cleanup", "--staging-root", str(root)))
        print(f"cleanup took {time.monotonic() - started:.1f} s\n{done.stdout}")
        assert done.returncode == 0 and done.stderr == "", done.describe()
        lines = done.stdout.splitlines()
        assert f"removed {root / '0f0f'} (5.0 kB)" in lines
        assert f"removed {root / 'send-0f0f'} (1.0 kB)" in lines
        assert f"kept {root / '1a1a'}: locked by a running process (lane-0/.lock) (100 B)" in lines
        kept_running = f"kept {root / 'send-2b2b'}: its process {sleeper.pid} runs ("
        assert any(line.startswith(kept_running) for line in lines), lines
        assert any(line.startswith(f"kept {received}: received files") for line in lines)
        assert lines[-1] == (
            f"{root}: removed 2 stale transfer dir(s), 6.0 kB freed; kept 3 in use"
        ), lines
        assert sorted(p.name for p in root.iterdir()) == ["1a1a", "receive-abc", "send-2b2b"]
    finally:
        holder.kill()
        sleeper.kill()
        holder.wait()
        sleeper.wait()
    # The owners are gone now: the rest goes (received files stay).
    again = run(ours("ws://127.0.0.1:1/v1", "cleanup", "--staging-root", str(root)))
    assert again.returncode == 0 and f"removed {root / '1a1a'} (100 B)" in again.stdout
    assert sorted(p.name for p in root.iterdir()) == ["receive-abc"]


def test_no_path_python_api_many_partitions_end_by_no_path_timeout(
    mailbox_url: str, tmp_path: Path
) -> None:
    """Python API, relay-only, the relay refused, 8 partitions on 2 lanes and
    ``no_path_timeout=2``: the sender and the receiver each end once, within the
    bound, with the no-path error (later partitions do not try again)."""
    from spark_dilation.dilation import DilationNoPath
    from spark_dilation.transfer.api import DatasetSender, receive_dataset

    relay = f"tcp:127.0.0.1:{closed_port()}"
    opts = TransferOptions(
        mailbox=mailbox_url, relay=relay, no_listen=True, no_path_timeout=2, peer_timeout=30
    )
    for i in range(8):  # one partition per file
        pq.write_table(
            pa.table({"id": list(range(i * 10, i * 10 + 10))}), tmp_path / f"{i}.parquet"
        )
    sender = DatasetSender(tmp_path, options=opts)
    outcome: dict[str, object] = {}

    def send() -> None:
        started = time.monotonic()
        try:
            sender.wait()
        except Exception as e:
            outcome["error"] = e
        outcome["took"] = time.monotonic() - started

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    started = time.monotonic()
    with pytest.raises(DilationNoPath) as raised:
        receive_dataset(sender.code, options=opts)
    took = time.monotonic() - started
    thread.join(60)
    assert not thread.is_alive(), "the sender still runs"
    print(f"no path, Python API: receiver {took:.1f} s, sender {outcome['took']:.1f} s")
    for error, seconds in ((raised.value, took), (outcome["error"], outcome["took"])):
        assert isinstance(error, DilationNoPath), error
        assert str(error).startswith(f"could not reach the other side: relay {relay} refused")
        # One first round + no_path_timeout, with slack; the queued partitions do not
        # pair and dilate again (2.5 s more each round per lane).
        assert seconds < 2 + 8, seconds


def test_without_proc_a_long_socket_path_is_one_clear_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import logging
    import tempfile

    from spark_dilation.transfer.rules.spec import TransferSpec
    from spark_dilation.transfer.send import hostlink

    long_tmp = tmp_path / ("l" * 150)
    monkeypatch.setattr(tempfile, "tempdir", str(long_tmp))
    monkeypatch.setattr(hostlink, "_PROC_FD", tmp_path / "no-proc")
    spec = TransferSpec("ab" * 16, b"s" * 32, 1, b"", "none", TransferOptions())
    with caplog.at_level(logging.WARNING, logger=hostlink.__name__):
        assert not hostlink.socket_path_fits(spec)
        assert not hostlink.start_sender_host(spec)  # the tasks send on their own
    (record,) = caplog.records  # once, however often it is asked
    assert record.getMessage().startswith(
        f"not using a sender host for transfer {'ab' * 16}: its socket path "
        f"{hostlink.socket_path(spec)} is "
    )
    assert "over this system's Unix socket limit" in record.getMessage()
    assert "Set TMPDIR to a shorter directory" in record.getMessage()


def test_a_connection_never_up_is_connecting_not_reconnecting() -> None:
    import io

    from spark_dilation.cli_progress import Reporter
    from spark_dilation.dilation import DilationStatus
    from spark_dilation.transfer.rules.report import Progress, is_connecting, is_reconnecting

    first = DilationStatus(down_since=1.0)  # trying its first connection
    again = DilationStatus(down_since=1.0, connections=1)  # was up, lost it
    assert (is_connecting(first), is_reconnecting(first)) == (True, False)
    assert (is_connecting(again), is_reconnecting(again)) == (False, True)

    err = io.StringIO()
    reporter = Reporter("plain", out=io.StringIO(), err=err)
    base = {"side": "send", "rows": 0, "bytes": 0, "seconds": 1.0, "path": "unknown"}
    reporter.progress(Progress(connecting=True, **base))
    assert err.getvalue() == ""  # no "connection lost: reconnecting.."
    reporter.progress(Progress(reconnecting=True, connections=1, **base))
    assert err.getvalue() == "connection lost: reconnecting..\n"
    out = io.StringIO()
    Reporter("json", out=out).progress(Progress(connecting=True, **base))
    assert '"connecting": true' in out.getvalue() and '"reconnecting": false' in out.getvalue()
