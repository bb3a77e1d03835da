"""Ctrl-C, SIGTERM and SIGHUP in the ``spark-dilation`` command: stop, tell the peer, one line.

The first SIGINT, SIGTERM or SIGHUP raises :class:`~spark_dilation.errors.Interrupted`
(a ``KeyboardInterrupt`` naming the signal) in the main thread, so the same
code paths as a Ctrl-C in the Python API run: the transfer cuts what is
under way, tells the other side, removes what it staged, and the command
prints one line and exits 130 (SIGINT), 143 (SIGTERM) or 129 (SIGHUP; the
line may have no terminal left to go to). A second signal
while that runs exits at once (:func:`exit_now`). The terminal's settings
are saved at the start and put back on the way out, as a code prompt (read
by another thread) may have changed them.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from .errors import Interrupted

# SIGHUP (the terminal closed) ends a transfer as SIGTERM does: told, cleaned up.
CAUSES = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM", signal.SIGHUP: "SIGHUP"}
EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143, signal.SIGHUP: 129}

_first: int | None = None
_tty: Any = None  # termios attributes of stdin, when it is a terminal
_at_once: list[Callable[[], None]] = []  # quick local cleanups even a second signal runs


def install() -> None:
    """Take over SIGINT, SIGTERM and SIGHUP for the rest of the command (main thread only)."""
    global _tty, _first
    _first = None
    with contextlib.suppress(ImportError, OSError, ValueError):
        import termios

        if sys.stdin is not None and sys.stdin.isatty():
            _tty = termios.tcgetattr(sys.stdin.fileno())
    for signum in CAUSES:
        signal.signal(signum, _handle)


def _handle(signum: int, frame: Any) -> None:
    global _first
    if _first is not None:
        print("spark-dilation: interrupted again: exiting now", file=sys.stderr)
        exit_now(EXIT_CODES[signum])
    _first = signum
    raise Interrupted(CAUSES[signal.Signals(signum)])


def also_on_exit_now(cleanup: Callable[[], None]) -> None:
    """Run ``cleanup`` (quick, local: remove a staging folder) even on a second signal."""
    _at_once.append(cleanup)


def exit_code() -> int:
    """The exit code for the signal that stopped us (130 if it was a plain Ctrl-C)."""
    return EXIT_CODES.get(signal.Signals(_first), 130) if _first is not None else 130


def restore_terminal() -> None:
    if _tty is None:
        return
    with contextlib.suppress(ImportError, OSError, ValueError):
        import termios

        termios.tcsetattr(sys.stdin.fileno(), termios.TCSADRAIN, _tty)


def exit_soon(code: int, grace: float = 2.0) -> None:
    """Exit with ``code`` after ``grace`` seconds even if the normal exit hangs.

    The normal exit closes what is still open (the reactor, connections); a
    thread blocked where nothing can stop it (an ``ok?`` prompt read on the
    reactor's thread) would keep the process alive for ever.
    """

    def watchdog() -> None:
        time.sleep(grace)
        exit_now(code)  # quietly: the command's last line is already out

    threading.Thread(target=watchdog, name="exit-watchdog", daemon=True).start()


def exit_now(code: int) -> None:
    """Leave at once: output flushed, terminal restored, no waiting for threads."""
    for cleanup in _at_once:
        with contextlib.suppress(Exception):
            cleanup()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    restore_terminal()
    os._exit(code)
