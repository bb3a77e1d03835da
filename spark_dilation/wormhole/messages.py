"""JSON messages of the mailbox server protocol (client <-> server).

Encoding matches magic-wormhole 0.24 (``wormhole/_rendezvous.py``): every
client message carries ``type`` and a random 2-byte hex ``id``; binary
bodies travel as hex strings.
"""

from __future__ import annotations

import json
import os
from typing import Any

from ..errors import WormholeError


class ProtocolError(WormholeError):
    """The mailbox server sent something that is not its protocol."""


def encode_client_message(mtype: str, **fields: Any) -> bytes:
    """One client-to-server WebSocket text frame."""
    fields["id"] = os.urandom(2).hex()
    fields["type"] = mtype
    return json.dumps(fields).encode("utf-8")


_REQUIRED: dict[str, tuple[tuple[str, type], ...]] = {
    "welcome": (("welcome", dict),),
    "ack": (),
    "allocated": (("nameplate", str),),
    "claimed": (("mailbox", str),),
    "released": (),
    "message": (("side", str), ("phase", str), ("body", str)),
    "closed": (),
    "nameplates": (("nameplates", list),),
    "pong": (),
    "error": (("error", str),),
}


def decode_server_message(payload: bytes | str) -> dict[str, Any]:
    """Parse and check one server-to-client frame; raises :class:`ProtocolError`."""
    try:
        msg = json.loads(payload)
    except (ValueError, UnicodeDecodeError) as e:
        raise ProtocolError(f"the mailbox server sent a frame that is not JSON: {e}") from e
    if not isinstance(msg, dict) or not isinstance(msg.get("type"), str):
        raise ProtocolError("the mailbox server sent a message without a type")
    for name, kind in _REQUIRED.get(msg["type"], ()):
        if not isinstance(msg.get(name), kind):
            raise ProtocolError(
                f"the mailbox server sent a {msg['type']!r} message with a bad {name!r} field"
            )
    if msg["type"] == "message":
        try:
            msg["body"] = bytes.fromhex(msg["body"])
        except ValueError as e:
            raise ProtocolError("the mailbox server sent a message body that is not hex") from e
    return msg
