"""Our client for the Magic Wormhole mailbox protocol.

``core`` is the sans-IO state machine, ``client`` the Twisted adapter with a
Deferred API, ``blocking`` a thread-safe facade for plain Python callers.
"""

from .client import DEFAULT_MAILBOX_URL, Wormhole, create

__all__ = ["DEFAULT_MAILBOX_URL", "Wormhole", "create"]
