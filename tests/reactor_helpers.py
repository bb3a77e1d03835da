"""Run async test bodies on a crochet-managed reactor (shared by all tests)."""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import Any

import crochet
from twisted.internet import defer, task

from spark_dilation.wormhole.blocking import ensure_reactor

ensure_reactor()


def reactor_test(timeout: float = 90.0) -> Callable:
    """Decorate ``async def test_x(...)``: the body runs in the reactor thread."""

    def decorate(fn: Callable[..., Awaitable[Any]]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            @crochet.wait_for(timeout=timeout)
            def go() -> defer.Deferred:
                return defer.ensureDeferred(fn(*args, **kwargs))

            return go()

        return wrapper

    return decorate


def reactor() -> Any:
    from twisted.internet import reactor as r

    return r


def sleep(seconds: float) -> defer.Deferred:
    return task.deferLater(reactor(), seconds, lambda: None)


async def failure_of(d: defer.Deferred) -> BaseException:
    """Await ``d`` and return the exception it fails with (fail if it succeeds)."""
    try:
        result = await d
    except Exception as e:
        return e
    raise AssertionError(f"expected a failure, got {result!r}")
