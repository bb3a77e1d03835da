"""End to end: the ``spark-dilation`` CLI as a real subprocess, against real servers.

Every exchange runs real processes: ours and the reference ``wormhole`` CLI
(magic-wormhole 0.24) in both directions, on the mailbox server from
:mod:`spark_dilation.testing.fixtures`. Each test uses its own nameplates
because the session server is shared. Waits are bounded (``TIMEOUT``) so a hang
fails the test instead of blocking the run; nothing here asserts timing.
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import json
import os
import queue
import random
import re
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from spark_dilation.testing import ServerProcess
from spark_dilation.testing.waiting import wait_until
from spark_dilation.transit.offers import APPID

BIN = Path(sys.executable).parent
OURS = str(BIN / "spark-dilation")
REF = str(BIN / "wormhole")
TIMEOUT = 60.0
CODE_PREFIX = "Wormhole code is: "
ERROR_PREFIX = "spark-dilation: error: "

# Distinct nameplates for every code this module uses (the session server is
# shared, and a concurrent run of the suite must not collide with this one).
_nameplates = itertools.count(random.SystemRandom().randrange(10_000, 9_000_000, 1000))


def new_code(words: str = "guitarist-revenge") -> str:
    return f"{next(_nameplates)}-{words}"


def wrong_half(code: str) -> str:
    """The same nameplate with other words: a mistyped code."""
    nameplate, _, words = code.partition("-")
    other = "absurd-adroitness" if words != "absurd-adroitness" else "aardvark-adviser"
    return f"{nameplate}-{other}"


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("SPARK_DILATION_MAILBOX", None)
    env["PYTHONUTF8"] = "1"  # unicode arguments and output regardless of the locale
    return env


# --- running processes ----------------------------------------------------------


@dataclass
class Result:
    args: Sequence[str]
    returncode: int
    stdout: str
    stderr: str

    def describe(self) -> str:
        return (
            f"$ {' '.join(self.args)}\nexit code {self.returncode}\n"
            f"--- stdout ---\n{self.stdout}--- stderr ---\n{self.stderr}"
        )


def run(args: Sequence[str], stdin: str | None = None) -> Result:
    """Run to completion (bounded by TIMEOUT) and collect the output."""
    proc = subprocess.Popen(
        list(args),
        stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        encoding="utf-8",
        env=child_env(),
    )
    try:
        out, err = proc.communicate(stdin, timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(
            f"{' '.join(args)} did not finish within {TIMEOUT:g} s\n"
            f"--- stdout ---\n{out}--- stderr ---\n{err}"
        )
    return Result(list(args), proc.returncode, out, err)


class Running:
    """A process in the background whose stderr is read line by line as it streams."""

    def __init__(self, args: Sequence[str]) -> None:
        self.args = list(args)
        self.proc = subprocess.Popen(
            self.args,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            encoding="utf-8",
            env=child_env(),
        )
        self._stdout: list[str] = []
        self._stderr: list[str] = []
        # (time.monotonic() when read, line): when the process said what it said.
        self.stamped: list[tuple[float, str]] = []
        self._stderr_lines: queue.Queue[str | None] = queue.Queue()
        self._readers = [
            threading.Thread(target=self._read_stdout, daemon=True),
            threading.Thread(target=self._read_stderr, daemon=True),
        ]
        for reader in self._readers:
            reader.start()

    def _read_stdout(self) -> None:
        assert self.proc.stdout is not None
        self._stdout.append(self.proc.stdout.read())

    def _read_stderr(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.stamped.append((time.monotonic(), line))
            self._stderr.append(line)
            self._stderr_lines.put(line)
        self._stderr_lines.put(None)

    def _so_far(self) -> str:
        return f"$ {' '.join(self.args)}\n--- stderr so far ---\n{''.join(self._stderr)}"

    def wait_for_stderr(self, prefix: str) -> str:
        """The rest of the first stderr line that starts with ``prefix``."""
        deadline = time.monotonic() + TIMEOUT
        while True:
            try:
                line = self._stderr_lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                pytest.fail(f"no {prefix!r} line within {TIMEOUT:g} s\n{self._so_far()}")
            if line is None:
                self.proc.wait(TIMEOUT)
                pytest.fail(
                    f"exited ({self.proc.returncode}) without printing {prefix!r}\n"
                    + self._so_far()
                )
            if line.startswith(prefix):
                return line[len(prefix) :].strip()

    def wait_for_code(self) -> str:
        code = self.wait_for_stderr(CODE_PREFIX)
        assert re.fullmatch(r"\d+(-[a-z]+)+", code), code
        return code

    def finish(self) -> Result:
        """Wait for the exit (bounded by TIMEOUT) and collect the output."""
        try:
            self.proc.wait(TIMEOUT)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"did not finish within {TIMEOUT:g} s\n{self._so_far()}")
        for reader in self._readers:
            reader.join(TIMEOUT)
        return Result(self.args, self.proc.returncode, "".join(self._stdout), "".join(self._stderr))

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(TIMEOUT)


def wait_while_running(what: str, ready: Callable[[], object], *running: Running) -> None:
    """Wait for ``ready``; fail at once, with its output, if one of ``running`` exits first."""

    def exited() -> str | None:
        gone = [r for r in running if r.proc.poll() is not None]
        return f"exited first:\n{gone[0].finish().describe()}" if gone else None

    wait_until(what, ready, TIMEOUT, interval=0.01, stop_if=exited)


@pytest.fixture
def background() -> Iterator[Callable[[Sequence[str]], Running]]:
    """Factory for background processes; whatever is still running at teardown is killed."""
    started: list[Running] = []

    def start(args: Sequence[str]) -> Running:
        running = Running(args)
        started.append(running)
        return running

    yield start
    for running in started:
        running.kill()


def ours(mailbox: str, *args: str) -> list[str]:
    return [OURS, "--mailbox", mailbox, *args]


def ref(mailbox: str, *args: str) -> list[str]:
    return [REF, "--relay-url", mailbox, *args]


# --- assertions ---------------------------------------------------------------------


def assert_ok(result: Result) -> None:
    assert result.returncode == 0, result.describe()
    assert "Traceback" not in result.stderr, result.describe()


def assert_failed(result: Result, returncode: int | None = None) -> None:
    """Non-zero (or exactly ``returncode``) and no Python traceback."""
    if returncode is None:
        assert result.returncode != 0, result.describe()
    else:
        assert result.returncode == returncode, result.describe()
    assert "Traceback" not in result.stderr, result.describe()


def only_error_line(result: Result, returncode: int = 1) -> str:
    """Our CLI failed with exactly one line on stderr: the error. Returns its text."""
    assert_failed(result, returncode)
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.describe()
    assert lines[0].startswith(ERROR_PREFIX), result.describe()
    return lines[0]


def last_error_line(result: Result, returncode: int = 1) -> str:
    """Our CLI failed after printing its code banner: one error line, and it is the last."""
    assert_failed(result, returncode)
    lines = result.stderr.splitlines()
    errors = [line for line in lines if line.startswith(ERROR_PREFIX)]
    assert len(errors) == 1, result.describe()
    assert lines[-1] == errors[0], result.describe()
    return errors[0]


# --- a raw mailbox client (only to hold a nameplate claim) ------------------------


class RawMailboxClient:
    """Speaks the mailbox protocol frame by frame over a plain socket."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        assert parts.hostname and parts.port
        self.sock = socket.create_connection((parts.hostname, parts.port), timeout=TIMEOUT)
        key = base64.b64encode(os.urandom(16)).decode()
        self.sock.sendall(
            (
                f"GET {parts.path} HTTP/1.1\r\nHost: {parts.hostname}:{parts.port}\r\n"
                "Upgrade: websocket\r\nConnection: Upgrade\r\n"
                f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n"
            ).encode()
        )
        head = bytearray()
        while b"\r\n\r\n" not in head:
            head += self._recv_exact(1)
        assert b" 101 " in head.split(b"\r\n", 1)[0], bytes(head)

    def _recv_exact(self, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            chunk = self.sock.recv(n - len(buf))
            if not chunk:
                raise EOFError("the mailbox server closed the connection")
            buf += chunk
        return bytes(buf)

    def _send_frame(self, opcode: int, payload: bytes) -> None:
        header = bytearray([0x80 | opcode])
        if len(payload) < 126:
            header.append(0x80 | len(payload))
        elif len(payload) < 1 << 16:
            header += bytes([0x80 | 126]) + struct.pack("!H", len(payload))
        else:
            header += bytes([0x80 | 127]) + struct.pack("!Q", len(payload))
        mask = os.urandom(4)
        self.sock.sendall(
            bytes(header) + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
        )

    def send(self, **message: Any) -> None:
        self._send_frame(0x1, json.dumps(message).encode())

    def receive(self) -> dict[str, Any]:
        while True:
            b0, b1 = self._recv_exact(2)
            length = b1 & 0x7F
            if length == 126:
                (length,) = struct.unpack("!H", self._recv_exact(2))
            elif length == 127:
                (length,) = struct.unpack("!Q", self._recv_exact(8))
            payload = self._recv_exact(length)
            opcode = b0 & 0x0F
            if opcode == 0x1:
                return json.loads(payload)
            if opcode == 0x9:
                self._send_frame(0xA, payload)
            elif opcode == 0x8:
                raise EOFError("the mailbox server closed the WebSocket")

    def wait_for(self, predicate: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
        while True:
            message = self.receive()
            assert message["type"] != "error", message
            if predicate(message):
                return message

    def close(self) -> None:
        self.sock.close()


# --- 1. ours sends, the reference receives ---------------------------------------------

# The reference receiver prints repr(text)[1:-1]: printable non-ASCII stays as
# is, newlines and tabs show as backslash escapes.
REF_RENDERING = [
    pytest.param("hello", "hello", id="ascii"),
    pytest.param("héllo wörld ✓", "héllo wörld ✓", id="unicode"),
    pytest.param("two\nlines\tand it's", "two\\nlines\\tand it's", id="newline-tab-quote"),
]


@pytest.mark.parametrize(("text", "printed"), REF_RENDERING)
def test_ours_send_ref_receive(
    mailbox_url: str, background: Callable[..., Running], text: str, printed: str
) -> None:
    sender = background(ours(mailbox_url, "send", "--text", text))
    code = sender.wait_for_code()
    received = run(ref(mailbox_url, "receive", code))
    sent = sender.finish()

    assert_ok(received)
    assert received.stdout == printed + "\n", received.describe()
    assert_ok(sent)
    assert "text message sent" in sent.stderr, sent.describe()
    assert sent.stdout == "", sent.describe()


# --- 2. the reference sends, ours receives ---------------------------------------------

TEXTS = [
    pytest.param("hello", id="ascii"),
    pytest.param("héllo wörld ✓", id="unicode"),
    pytest.param("two\nlines\tand it's", id="newline-tab-quote"),
]


@pytest.mark.parametrize("text", TEXTS)
def test_ref_send_ours_receive(
    mailbox_url: str, background: Callable[..., Running], text: str
) -> None:
    sender = background(ref(mailbox_url, "send", "--text", text))
    code = sender.wait_for_code()
    received = run(ours(mailbox_url, "receive", code))
    sent = sender.finish()

    assert_ok(received)
    assert received.stdout == text + "\n", received.describe()
    assert received.stderr == "", received.describe()
    assert_ok(sent)


# --- 3. ours to ours -------------------------------------------------------------------


def test_ours_to_ours_with_a_chosen_code(
    mailbox_url: str, background: Callable[..., Running]
) -> None:
    code = new_code()
    text = "héllo wörld ✓\nsecond line"
    sender = background(ours(mailbox_url, "send", "--text", text, "--code", code))
    assert sender.wait_for_code() == code
    received = run(ours(mailbox_url, "receive", code))
    sent = sender.finish()

    assert_ok(received)
    assert received.stdout == text + "\n", received.describe()
    assert_ok(sent)


def test_ours_receive_reads_the_code_from_stdin(
    mailbox_url: str, background: Callable[..., Running]
) -> None:
    code = new_code()
    sender = background(ours(mailbox_url, "send", "--text", "via stdin", "--code", code))
    received = run(ours(mailbox_url, "receive"), stdin=code + "\n")
    sent = sender.finish()

    assert_ok(received)
    assert received.stdout == "via stdin\n", received.describe()
    assert_ok(sent)


@pytest.mark.parametrize(
    ("receiver", "printed"),
    [(ours, "piped line\n"), (ref, "piped line\\n\n")],
    ids=["ours-receives", "ref-receives"],
)
def test_text_from_stdin_keeps_its_newline_as_the_reference_does(
    mailbox_url: str, background: Callable[..., Running], receiver: Any, printed: str
) -> None:
    """`send --text -` sends stdin as it is, trailing newline included (as `wormhole send`
    does): the reference receiver shows it escaped; ours ends the line once, not twice."""
    code = new_code()
    received = background(receiver(mailbox_url, "receive", code))
    sent = run(ours(mailbox_url, "send", "--text", "-", "--code", code), stdin="piped line\n")
    got = received.finish()

    assert_ok(sent)
    assert "Reading text message from stdin.." in sent.stderr, sent.describe()
    assert_ok(got)
    assert got.stdout == printed, got.describe()


def test_ours_receive_without_any_code_fails(mailbox_url: str) -> None:
    result = run(ours(mailbox_url, "receive"), stdin="")
    assert "no code given" in only_error_line(result), result.describe()


# --- 4. wrong code -----------------------------------------------------------------------


def test_wrong_code_ours_send_ref_receive(
    mailbox_url: str, background: Callable[..., Running]
) -> None:
    sender = background(ours(mailbox_url, "send", "--text", "secret"))
    code = sender.wait_for_code()
    received = run(ref(mailbox_url, "receive", wrong_half(code)))
    sent = sender.finish()

    assert_failed(received)
    assert "Key confirmation failed" in received.stderr, received.describe()
    assert "secret" not in received.stdout, received.describe()
    assert "mistyped" in last_error_line(sent), sent.describe()


def test_wrong_code_ref_send_ours_receive(
    mailbox_url: str, background: Callable[..., Running]
) -> None:
    sender = background(ref(mailbox_url, "send", "--text", "secret"))
    code = sender.wait_for_code()
    received = run(ours(mailbox_url, "receive", wrong_half(code)))
    sent = sender.finish()

    assert "mistyped" in only_error_line(received), received.describe()
    assert received.stdout == "", received.describe()
    assert_failed(sent)
    assert "Key confirmation failed" in sent.stderr, sent.describe()


def test_wrong_code_ours_to_ours(mailbox_url: str, background: Callable[..., Running]) -> None:
    code = new_code()
    sender = background(ours(mailbox_url, "send", "--text", "secret", "--code", code))
    received = run(ours(mailbox_url, "receive", wrong_half(code)))
    sent = sender.finish()

    assert "mistyped" in only_error_line(received), received.describe()
    assert received.stdout == "", received.describe()
    assert "mistyped" in last_error_line(sent), sent.describe()


# --- 5. crowded nameplate ---------------------------------------------------------------


def test_third_client_on_a_nameplate_is_crowded_out(
    mailbox_url: str, background: Callable[..., Running]
) -> None:
    # Two sides hold the nameplate: our sender, and a raw client that claims it
    # and never answers (so neither side sees a peer message, and neither
    # releases the nameplate). Seeing the sender's PAKE message in the mailbox
    # proves the sender has claimed too, so the third claim must be refused.
    code = new_code()
    nameplate = code.split("-", 1)[0]
    sender = background(ours(mailbox_url, "send", "--text", "x", "--code", code))
    holder = RawMailboxClient(mailbox_url)
    try:
        holder.wait_for(lambda m: m["type"] == "welcome")
        holder.send(type="bind", appid=APPID, side="0123456789")
        holder.send(type="claim", nameplate=nameplate)
        claimed = holder.wait_for(lambda m: m["type"] == "claimed")
        holder.send(type="open", mailbox=claimed["mailbox"])
        holder.wait_for(lambda m: m["type"] == "message" and m["phase"] == "pake")

        third = run(ours(mailbox_url, "receive", code))
    finally:
        holder.close()
        sender.kill()

    line = only_error_line(third)
    assert "crowded" in line, third.describe()
    assert "new code" in line, third.describe()
    assert third.stdout == "", third.describe()


# --- 6. unreachable or wrong server ---------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


COMMANDS = [
    pytest.param(["send", "--text", "x"], id="send"),
    pytest.param(["receive", "5-guitarist-revenge"], id="receive"),
]


@pytest.mark.parametrize("command", COMMANDS)
def test_unreachable_mailbox(command: list[str]) -> None:
    result = run(ours(f"ws://127.0.0.1:{free_port()}/v1", *command))
    line = only_error_line(result)
    assert "could not connect" in line, result.describe()
    assert "spark-dilation serve" in line, result.describe()


class NotAWebSocketServer:
    """Accepts TCP connections, then answers 404 (or just hangs up)."""

    def __init__(self, answer: bytes) -> None:
        self.answer = answer
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen()
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            with conn, contextlib.suppress(OSError):
                if self.answer:
                    conn.settimeout(TIMEOUT)
                    conn.recv(65536)
                    conn.sendall(self.answer)

    def close(self) -> None:
        self.listener.close()


@pytest.mark.parametrize(
    "answer",
    [
        pytest.param(
            b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
            id="http-404",
        ),
        pytest.param(b"", id="hang-up"),
    ],
)
@pytest.mark.parametrize("command", COMMANDS)
def test_server_that_is_not_a_mailbox(answer: bytes, command: list[str]) -> None:
    server = NotAWebSocketServer(answer)
    try:
        result = run(ours(f"ws://127.0.0.1:{server.port}/v1", *command))
    finally:
        server.close()
    line = only_error_line(result)
    assert "could not connect" in line, result.describe()


# --- 7. welcome error ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "fresh_servers", [{"signal_error": "server is closed for maintenance"}], indirect=True
)
@pytest.mark.parametrize("command", COMMANDS)
def test_welcome_error_is_reported(fresh_servers: ServerProcess, command: list[str]) -> None:
    result = run(ours(fresh_servers.mailbox_url, *command))
    line = only_error_line(result)
    assert "server is closed for maintenance" in line, result.describe()


# --- 8. nobody uses the code ----------------------------------------------------------------


def test_send_gives_up_when_nobody_uses_the_code(mailbox_url: str) -> None:
    result = run(ours(mailbox_url, "send", "--text", "x", "--timeout", "2"))
    line = last_error_line(result)
    assert "nobody used the code" in line, result.describe()
    assert "--timeout" in line, result.describe()


def test_receive_gives_up_when_nobody_sends(mailbox_url: str) -> None:
    code = new_code()
    result = run(ours(mailbox_url, "receive", code, "--timeout", "2"))
    line = only_error_line(result)
    assert f"nobody used the code {code}" in line, result.describe()
    assert "--timeout" in line, result.describe()
    assert result.stdout == "", result.describe()


# --- 9. message of the day ------------------------------------------------------------------

MOTD = "Be kind to the relay ✓"


@pytest.mark.parametrize("fresh_servers", [{"motd": MOTD}], indirect=True)
def test_motd_is_shown_and_the_exchange_still_works(
    fresh_servers: ServerProcess, background: Callable[..., Running]
) -> None:
    url = fresh_servers.mailbox_url
    sender = background(ours(url, "send", "--text", "after the motd"))
    code = sender.wait_for_code()
    received = run(ours(url, "receive", code))
    sent = sender.finish()

    assert_ok(sent)
    assert MOTD in sent.stderr, sent.describe()
    # The motd comes before the code, so the user sees it first.
    assert sent.stderr.index(MOTD) < sent.stderr.index(CODE_PREFIX), sent.describe()
    assert_ok(received)
    assert MOTD in received.stderr, received.describe()
    assert received.stdout == "after the motd\n", received.describe()


# --- 10, 11. bad usage -------------------------------------------------------------------------


def test_send_without_text_is_a_usage_error(mailbox_url: str) -> None:
    result = run(ours(mailbox_url, "send"))
    assert_failed(result, 2)
    assert "--text" in result.stderr.splitlines()[-1], result.describe()


def test_code_with_spaces_is_refused(mailbox_url: str) -> None:
    result = run(ours(mailbox_url, "receive", "7 guitarist revenge"))
    line = only_error_line(result, returncode=1)
    assert "spaces" in line, result.describe()
    assert "7-guitarist-revenge" in line, result.describe()


@pytest.mark.parametrize("url", ["not-a-url", "http://127.0.0.1:4000/v1"])
def test_mailbox_that_is_not_a_url(url: str) -> None:
    result = run([OURS, "--mailbox", url, "receive", "5-guitarist-revenge"])
    line = only_error_line(result, returncode=2)
    assert "URL" in line, result.describe()
