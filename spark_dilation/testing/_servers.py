"""Run the real mailbox server and transit relay in a subprocess."""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import spark_dilation

DEFAULT_READY_TIMEOUT = 30.0
DEFAULT_STOP_TIMEOUT = 10.0


@dataclass
class ServerProcess:
    """A ``python -m spark_dilation.servers`` subprocess that is listening."""

    mailbox_url: str
    relay_url: str
    mailbox_port: int
    relay_port: int
    process: subprocess.Popen[bytes] = field(repr=False, compare=False)
    stderr_path: Path = field(repr=False, compare=False)

    @classmethod
    def from_ready(
        cls, line: bytes, process: subprocess.Popen[bytes], stderr_path: Path
    ) -> ServerProcess:
        """From the ready line ``python -m spark_dilation.servers`` prints (JSON)."""
        info = json.loads(line)
        return cls(
            mailbox_url=info["mailbox_url"],
            relay_url=info["relay_url"],
            mailbox_port=int(info["mailbox_port"]),
            relay_port=int(info["relay_port"]),
            process=process,
            stderr_path=stderr_path,
        )

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def returncode(self) -> int | None:
        """The exit code once the process has ended (negative: killed by that signal)."""
        return self.process.poll()

    def is_running(self) -> bool:
        return self.process.poll() is None

    def stop(self, timeout: float = DEFAULT_STOP_TIMEOUT) -> int:
        """SIGTERM, wait up to ``timeout`` seconds, then SIGKILL. Returns the exit code."""
        self._signal(signal.SIGTERM)
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self._signal(signal.SIGKILL)
            self.process.wait()
        self._close_pipes()
        return self.process.returncode

    def kill(self) -> int:
        """SIGKILL the servers, as a crash would; returns once the process is gone."""
        self._signal(signal.SIGKILL)
        self.process.wait()
        self._close_pipes()
        return self.process.returncode

    def stderr_text(self) -> str:
        """Everything the servers wrote to stderr so far."""
        try:
            return self.stderr_path.read_text(errors="replace")
        except OSError:
            return ""

    def _signal(self, sig: signal.Signals) -> None:
        # Only signal a process we have not reaped yet: afterwards its pid (and
        # process group id) could belong to someone else.
        if self.process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, sig)

    def _close_pipes(self) -> None:
        if self.process.stdout is not None:
            self.process.stdout.close()


def server_command(
    *,
    interface: str,
    mailbox_port: int,
    relay_port: int,
    motd: str | None,
    signal_error: str | None,
    allow_list: bool,
    extra_args: Sequence[str],
) -> list[str]:
    cmd = [
        sys.executable,
        "-m",
        "spark_dilation.servers",
        "--interface",
        interface,
        "--mailbox-port",
        str(mailbox_port),
        "--relay-port",
        str(relay_port),
        "--ready-json",
    ]
    if motd is not None:
        cmd += ["--motd", motd]
    if signal_error is not None:
        cmd += ["--signal-error", signal_error]
    if not allow_list:
        cmd.append("--disallow-list")
    cmd += list(extra_args)
    return cmd


def _child_env() -> dict[str, str]:
    # Make the child import this very copy of spark_dilation, even when it is
    # used from a source tree that is not installed.
    env = dict(os.environ)
    source_root = str(Path(spark_dilation.__file__).resolve().parent.parent)
    existing = env.get("PYTHONPATH")
    env["PYTHONPATH"] = source_root + (os.pathsep + existing if existing else "")
    return env


def read_ready_line(proc: subprocess.Popen[bytes], deadline: float) -> bytes | None:
    """The first stdout line, or None on EOF or when the deadline passes."""
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    buf = bytearray()
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        while b"\n" not in buf:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not sel.select(remaining):
                return None
            chunk = os.read(fd, 4096)
            if not chunk:
                return None
            buf += chunk
    return bytes(buf.split(b"\n", 1)[0])


def wait_until_accepting(host: str, port: int, deadline: float) -> bool:
    while True:
        try:
            with socket.create_connection((host, port), timeout=1.0):
                return True
        except OSError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)


def start_server_process(
    *,
    mailbox_port: int = 0,
    relay_port: int = 0,
    motd: str | None = None,
    signal_error: str | None = None,
    allow_list: bool = True,
    interface: str = "127.0.0.1",
    timeout: float = DEFAULT_READY_TIMEOUT,
    extra_args: Sequence[str] = (),
) -> ServerProcess:
    """Start the servers and return once both ports accept connections.

    Prefer :func:`running_servers`, which also stops them. Raises
    ``RuntimeError`` (with the servers' stderr) if they do not come up within
    ``timeout`` seconds.
    """
    fd, stderr_name = tempfile.mkstemp(prefix="spark-dilation-servers-", suffix=".log")
    stderr_path = Path(stderr_name)
    try:
        with os.fdopen(fd, "wb") as stderr_file:
            proc = subprocess.Popen(
                server_command(
                    interface=interface,
                    mailbox_port=mailbox_port,
                    relay_port=relay_port,
                    motd=motd,
                    signal_error=signal_error,
                    allow_list=allow_list,
                    extra_args=extra_args,
                ),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=stderr_file,
                env=_child_env(),
                process_group=0,
            )
    except BaseException:
        stderr_path.unlink(missing_ok=True)
        raise

    servers: ServerProcess | None = None
    problem = "did not start"
    try:
        deadline = time.monotonic() + timeout
        line = read_ready_line(proc, deadline)
        if line is None:
            # EOF can come a moment before the exit: give the child time to finish.
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=2.0)
            if proc.poll() is not None:
                problem = f"exited with code {proc.returncode} before it was ready"
            else:
                problem = f"did not report ready within {timeout:g} s"
        else:
            servers = ServerProcess.from_ready(line, proc, stderr_path)
            host = "127.0.0.1" if interface in ("", "0.0.0.0", "::") else interface
            for port in (servers.mailbox_port, servers.relay_port):
                if not wait_until_accepting(host, port, deadline):
                    problem = f"reported ready but port {port} does not accept connections"
                    break
            else:
                return servers
    except BaseException:
        _discard(proc, stderr_path)
        raise

    stderr = stderr_path.read_text(errors="replace") if stderr_path.exists() else ""
    _discard(proc, stderr_path)
    raise RuntimeError(
        f"the wormhole servers ({' '.join(proc.args)}) {problem}; their stderr:\n{stderr}"
    )


def _discard(proc: subprocess.Popen[bytes], stderr_path: Path) -> None:
    dead = ServerProcess("", "", 0, 0, process=proc, stderr_path=stderr_path)
    dead.stop(timeout=5.0)
    stderr_path.unlink(missing_ok=True)


@contextlib.contextmanager
def running_servers(
    *,
    mailbox_port: int = 0,
    relay_port: int = 0,
    motd: str | None = None,
    signal_error: str | None = None,
    allow_list: bool = True,
    interface: str = "127.0.0.1",
    timeout: float = DEFAULT_READY_TIMEOUT,
    extra_args: Sequence[str] = (),
) -> Iterator[ServerProcess]:
    """Run a mailbox server and transit relay in a subprocess for the ``with`` block.

    Ports default to free ephemeral ones; pass the ports of a killed
    :class:`ServerProcess` to restart "the same" servers. The subprocess is
    stopped when the block exits, whatever happens inside it.
    """
    servers = start_server_process(
        mailbox_port=mailbox_port,
        relay_port=relay_port,
        motd=motd,
        signal_error=signal_error,
        allow_list=allow_list,
        interface=interface,
        timeout=timeout,
        extra_args=extra_args,
    )
    try:
        yield servers
    finally:
        servers.stop()
        servers.stderr_path.unlink(missing_ok=True)
