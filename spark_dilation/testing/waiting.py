"""One way for a test to wait: for a named condition, with a deadline.

A test that sleeps and hopes is slow when it guesses long and flaky when it
guesses short. :func:`wait_until` returns as soon as the condition holds and,
when the deadline passes, fails with what it waited for, how long, and any
details the caller can give (a log's tail, the processes still running).
"""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["wait_until"]


def wait_until(
    what: str,
    ready: Callable[[], object],
    timeout: float,
    *,
    interval: float = 0.05,
    stop_if: Callable[[], str | None] | None = None,
    details: Callable[[], str] | None = None,
) -> float:
    """Seconds until ``ready()`` was true.

    Raises ``AssertionError`` naming ``what`` when ``timeout`` seconds pass, or
    at once when ``stop_if()`` returns a reason (e.g. the process that should
    get there exited); ``details()`` is appended to either message.
    """
    started = time.monotonic()
    deadline = started + timeout
    while not ready():
        reason = stop_if() if stop_if is not None else None
        if reason is None and time.monotonic() >= deadline:
            reason = f"not within {timeout:g} s"
        if reason is not None:
            more = details() if details is not None else ""
            raise AssertionError(f"waited for {what}: {reason}" + (f"\n{more}" if more else ""))
        time.sleep(interval)
    return time.monotonic() - started
