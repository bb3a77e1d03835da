"""CLI habits: shared options in either place, ``--text -``, help defaults,
the code banner, default output folders, quiet success, the default relay."""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from spark_dilation import cli
from spark_dilation.transfer.rules.options import (
    DEFAULT_RELAY_URL,
    RELAY_ENV,
    TransferOptions,
    resolve_relay,
)
from spark_dilation.wormhole import DEFAULT_MAILBOX_URL
from tests.test_cli import OURS, TIMEOUT, child_env, new_code

log = logging.getLogger(__name__)


def parse(*argv: str) -> argparse.Namespace:
    return cli.build_parser().parse_args(list(argv))


# --- options before or after the subcommand ----------------------------------------------


@pytest.mark.parametrize(
    "argv",
    [
        ["--mailbox", "ws://m:1/v1", "--appid", "x.y/z", "-v", "--relay", "tcp:r:2", "send", "f"],
        ["send", "--mailbox", "ws://m:1/v1", "--appid", "x.y/z", "-v", "--relay", "tcp:r:2", "f"],
        ["--mailbox", "ws://m:1/v1", "-v", "send", "--appid", "x.y/z", "--relay", "tcp:r:2", "f"],
    ],
    ids=["before", "after", "mixed"],
)
def test_shared_options_before_or_after_the_subcommand(argv: list[str]) -> None:
    args = parse(*argv)
    assert (args.command, args.paths) == ("send", ["f"])
    assert (args.mailbox, args.appid, args.verbose, args.relay) == (
        "ws://m:1/v1",
        "x.y/z",
        1,
        "tcp:r:2",
    )
    receive = parse("--no-listen", "receive", "7-a-b", "--mailbox", "ws://m:1/v1")
    assert (receive.no_listen, receive.mailbox, receive.code) == (True, "ws://m:1/v1", "7-a-b")


def test_shared_options_default_when_absent(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SPARK_DILATION_MAILBOX", raising=False)
    monkeypatch.delenv(RELAY_ENV, raising=False)
    for argv in (["send", "f"], ["receive"], ["serve"], ["demo"]):
        args = parse(*argv)
        assert args.mailbox == DEFAULT_MAILBOX_URL, argv
        assert args.relay == DEFAULT_RELAY_URL, argv
        assert (args.verbose, args.no_listen) == (0, False), argv
    monkeypatch.setenv("SPARK_DILATION_MAILBOX", "ws://env:3/v1")
    assert parse("receive").mailbox == "ws://env:3/v1"
    assert parse("receive", "--mailbox", "ws://arg:4/v1").mailbox == "ws://arg:4/v1"


def test_serve_help_shows_its_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["serve", "--help"])
    shown = " ".join(capsys.readouterr().out.split())
    for default in ("default 127.0.0.1", "default 4000", "default 4001"):
        assert default in shown, shown


# --- the banner and the default output folder ----------------------------------------------


def test_the_banner_names_a_non_default_mailbox() -> None:
    ours, spark, ref = cli._receive_hints(parse("send", "f"), "7-a-b")
    assert ours == "spark-dilation receive 7-a-b"
    assert "mailbox" not in spark and ref == "wormhole receive 7-a-b"
    ours, spark, ref = cli._receive_hints(parse("send", "f", "--mailbox", "ws://h:1/v1"), "7-a-b")
    assert ours == "spark-dilation receive --mailbox ws://h:1/v1 7-a-b"
    assert '.option("mailbox", "ws://h:1/v1")' in spark
    assert ref == "wormhole --relay-url ws://h:1/v1 receive 7-a-b"


def test_default_dataset_folders_do_not_collide(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    args = parse("receive")
    assert cli._dataset_dest(args, "12-a-b") == Path("dataset-12")
    Path("dataset-12").mkdir()
    assert cli._dataset_dest(args, "12-c-d") == Path("dataset-12-2")
    Path("dataset-12-2").touch()
    assert cli._dataset_dest(args, "12-c-d") == Path("dataset-12-3")
    assert cli._dataset_dest(parse("receive", "-o", "mine"), "12-c-d") == Path("mine")


# --- the default relay ------------------------------------------------------------------------


def _relay_hints(args: argparse.Namespace) -> list[dict[str, Any]]:
    # --no-listen: only the relay hints, and nothing is opened or dialled.
    d = cli._connector(None, args, True).get_connection_hints()
    return d.result


def test_the_default_relay_is_the_public_one_and_none_turns_it_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(RELAY_ENV, raising=False)
    public = {"hostname": "transit.magic-wormhole.io", "port": 4001, "priority": 0.0}
    # The CLI's classic transfers: the hints the connector advertises.
    hints = _relay_hints(parse("send", "--no-listen", "--text", "x"))
    assert [h["type"] for h in hints] == ["relay-v1"]
    assert hints[0]["hints"][0] | {"priority": 0.0} == {"type": "direct-tcp-v1", **public}
    assert _relay_hints(parse("send", "--no-listen", "--relay", "none", "--text", "x")) == []
    # Datasets (the CLI, the Python API, Spark): the relay the lanes dial.
    assert TransferOptions().relay_url == DEFAULT_RELAY_URL
    assert cli._transfer_options(parse("send", "f")).relay_url == DEFAULT_RELAY_URL
    assert cli._transfer_options(parse("send", "f", "--relay", "none")).relay_url is None
    assert TransferOptions(relay="none").relay_url is None
    assert TransferOptions.from_strings({"relay": "None"}).relay_url is None
    assert resolve_relay("tcp:mine:1") == "tcp:mine:1"
    monkeypatch.setenv(RELAY_ENV, "none")
    assert TransferOptions().relay_url is None
    assert _relay_hints(parse("send", "--no-listen", "--text", "x")) == []
    assert TransferOptions(relay="tcp:mine:1").relay_url == "tcp:mine:1"
    monkeypatch.setenv(RELAY_ENV, "tcp:env:2")
    assert TransferOptions().relay_url == "tcp:env:2"


# --- real transfers: --text -, quiet success, an unreachable default relay -----------------


def _cli(cwd: Path, *args: str, stdin: str | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [OURS, *args],
        cwd=cwd,
        stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        encoding="utf-8",
        env=child_env(),
    )


def _finish(proc: subprocess.Popen[str], stdin: str | None = None) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(stdin, timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"{proc.args} did not finish within {TIMEOUT:g} s\n{err}")
    return proc.returncode, out, err


def test_text_from_stdin(mailbox_url: str, tmp_path: Path) -> None:
    code = new_code()
    receiver = _cli(tmp_path, "receive", code, "--mailbox", mailbox_url)
    sender = _cli(tmp_path, "send", "--text", "-", "--code", code, "--mailbox", mailbox_url,
                  stdin="")  # fmt: skip
    rc, _, sent = _finish(sender, "line one\nline two\n")
    assert rc == 0, sent
    assert "Reading text message from stdin.." in sent
    assert f"spark-dilation receive --mailbox {mailbox_url} {code}" in sent, sent
    rc, out, err = _finish(receiver)
    assert rc == 0, err
    # Stdin went as it was (as `wormhole send --text -` sends it); the text's own
    # trailing newline ends the line (test_cli.py: what the reference shows).
    assert out == "line one\nline two\n"
    assert err == ""


def test_dataset_with_the_unreachable_default_relay_is_direct_quick_and_quiet(
    mailbox_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No --relay: the public relay is offered but its name does not resolve here.

    The direct path must carry the transfer with no delay and no warnings,
    before and after success; two receives of the same nameplate land in
    dataset-N and dataset-N-2.
    """
    monkeypatch.delenv(RELAY_ENV, raising=False)
    src = tmp_path / "src"
    src.mkdir()
    for i in range(2):
        pq.write_table(pa.table({"id": list(range(i * 100, (i + 1) * 100))}), src / f"{i}.parquet")
    nameplate = new_code().split("-", 1)[0]
    for run_no, words in enumerate(("alpha-bravo", "charlie-delta")):
        code = f"{nameplate}-{words}"
        start = time.monotonic()
        sender = _cli(tmp_path, "send", str(src), "--code", code, "--mailbox", mailbox_url)
        receiver = _cli(tmp_path, "receive", code, "--mailbox", mailbox_url)
        rc_r, _, err_r = _finish(receiver)
        received_after = time.monotonic() - start
        rc_s, _, err_s = _finish(sender)
        sent_after = time.monotonic() - start
        log.info("run %d: received after %.1f s, sent after %.1f s", run_no, received_after,
                 sent_after)  # fmt: skip
        print(f"run {run_no}: received after {received_after:.1f} s, sent after {sent_after:.1f} s")
        assert rc_r == 0 and rc_s == 0, err_r + err_s
        assert "(direct)" in err_r and "(direct)" in err_s, err_r + err_s
        for err in (err_r, err_s):
            assert "WARNING" not in err and "ERROR" not in err, err
        dest = f"dataset-{nameplate}" + ("-2" if run_no else "")
        assert f"Written to: {dest}/" in err_r, err_r
        assert pq.read_table(tmp_path / dest).num_rows == 200
        # A direct transfer of 200 rows takes about a second here; waiting on the
        # relay would add its connect timeout (tens of seconds).
        assert received_after < 20 and sent_after < 20
    assert os.environ.get(RELAY_ENV) is None


def test_receiving_bar_on_a_terminal_has_the_total_percent_and_eta(
    mailbox_url: str, tmp_path: Path
) -> None:
    """The sender announces its rows in the offer: the receiver's bar (stderr on a
    pseudo-terminal) shows percent, the total and an ETA, and sane rates from the
    first tick (the rate's clock starts with the transfer)."""
    import fcntl
    import pty
    import re
    import select
    import signal
    import struct
    import termios

    src = tmp_path / "src"
    src.mkdir()
    for i in range(4):
        ids = pa.array(range(i * 500_000, (i + 1) * 500_000), pa.int64())
        pq.write_table(
            pa.table({"id": ids, "x": pa.compute.multiply(ids, 3)}), src / f"{i}.parquet"
        )
    code = new_code()
    sender = _cli(tmp_path, "send", str(src), "--code", code, "--mailbox", mailbox_url)
    pid, fd = pty.fork()
    if pid == 0:  # the receiver, on a terminal of its own
        os.chdir(tmp_path)
        os.execve(OURS, [OURS, "receive", code, "--mailbox", mailbox_url, "-o", "got"], child_env())
    # A terminal of 120 columns (a new pty has 0, where tqdm draws nothing).
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    shown = b""
    status = None
    try:
        deadline = time.monotonic() + TIMEOUT
        while status is None and time.monotonic() < deadline:
            if select.select([fd], [], [], 0.05)[0]:
                try:
                    shown += os.read(fd, 65536)
                except OSError:
                    pass
            done, raw = os.waitpid(pid, os.WNOHANG)
            status = os.waitstatus_to_exitcode(raw) if done else None
    finally:
        if status is None:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        os.close(fd)
    rc, _, sent = _finish(sender)
    text = shown.decode(errors="replace")
    assert status == 0 and rc == 0, (text, sent)
    assert re.search(r"receiving:\s+100%\|", text), text
    assert "2.00M/2.00M" in text, text  # the total, from the offer
    assert re.search(r"\[\d\d:\d\d<\d\d:\d\d", text), text  # elapsed<ETA
    scale = {"": 1, "k": 1e3, "M": 1e6, "G": 1e9}
    rates = [float(n) * scale[u] for n, u in re.findall(r"([\d.]+)([kMG]?) rows/s", text)]
    assert rates and max(rates) < 2e8, rates  # was 1.53G rows/s on the first tick
    assert pq.read_table(tmp_path / "got").num_rows == 2_000_000


def test_yes_and_overwrite_as_croc(mailbox_url: str, tmp_path: Path) -> None:
    """`-y`/`--yes` accepts a file without asking; `--overwrite` replaces a dataset folder
    (only once the new one is complete: no file of the old one stays) and a file."""
    old = tmp_path / "got"
    old.mkdir()
    (old / "part-00009.parquet").write_text("an older dataset")
    src = tmp_path / "src"
    src.mkdir()
    pq.write_table(pa.table({"id": list(range(300))}), src / "a.parquet")
    code = new_code()
    sender = _cli(tmp_path, "send", str(src), "--code", code, "--mailbox", mailbox_url)
    receiver = _cli(tmp_path, "receive", code, "--mailbox", mailbox_url, "-o", "got",
                    "--overwrite")  # fmt: skip
    assert _finish(receiver)[0] == 0 and _finish(sender)[0] == 0
    assert sorted(p.name for p in old.iterdir()) == ["part-00000.parquet"]
    assert pq.read_table(old).column("id").to_pylist() == list(range(300))
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".got.")]

    (tmp_path / "note.txt").write_text("new text")
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "note.txt").write_text("old text")
    for flag in ("-y", "--yes"):
        code = new_code()
        sender = _cli(tmp_path, "send", "--classic", "note.txt", "--code", code,
                      "--mailbox", mailbox_url)  # fmt: skip
        receiver = _cli(tmp_path, "receive", code, "--mailbox", mailbox_url, flag,
                        "--overwrite", "-o", "in")  # fmt: skip
        rc, _, err = _finish(receiver)
        assert rc == 0 and _finish(sender)[0] == 0, err
        assert "ok?" not in err
        assert (tmp_path / "in" / "note.txt").read_text() == "new text"
