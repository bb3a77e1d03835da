"""A blocking wormhole for plain Python callers (scripts, notebooks, Spark tasks).

The reactor runs in a background thread managed by crochet; every method
here may be called from any thread except the reactor's own.
"""

from __future__ import annotations

import contextlib
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


def wait_result(
    result: Any,
    timeout: float,
    on_timeout: Callable[[], BaseException],
    cleanup_grace: float = 2.0,
) -> Any:
    """Wait for a crochet ``EventualResult``; on timeout or Ctrl-C cancel it and claim it.

    Raises ``on_timeout()`` after ``timeout`` seconds. On ``KeyboardInterrupt``
    it lets the cancel's cleanup (closing a wormhole, a connection) run for up
    to ``cleanup_grace`` seconds, then re-raises. Either way the operation's
    eventual error is taken by :func:`claim`: an unclaimed one is printed by
    crochet with a traceback, after the command's last line.
    """
    try:
        return result.wait(timeout)
    except crochet.TimeoutError:
        claim(result)
        raise on_timeout() from None
    except KeyboardInterrupt:
        claim(result, cleanup_grace)
        raise


def claim(result: Any, grace: float = 0.0) -> None:
    """Cancel ``result``, let its cleanup run for ``grace`` seconds, and take whatever it
    ends with, now or later, silently."""
    result.cancel()
    with contextlib.suppress(Exception):
        result.wait(grace)
    # crochet logs an error nobody retrieved when the EventualResult is collected
    # (its __del__ reads this flag). A thread that waits to retrieve it loses the
    # race at interpreter exit, where the reactor's shutdown ends the cleanup and
    # collection follows at once (a CI run printed the traceback after the CLI's
    # last line); marking it claimed here cannot lose. crochet has no public call
    # for this; tests/test_dilation_blocking.py fails if the flag stops working.
    result._result_retrieved = True


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
        return crochet.run_in_reactor(fn)().wait(self.timeout)

    def _wait(self, fn: Any, timeout: float | None) -> Any:
        limit = self.timeout if timeout is None else timeout
        return wait_result(
            crochet.run_in_reactor(fn)(),
            limit,
            lambda: WormholeTimeout(f"no answer within {limit:g} seconds"),
        )


def _reactor() -> Any:
    from twisted.internet import reactor

    return reactor
