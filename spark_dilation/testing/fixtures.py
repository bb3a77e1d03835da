"""Pytest fixtures for Magic Wormhole servers and misbehaving networks.

Enable them with ``pytest_plugins = ["spark_dilation.testing.fixtures"]``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from spark_dilation.testing import ServerProcess, TcpProxy, running_servers

__all__ = ["fresh_servers", "mailbox_url", "relay_url", "tcp_proxy", "wormhole_servers"]


@pytest.fixture(scope="session")
def wormhole_servers() -> Iterator[ServerProcess]:
    """Mailbox server and transit relay shared by the whole session.

    Do not kill or stop them; use ``fresh_servers`` for that.
    """
    with running_servers() as servers:
        yield servers


def _alive(servers: ServerProcess) -> ServerProcess:
    if not servers.is_running():
        pytest.fail(
            f"the session's wormhole servers exited (code {servers.returncode}); a test "
            "that kills or stops servers must use the fresh_servers fixture. Their stderr:\n"
            + servers.stderr_text()
        )
    return servers


@pytest.fixture
def mailbox_url(wormhole_servers: ServerProcess) -> str:
    """``ws://127.0.0.1:PORT/v1`` of the session's mailbox server."""
    return _alive(wormhole_servers).mailbox_url


@pytest.fixture
def relay_url(wormhole_servers: ServerProcess) -> str:
    """``tcp:127.0.0.1:PORT`` of the session's transit relay."""
    return _alive(wormhole_servers).relay_url


@pytest.fixture
def fresh_servers(request: pytest.FixtureRequest) -> Iterator[ServerProcess]:
    """Servers for this test alone, free to be killed.

    Options for :func:`running_servers` can be passed by indirect
    parametrization: ``@pytest.mark.parametrize("fresh_servers",
    [{"motd": "hi"}], indirect=True)``.
    """
    options: dict[str, Any] = getattr(request, "param", None) or {}
    with running_servers(**options) as servers:
        yield servers


@pytest.fixture
def tcp_proxy() -> Iterator[Callable[[str, int], TcpProxy]]:
    """Factory ``tcp_proxy(host, port) -> TcpProxy``; every proxy is closed at teardown."""
    proxies: list[TcpProxy] = []

    def make(host: str, port: int) -> TcpProxy:
        proxy = TcpProxy(host, port)
        proxies.append(proxy)
        return proxy

    yield make
    for proxy in proxies:
        proxy.close()
