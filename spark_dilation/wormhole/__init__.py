"""Our client for the Magic Wormhole mailbox protocol.

``core`` is the sans-IO state machine, ``client`` the Twisted adapter with a
Deferred API, ``blocking`` a thread-safe facade for plain Python callers.
"""

from typing import Any

__all__ = ["DEFAULT_MAILBOX_URL", "Wormhole", "create"]


def __getattr__(name: str) -> Any:
    # The client loads Twisted and autobahn (~0.3 s); ``keys`` and ``core``
    # are pure and must not pay for it (the transfer protocol uses ``keys``).
    if name in __all__:
        from . import client

        return getattr(client, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
