"""Helpers for testing code that talks to Magic Wormhole servers.

``running_servers()`` runs the real mailbox server and transit relay in a
subprocess on ephemeral ports; ``TcpProxy`` sits between a client and a server
so a test can stall, break or refuse its connections. Pytest fixtures built on
these live in :mod:`spark_dilation.testing.fixtures`::

    pytest_plugins = ["spark_dilation.testing.fixtures"]

Needs the ``[server]`` extra; pytest is only needed for the fixtures.
"""

from spark_dilation.testing._proxy import TcpProxy, throttled_relay
from spark_dilation.testing._servers import ServerProcess, running_servers, start_server_process

__all__ = [
    "ServerProcess",
    "TcpProxy",
    "running_servers",
    "start_server_process",
    "throttled_relay",
]
