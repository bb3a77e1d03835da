"""A command on a pseudo-terminal, as a user at a terminal runs it.

Tests of what a terminal shows (progress bars, the code prompt, Ctrl-C and
Ctrl-D typed at it) and the prompt benchmark start commands this way::

    term = Terminal([sys.executable, "-m", "spark_dilation.cli", "receive"])
    term.start()
    term.wait_for("Enter receive wormhole code: ", timeout=30)
    term.type(b"\\x03")  # Ctrl-C
    status = term.wait(30)

What the command writes is kept with the time it arrived (:attr:`shown`).
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
from collections.abc import Mapping, Sequence


class Terminal:
    """``argv`` on a terminal of its own (``rows`` x ``columns``), with ``env``."""

    def __init__(
        self,
        argv: Sequence[str],
        env: Mapping[str, str] | None = None,
        *,
        rows: int = 40,
        columns: int = 160,
    ) -> None:
        self.argv = list(argv)
        self.env = dict(os.environ if env is None else env)
        self.size = (rows, columns)
        self.shown: list[tuple[float, str]] = []
        self.status: int | None = None
        self._cond = threading.Condition()

    def start(self) -> Terminal:
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: the command, its stdio on the terminal
            os.execve(self.argv[0], self.argv, self.env)
        fcntl.ioctl(self.fd, termios.TIOCSWINSZ, struct.pack("HHHH", *self.size, 0, 0))
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        return self

    def _read(self) -> None:
        while True:
            if not select.select([self.fd], [], [], 0.05)[0]:
                continue
            try:
                chunk = os.read(self.fd, 65536)
            except OSError:  # the child closed the terminal (exited)
                chunk = b""
            with self._cond:
                if chunk:
                    self.shown.append((time.monotonic(), chunk.decode(errors="replace")))
                self._cond.notify_all()
            if not chunk:
                return

    def text(self) -> str:
        with self._cond:
            return "".join(chunk for _, chunk in self.shown)

    def pieces(self) -> list[tuple[float, str]]:
        """Each line or redraw (a bar redraws after a carriage return), with its time."""
        with self._cond:
            shown = list(self.shown)
        return [(t, p) for t, chunk in shown for p in re.split(r"[\r\n]+", chunk) if p.strip()]

    def wait_for(self, text: str, timeout: float) -> float:
        """The time (``time.monotonic()``) ``text`` was first shown, waiting up to
        ``timeout``; AssertionError if it was not (or the command ended first)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                seen = ""
                for at, chunk in self.shown:
                    seen += chunk
                    if text in seen:
                        return at
                if not self._reader.is_alive() or time.monotonic() > deadline:
                    raise AssertionError(f"{text!r} not shown by {self.argv}: {seen[-500:]!r}")
                self._cond.wait(0.05)

    def type(self, keys: bytes) -> None:
        os.write(self.fd, keys)

    def wait(self, timeout: float) -> int:
        """The exit status (``os.waitstatus_to_exitcode``); killed after ``timeout``
        with AssertionError."""
        deadline = time.monotonic() + timeout
        while self.status is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.status = os.waitstatus_to_exitcode(status)
                self._close()
                break
            if time.monotonic() > deadline:
                self.kill()
                raise AssertionError(
                    f"{self.argv} still running after {timeout:g} s:\n{self.text()}"
                )
            time.sleep(0.02)
        return self.status

    def kill(self) -> None:
        """SIGKILL, if it still runs, and close the terminal."""
        if self.status is None:
            os.kill(self.pid, signal.SIGKILL)
            self.status = os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1])
        self._close()

    def _close(self) -> None:
        self._reader.join(5)  # it reads what the command wrote last, up to the close
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
