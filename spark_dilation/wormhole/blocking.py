"""A blocking wormhole for plain Python callers (scripts, notebooks, Spark tasks).

The reactor runs in a background thread managed by crochet; every method
here may be called from any thread except the reactor's own.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable
from typing import Any

import crochet

from ..errors import WormholeError
from .client import Wormhole

_setup_done = False


def ensure_reactor() -> None:
    """Start the crochet-managed reactor thread once per process."""
    global _setup_done
    if not _setup_done:
        crochet.setup()
        _setup_done = True


def call_soon(fn: Callable[..., Any], *args: Any) -> None:
    """Start ``fn(*args)`` (may return a Deferred) in the reactor; do not wait for it.

    Its end, error included, is dropped. crochet's ``run_in_reactor`` is for
    calls that are waited for: an EventualResult nobody keeps logs
    "Unhandled error in EventualResult" when the call ends, even on success.
    """
    from twisted.internet import defer, reactor

    ensure_reactor()
    reactor.callFromThread(lambda: defer.maybeDeferred(fn, *args).addErrback(lambda _: None))


def run_and_wait(
    fn: Callable[..., Any],
    *args: Any,
    timeout: float,
    on_timeout: Callable[[], BaseException],
    cleanup_grace: float = 2.0,
) -> Any:
    """Run ``fn(*args)`` (may return a Deferred) in the reactor and wait for its result.

    Raises ``on_timeout()`` after ``timeout`` seconds. On ``KeyboardInterrupt``
    it cancels the call, lets its cleanup (closing a wormhole, a connection)
    run for up to ``cleanup_grace`` seconds, then re-raises. Either way the
    call's eventual error is taken by :func:`claim`: an unclaimed one is
    printed by crochet with a traceback, after the command's last line. For
    the same reason a Ctrl-C or SIGTERM that arrives before the wait has begun
    (inside crochet's bookkeeping) is held and raised inside it.
    """
    ensure_reactor()
    held = _HeldSignals()
    try:
        result = crochet.run_in_reactor(fn)(*args)
    except BaseException:
        held.release()
        raise
    try:
        held.release()
        return result.wait(timeout)
    except crochet.TimeoutError:
        claim(result)
        raise on_timeout() from None
    except KeyboardInterrupt:
        claim(result, cleanup_grace)
        raise


class _HeldSignals:
    """From creation to :meth:`release`, SIGINT, SIGTERM and SIGHUP for a Python handler are
    recorded instead of run; ``release`` puts the handlers back and runs them for
    what arrived (in the main thread; elsewhere signals do not arrive anyway)."""

    def __init__(self) -> None:
        self._got: list[tuple[int, Any]] = []
        self._handlers: dict[int, Callable[..., Any]] = {}
        self._released = False
        if threading.current_thread() is not threading.main_thread():
            return
        for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            handler = signal.getsignal(s)
            if callable(handler):
                self._handlers[s] = handler
                signal.signal(s, self._record)

    def _record(self, signum: int, frame: Any) -> None:
        if self._released:  # still installed: release() was cut short by a signal
            self._handlers[signum](signum, frame)
            return
        self._got.append((signum, frame))

    def release(self) -> None:
        # signal.signal() runs the handlers of pending signals first, so a restore
        # may raise (KeyboardInterrupt) and leave a later handler ours: it then acts
        # as the original one.
        self._released = True
        for s, handler in self._handlers.items():
            signal.signal(s, handler)
        got, self._got = self._got, []
        for signum, frame in got:
            signal.getsignal(signum)(signum, frame)  # may raise KeyboardInterrupt


def claim(result: Any, grace: float = 0.0) -> None:
    """Cancel ``result``, let its cleanup run for ``grace`` seconds, and take whatever it
    ends with, now or later, silently."""
    result.cancel()
    with contextlib.suppress(Exception):
        result.wait(grace)
    # crochet logs an error nobody retrieved in two places: when the EventualResult
    # is collected holding one (its __del__ reads this flag), and when the operation
    # fails after the EventualResult was collected (nothing to read the flag on). A
    # thread that waits to retrieve it loses the race at interpreter exit (a CI run
    # printed the traceback after the CLI's last line); marking it claimed and
    # keeping it until its operation ends cannot lose. crochet has no public call
    # for this; tests/test_dilation_blocking.py fails if the flag stops working.
    result._result_retrieved = True
    with _claimed_lock:
        _claimed[:] = [r for r in _claimed if not r._result_set.is_set()]
        if not result._result_set.is_set():
            _claimed.append(result)


# Claimed results whose operation has not ended yet (see claim()).
_claimed: list[Any] = []
_claimed_lock = threading.Lock()


class WormholeTimeout(WormholeError, TimeoutError):
    """A blocking call waited longer than its timeout."""


class BlockingWormhole:
    """Blocking twin of :class:`~spark_dilation.wormhole.client.Wormhole`.

    ``timeout`` (seconds) is the default wait of each call; the wormhole's
    own ``peer_timeout`` bounds the wait for the other side as a whole.
    """

    def __init__(
        self,
        appid: str,
        mailbox_url: str,
        *,
        app_versions: dict[str, Any] | None = None,
        versions: dict[str, Any] | None = None,
        peer_timeout: float | None = None,
        timeout: float = 120.0,
    ) -> None:
        ensure_reactor()
        self.timeout = timeout
        self._w: Wormhole = self._call(
            lambda: Wormhole(
                appid,
                mailbox_url,
                _reactor(),
                app_versions=app_versions,
                versions=versions,
                timeout=peer_timeout,
            )
        )

    @property
    def wormhole(self) -> Wormhole:
        """The underlying reactor-side object (use only from the reactor thread)."""
        return self._w

    def allocate_code(self, code_length: int = 2) -> str:
        self._call(lambda: self._w.allocate_code(code_length))
        return self.get_code()

    def set_code(self, code: str) -> None:
        self._call(lambda: self._w.set_code(code))

    def get_code(self, timeout: float | None = None) -> str:
        return self._wait(self._w.get_code, timeout)

    def get_welcome(self, timeout: float | None = None) -> dict[str, Any]:
        return self._wait(self._w.get_welcome, timeout)

    def get_verifier(self, timeout: float | None = None) -> bytes:
        return self._wait(self._w.get_verifier, timeout)

    def get_versions(self, timeout: float | None = None) -> dict[str, Any]:
        return self._wait(self._w.get_versions, timeout)

    def send_message(self, plaintext: bytes) -> None:
        self._call(lambda: self._w.send_message(plaintext))

    def get_message(self, timeout: float | None = None) -> bytes:
        return self._wait(self._w.get_message, timeout)

    def derive_key(self, purpose: str, length: int) -> bytes:
        return self._call(lambda: self._w.derive_key(purpose, length))

    def list_nameplates(self, timeout: float | None = None) -> list[str]:
        return self._wait(self._w.list_nameplates, timeout)

    def close(self, timeout: float | None = None) -> None:
        self._wait(self._w.close, timeout)

    def __enter__(self) -> BlockingWormhole:
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.close()
        except WormholeError:
            if exc[0] is None:
                raise

    # --- helpers ---

    def _call(self, fn: Any) -> Any:
        return self._wait(fn, None)

    def _wait(self, fn: Any, timeout: float | None) -> Any:
        limit = self.timeout if timeout is None else timeout
        return run_and_wait(
            fn,
            timeout=limit,
            on_timeout=lambda: WormholeTimeout(f"no answer within {limit:g} seconds"),
        )


def _reactor() -> Any:
    from twisted.internet import reactor

    return reactor
