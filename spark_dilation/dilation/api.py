"""The public Dilation API: ``dilate(wormhole)`` and what it returns.

Mirrors the reference's ``DilatedWormhole`` so Twisted code ports easily::

    w = Wormhole(appid, mailbox_url, reactor, dilation=True)
    ...
    dw = dilate(w, relay_url="tcp:relay.example:4001")
    await dw.when_dilated()
    proto = await dw.connector_for("my-proto").connect(factory)   # opens a subchannel
    port = await dw.listener_for("my-proto").listen(factory)      # accepts them
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from twisted.internet import defer

from .manager import DilationManager, DilationReconnectFailed, DilationStatus
from .redial import DEFAULT_GIVE_UP_AFTER, DEFAULT_NO_PATH_TIMEOUT
from .subchannel import SubchannelConnectorEndpoint, SubchannelListenerEndpoint


class DilatedWormhole:
    def __init__(self, manager: DilationManager) -> None:
        self._manager = manager

    def when_dilated(self) -> defer.Deferred:
        """Fires at the first L2 connection (fails if the peer cannot dilate)."""
        return self._manager.when_dilated()

    def listener_for(self, subprotocol: str) -> SubchannelListenerEndpoint:
        return SubchannelListenerEndpoint(self._manager, subprotocol)

    def connector_for(self, subprotocol: str) -> SubchannelConnectorEndpoint:
        return SubchannelConnectorEndpoint(self._manager, subprotocol)

    def status(self) -> DilationStatus:
        """A snapshot: role, generation, state, connection, retries while down."""
        return self._manager.status()

    def failure(self) -> DilationReconnectFailed | None:
        """The error reconnecting was given up with (``reconnect_timeout``), or None."""
        return self._manager.failure()

    @property
    def reconnect_timeout(self) -> float:
        return self._manager.reconnect_timeout

    def stop(self) -> defer.Deferred:
        return self._manager.stop()


def dilate(
    wormhole: Any,
    *,
    relay_url: str | None = None,
    no_listen: bool = False,
    listen_addresses: list[str] | None = None,
    ping_interval: float | None = None,
    expected_subprotocols: list[str] | tuple[str, ...] = (),
    on_status: Callable[[DilationStatus], None] | None = None,
    reconnect_timeout: float = DEFAULT_GIVE_UP_AFTER,
    no_path_timeout: float = DEFAULT_NO_PATH_TIMEOUT,
) -> DilatedWormhole:
    """Start Dilation on a wormhole created with ``dilation=True`` (once per wormhole).

    The connection reconnects by itself; when no path works, it retries with
    capped backoff (a Leader starts new generations, a Follower redials).
    ``reconnect_timeout``: seconds without a connection (since it was lost, or
    since the first attempt) before every subchannel and waiter fails with
    :class:`~.manager.DilationReconnectFailed`. ``no_path_timeout``: a
    connection never up whose every attempt failed gives up this many seconds
    after the first round failed (see :mod:`.redial`), with one line naming
    each hint tried.
    """
    return wormhole.dilate(
        reconnect_timeout=reconnect_timeout,
        no_path_timeout=no_path_timeout,
        relay_url=relay_url,
        no_listen=no_listen,
        listen_addresses=listen_addresses,
        ping_interval=ping_interval,
        expected_subprotocols=expected_subprotocols,
        on_status=on_status,
    )
