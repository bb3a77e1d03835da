"""Twisted adapter of :class:`~.standing.StandingMailbox`: the socket, reconnects, close.

Every decision is the core's; this owns the WebSocket (the same service as a
wormhole's, :func:`~.client.mailbox_service`), hands each message to
``on_posted`` and keeps reconnecting until :meth:`stop` or :meth:`close`. An
unreachable server is not fatal here: a stream waits for it, and its own
deadline says when to give up (``is_connected`` tells its progress).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from twisted.internet import defer

from ..errors import WormholeError
from .client import CLOSE_TIMEOUT, mailbox_service
from .core import Closed, SendFrame, StopConnection
from .standing import GotPosted, Out, StandingMailbox

log = logging.getLogger(__name__)


class StandingClient:
    def __init__(
        self,
        appid: str,
        url: str,
        reactor: Any,
        side: str,
        nameplate: str,
        on_posted: Callable[[GotPosted], None],
        on_failed: Callable[[WormholeError], None] | None = None,
    ) -> None:
        self._reactor, self._url = reactor, url
        self._core = StandingMailbox(appid, side, nameplate)
        self._on_posted, self._on_failed = on_posted, on_failed
        self._ws: Any = None
        self._stopping = False
        self._closed: defer.Deferred = defer.Deferred()
        self._service = mailbox_service(reactor, url, self)

    @property
    def is_connected(self) -> bool:
        return self._ws is not None

    def post(self, phase: str, body: bytes) -> None:
        self._feed(self._core.post(phase, body))

    def keep(self, phase: str, body: bytes) -> None:
        self._feed(self._core.keep(phase, body))

    def stop(self) -> defer.Deferred:
        """Drop the connection and keep everything on the server (a run that ends)."""
        self._stopping = True
        if self._ws is not None:
            self._ws.sendClose()
        return defer.maybeDeferred(self._service.stopService)

    def close(self, mood: str = "happy") -> defer.Deferred:
        """Give up the nameplate and mailbox (the pairing ends); fires when the server
        confirmed, or after ``CLOSE_TIMEOUT`` without it."""
        self._feed(self._core.close(mood))
        timer = self._reactor.callLater(CLOSE_TIMEOUT, self._give_up_close)
        self._closed.addBoth(lambda r: (timer.cancel() if timer.active() else None, r)[1])
        return self._closed

    # --- the service's calls (see mailbox_service) ----------------------------------------

    def _ws_open(self, proto: Any) -> None:
        if self._stopping:
            proto.sendClose()
            return
        self._ws = proto
        self._feed(self._core.connection_made())

    def _ws_frame(self, payload: bytes) -> None:
        self._feed(self._core.frame_received(payload))

    def _ws_closed(self, proto: Any, reason: str) -> None:
        if self._ws is proto:
            self._ws = None
            self._feed(self._core.connection_lost())
            if not self._stopping:
                log.info("lost the standing mailbox connection (%s); reconnecting", reason)

    # --- plumbing ----------------------------------------------------------------------------

    def _feed(self, events: list[Out]) -> None:
        for event in events:
            if isinstance(event, SendFrame):
                self._ws.sendMessage(event.payload, isBinary=False)
            elif isinstance(event, GotPosted):
                self._on_posted(event)
            elif isinstance(event, StopConnection):
                self._reactor.callLater(0, self.stop)
            elif isinstance(event, Closed):
                if event.error is not None and self._on_failed is not None:
                    self._on_failed(event.error)
                if not self._closed.called:
                    self._closed.callback(event.error)

    def _give_up_close(self) -> None:
        if not self._closed.called:
            log.info("the mailbox server did not confirm the standing mailbox's close")
            self.stop()
            self._closed.callback(None)
