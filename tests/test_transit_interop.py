"""Files and directories between our CLI and the reference ``wormhole`` CLI, for real.

Every test runs two real processes (ours and magic-wormhole 0.24, each in its
own working directory under ``tmp_path``) against the session's mailbox
server and transit relay. Both sides are always given the local relay
(``--relay`` / ``--transit-helper``): the machine has no route to the public
one. Waits are bounded (``TIMEOUT``) so a hang fails the test instead of
blocking the run; nothing here asserts timing.

Connection modes: ``direct`` (both sides listen: the direct hints win),
``relay-only`` (``--no-listen`` on both sides, so only the relay can join
them) and ``one-listens`` (only one side passes ``--no-listen``: both kinds
of hints are on offer, the listening side's direct hint is reachable).

Text messages both ways are covered by ``tests/test_cli.py``.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import random
import re
import subprocess
import sys
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent
OURS = str(BIN / "spark-dilation")
REF = str(BIN / "wormhole")
TIMEOUT = 90.0
ERROR_PREFIX = "spark-dilation: error: "
BIG = 5 * 1024 * 1024 + 12_345  # ~5 MiB, not a multiple of any record size

# Distinct nameplates for every code this module uses: the session server is
# shared, and a concurrent run of the suite must not collide with this one.
_nameplates = itertools.count(random.SystemRandom().randrange(10_000, 9_000_000, 1000))


def new_code() -> str:
    return f"{next(_nameplates)}-guitarist-revenge"


def child_env() -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SPARK_DILATION_", "WORMHOLE_", "_MAGIC_WORMHOLE_"))
    }
    env["PYTHONUTF8"] = "1"  # unicode file names and output regardless of the locale
    return env


# --- running a pair of processes ---------------------------------------------------


@dataclass
class Result:
    args: Sequence[str]
    cwd: Path
    returncode: int
    stdout: str
    stderr: str

    def describe(self) -> str:
        return (
            f"$ (cd {self.cwd} && {' '.join(self.args)})\nexit code {self.returncode}\n"
            f"--- stdout ---\n{self.stdout}--- stderr ---\n{self.stderr}"
        )


def _start(
    args: Sequence[str], cwd: Path, env: dict[str, str] | None = None
) -> subprocess.Popen[str]:
    cwd.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(
        list(args),
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        encoding="utf-8",
        errors="replace",
        env={**child_env(), **(env or {})},
    )


def _finish(proc: subprocess.Popen[str], cwd: Path) -> Result:
    try:
        out, err = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(
            f"$ (cd {cwd} && {' '.join(proc.args)}) did not finish within {TIMEOUT:g} s\n"
            f"--- stdout ---\n{out}--- stderr ---\n{err}"
        )
    return Result(list(proc.args), cwd, proc.returncode, out, err)


def run_pair(
    sender: Sequence[str],
    sender_cwd: Path,
    receiver: Sequence[str],
    receiver_cwd: Path,
    sender_env: dict[str, str] | None = None,
) -> tuple[Result, Result]:
    """Run both to completion, concurrently (each bounded by TIMEOUT): (sent, received)."""
    procs = [_start(sender, sender_cwd, sender_env), _start(receiver, receiver_cwd)]
    try:
        with ThreadPoolExecutor(2) as pool:
            sent = pool.submit(_finish, procs[0], sender_cwd)
            received = pool.submit(_finish, procs[1], receiver_cwd)
            return sent.result(), received.result()
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(TIMEOUT)


@dataclass
class Endpoints:
    mailbox: str
    relay: str


@pytest.fixture
def servers(wormhole_servers) -> Endpoints:
    assert wormhole_servers.is_running(), wormhole_servers.stderr_text()
    return Endpoints(wormhole_servers.mailbox_url, wormhole_servers.relay_url)


def ours_send(s: Endpoints, code: str, path: str, *extra: str) -> list[str]:
    return [
        OURS, "--mailbox", s.mailbox, "send", "--classic", "--relay", s.relay, "--code", code,
        *extra, path,
    ]  # fmt: skip


def ours_receive(s: Endpoints, code: str, *extra: str) -> list[str]:
    return [
        OURS,
        "--mailbox",
        s.mailbox,
        "receive",
        "--relay",
        s.relay,
        "--accept-file",
        *extra,
        code,
    ]


def ref_send(s: Endpoints, code: str, path: str, *extra: str) -> list[str]:
    return [
        REF,
        "--relay-url",
        s.mailbox,
        "--transit-helper",
        s.relay,
        "send",
        "--no-qr",
        "--hide-progress",
        "--code",
        code,
        *extra,
        path,
    ]


def ref_receive(s: Endpoints, code: str, *extra: str) -> list[str]:
    return [
        REF,
        "--relay-url",
        s.mailbox,
        "--transit-helper",
        s.relay,
        "receive",
        "--hide-progress",
        "--accept-file",
        *extra,
        code,
    ]


MODES = {
    # mode: (sender's extra flags, receiver's extra flags)
    "direct": ((), ()),
    "relay-only": (("--no-listen",), ("--no-listen",)),
    "one-listens": (("--no-listen",), ()),
}
EXPECTED_KIND = {"direct": "direct", "relay-only": "relay", "one-listens": "direct"}


# --- assertions ---------------------------------------------------------------------


def assert_ok(result: Result) -> None:
    assert result.returncode == 0, result.describe()
    assert "Traceback" not in result.stderr, result.describe()


def our_connection_kind(result: Result) -> str:
    """``direct`` or ``relay``: how our side says the transit connection was made."""
    kinds = re.findall(r"^(?:Sending|Receiving) \((direct|relay) ", result.stderr, re.M)
    assert len(kinds) == 1, result.describe()
    return kinds[0]


def ref_connection_line(result: Result) -> str:
    """The reference's ``Sending (...)``/``Receiving (...)`` transit description."""
    lines = re.findall(r"^(?:Sending|Receiving) \((?:->|<-).*\)\.\.$", result.stderr, re.M)
    assert len(lines) == 1, result.describe()
    return lines[0]


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def tree(root: Path) -> dict[str, bytes | None]:
    """Relative path -> contents (None for a directory) for everything under root."""
    found: dict[str, bytes | None] = {}
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        found[rel] = None if path.is_dir() else path.read_bytes()
    return found


def leftovers(directory: Path, expected: set[str]) -> set[str]:
    """Names in ``directory`` other than ``expected`` (e.g. hidden .partial files)."""
    return {p.name for p in directory.iterdir()} - expected


# --- payloads -------------------------------------------------------------------------

FILES = {
    "big": ("big.bin", BIG),
    "empty": ("empty.dat", 0),
    "unicode": ("héllo wörld ✓ résumé.txt", 70_001),
}


def make_file(directory: Path, kind: str) -> Path:
    name, size = FILES[kind]
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    path.write_bytes(os.urandom(size))
    return path


def make_tree(directory: Path, name: str = "my tree ✓") -> Path:
    root = directory / name
    (root / "a" / "b").mkdir(parents=True)
    (root / "empty subdir").mkdir()
    (root / "a" / "b" / "deeper-empty").mkdir()
    (root / "top.txt").write_text("top level\n")
    (root / "a" / "notes ü.md").write_text("# notes\n" * 100)
    (root / "a" / "b" / "blob.bin").write_bytes(os.urandom(300_000))
    (root / "a" / "b" / "zeros.bin").write_bytes(bytes(100_000))
    (root / "a" / "empty-file").write_bytes(b"")
    return root


# --- 1. the reference sends a file, ours receives ------------------------------------------

REF_TO_OURS = [
    pytest.param("big", "direct", id="big-direct"),
    pytest.param("big", "relay-only", id="big-relay-only"),
    pytest.param("big", "one-listens", id="big-one-listens"),
    pytest.param("empty", "direct", id="empty-direct"),
    pytest.param("unicode", "direct", id="unicode-name-direct"),
    pytest.param("unicode", "relay-only", id="unicode-name-relay-only"),
]


@pytest.mark.parametrize(("kind", "mode"), REF_TO_OURS)
def test_ref_sends_file_ours_receives(
    servers: Endpoints, tmp_path: Path, kind: str, mode: str
) -> None:
    src = make_file(tmp_path / "sender", kind)
    dest = tmp_path / "receiver"
    send_flags, receive_flags = MODES[mode]
    code = new_code()
    sent, received = run_pair(
        ref_send(servers, code, src.name, *send_flags),
        src.parent,
        ours_receive(servers, code, *receive_flags),
        dest,
    )

    assert_ok(received)
    assert_ok(sent)
    got = dest / src.name
    assert got.is_file(), received.describe()
    assert sha256(got) == sha256(src)
    assert got.stat().st_size == src.stat().st_size
    assert leftovers(dest, {src.name}) == set(), received.describe()
    assert f"Received file written to: {got}" in received.stderr, received.describe()
    assert "Confirmation received. Transfer complete." in sent.stderr, sent.describe()
    if kind != "empty":  # a zero-byte file is acknowledged without any record
        assert our_connection_kind(received) == EXPECTED_KIND[mode], received.describe()
        if mode == "relay-only":
            assert "relay:tcp:" in ref_connection_line(sent), sent.describe()


# --- 2. ours sends a file, the reference receives ------------------------------------------

OURS_TO_REF = [
    pytest.param("big", "direct", (), id="big-direct"),
    pytest.param("big", "direct", ("--classic",), id="big-direct-classic"),
    pytest.param("big", "relay-only", (), id="big-relay-only"),
    pytest.param("big", "relay-only", ("--classic",), id="big-relay-only-classic"),
    pytest.param("big", "one-listens", ("--classic",), id="big-one-listens-classic"),
    pytest.param("empty", "direct", (), id="empty-direct"),
    pytest.param("unicode", "direct", (), id="unicode-name-direct"),
]


@pytest.mark.parametrize(("kind", "mode", "classic"), OURS_TO_REF)
def test_ours_sends_file_ref_receives(
    servers: Endpoints, tmp_path: Path, kind: str, mode: str, classic: tuple[str, ...]
) -> None:
    src = make_file(tmp_path / "sender", kind)
    dest = tmp_path / "receiver"
    send_flags, receive_flags = MODES[mode]
    code = new_code()
    sent, received = run_pair(
        ours_send(servers, code, src.name, *classic, *send_flags),
        src.parent,
        ref_receive(servers, code, *receive_flags),
        dest,
    )

    assert_ok(received)
    assert_ok(sent)
    got = dest / src.name
    assert got.is_file(), received.describe()
    assert sha256(got) == sha256(src)
    assert {p.name for p in dest.iterdir()} == {src.name}, received.describe()
    assert f"File sent and confirmed (sha256 {sha256(src)[:16]}" in sent.stderr, sent.describe()
    if kind != "empty":
        assert our_connection_kind(sent) == EXPECTED_KIND[mode], sent.describe()
        if mode == "relay-only":
            assert "relay:tcp:" in ref_connection_line(received), received.describe()


# --- 3. directories both ways ---------------------------------------------------------------


@pytest.mark.parametrize("mode", ["direct", "relay-only"])
def test_ref_sends_directory_ours_receives(servers: Endpoints, tmp_path: Path, mode: str) -> None:
    src = make_tree(tmp_path / "sender")
    dest = tmp_path / "receiver"
    send_flags, receive_flags = MODES[mode]
    code = new_code()
    sent, received = run_pair(
        ref_send(servers, code, src.name, *send_flags),
        src.parent,
        ours_receive(servers, code, *receive_flags),
        dest,
    )

    assert_ok(received)
    assert_ok(sent)
    got = dest / src.name
    assert got.is_dir(), received.describe()
    assert tree(got) == tree(src)
    assert {p.name for p in dest.iterdir()} == {src.name}, received.describe()
    assert our_connection_kind(received) == EXPECTED_KIND[mode], received.describe()
    assert "Receiving directory" in received.stderr, received.describe()


@pytest.mark.parametrize(
    ("mode", "classic"),
    [
        pytest.param("direct", (), id="direct"),
        pytest.param("relay-only", ("--classic",), id="relay-only-classic"),
    ],
)
def test_ours_sends_directory_ref_receives(
    servers: Endpoints, tmp_path: Path, mode: str, classic: tuple[str, ...]
) -> None:
    src = make_tree(tmp_path / "sender")
    dest = tmp_path / "receiver"
    scratch = tmp_path / "sender-tmp"  # where our sender builds the zip
    scratch.mkdir()
    send_flags, receive_flags = MODES[mode]
    code = new_code()
    sent, received = run_pair(
        ours_send(servers, code, src.name, *classic, *send_flags),
        src.parent,
        ref_receive(servers, code, *receive_flags),
        dest,
        sender_env={"TMPDIR": str(scratch)},
    )

    assert_ok(received)
    assert_ok(sent)
    got = dest / src.name
    assert got.is_dir(), received.describe()
    assert tree(got) == tree(src)
    assert {p.name for p in dest.iterdir()} == {src.name}, received.describe()
    assert our_connection_kind(sent) == EXPECTED_KIND[mode], sent.describe()
    assert list(scratch.iterdir()) == [], "our sender left its temporary zip behind"


# --- 4. --output-file on ours --------------------------------------------------------------


def test_output_file_renames_a_received_file(servers: Endpoints, tmp_path: Path) -> None:
    src = make_file(tmp_path / "sender", "big")
    dest = tmp_path / "receiver"
    code = new_code()
    sent, received = run_pair(
        ref_send(servers, code, src.name),
        src.parent,
        ours_receive(servers, code, "-o", "sub dir/renamed ✓.bin"),
        dest,
    )

    assert_ok(received)
    assert_ok(sent)
    got = dest / "sub dir" / "renamed ✓.bin"
    assert sha256(got) == sha256(src)
    assert {p.name for p in dest.iterdir()} == {"sub dir"}, received.describe()
    assert {p.name for p in got.parent.iterdir()} == {got.name}, received.describe()


def test_output_file_renames_a_received_directory(servers: Endpoints, tmp_path: Path) -> None:
    src = make_tree(tmp_path / "sender")
    dest = tmp_path / "receiver"
    target = tmp_path / "elsewhere" / "renamed-tree"
    code = new_code()
    sent, received = run_pair(
        ref_send(servers, code, src.name),
        src.parent,
        ours_receive(servers, code, "--output-file", str(target)),
        dest,
    )

    assert_ok(received)
    assert_ok(sent)
    assert tree(target) == tree(src)
    assert {p.name for p in target.parent.iterdir()} == {target.name}, received.describe()
    assert list(dest.iterdir()) == [], received.describe()


def test_output_file_naming_an_existing_directory_saves_inside_it(
    servers: Endpoints, tmp_path: Path
) -> None:
    """As the reference does: ``-o DIR`` keeps the offered name, inside DIR."""
    src = make_file(tmp_path / "sender", "unicode")
    dest = tmp_path / "receiver"
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    code = new_code()
    sent, received = run_pair(
        ref_send(servers, code, src.name),
        src.parent,
        ours_receive(servers, code, "-o", str(inbox)),
        dest,
    )

    assert_ok(received)
    assert_ok(sent)
    assert sha256(inbox / src.name) == sha256(src)
    assert {p.name for p in inbox.iterdir()} == {src.name}, received.describe()


# --- 5. refusing to overwrite ----------------------------------------------------------------

PRECIOUS = b"precious data that must survive\n"


def assert_refused(received: Result, existing: Path) -> None:
    """Ours exited 1 with one clear error line, and the existing file is untouched."""
    assert received.returncode == 1, received.describe()
    lines = received.stderr.splitlines()
    assert len(lines) == 1, received.describe()
    assert lines[0].startswith(ERROR_PREFIX), received.describe()
    assert "refusing to overwrite" in lines[0], received.describe()
    assert str(existing) in lines[0], received.describe()
    assert existing.read_bytes() == PRECIOUS
    assert leftovers(existing.parent, {existing.name}) == set(), received.describe()


def test_ours_refuses_to_overwrite_and_ref_sender_is_told(
    servers: Endpoints, tmp_path: Path
) -> None:
    src = make_file(tmp_path / "sender", "big")
    dest = tmp_path / "receiver"
    dest.mkdir()
    existing = dest / src.name
    existing.write_bytes(PRECIOUS)
    code = new_code()
    sent, received = run_pair(
        ref_send(servers, code, src.name), src.parent, ours_receive(servers, code), dest
    )

    assert_refused(received, existing)
    assert sent.returncode != 0, sent.describe()
    assert "transfer abandoned" in sent.stderr, sent.describe()
    assert "file exists" in sent.stderr, sent.describe()


def test_ours_refuses_to_overwrite_output_file_and_our_sender_is_told(
    servers: Endpoints, tmp_path: Path
) -> None:
    src = make_file(tmp_path / "sender", "unicode")
    dest = tmp_path / "receiver"
    dest.mkdir()
    existing = dest / "already here.txt"
    existing.write_bytes(PRECIOUS)
    code = new_code()
    sent, received = run_pair(
        ours_send(servers, code, src.name),
        src.parent,
        ours_receive(servers, code, "-o", str(existing)),
        dest,
    )

    assert_refused(received, existing)
    assert sent.returncode == 1, sent.describe()
    errors = [line for line in sent.stderr.splitlines() if line.startswith(ERROR_PREFIX)]
    assert len(errors) == 1, sent.describe()
    assert "abandoned the transfer" in errors[0], sent.describe()
    assert "file exists" in errors[0], sent.describe()
    assert "Traceback" not in sent.stderr, sent.describe()


def test_ours_refuses_to_overwrite_an_existing_directory(
    servers: Endpoints, tmp_path: Path
) -> None:
    src = make_tree(tmp_path / "sender")
    dest = tmp_path / "receiver"
    (dest / src.name).mkdir(parents=True)
    existing = dest / src.name / "mine.txt"
    existing.write_bytes(PRECIOUS)
    code = new_code()
    sent, received = run_pair(
        ref_send(servers, code, src.name), src.parent, ours_receive(servers, code), dest
    )

    assert received.returncode == 1, received.describe()
    lines = received.stderr.splitlines()
    assert len(lines) == 1 and "refusing to overwrite" in lines[0], received.describe()
    assert tree(dest) == {src.name: None, f"{src.name}/mine.txt": PRECIOUS}
    assert sent.returncode != 0, sent.describe()
    assert "transfer abandoned" in sent.stderr, sent.describe()
