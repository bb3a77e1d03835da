"""File-transfer v1 application messages (the standard ``wormhole send``).

The reference CLI (``wormhole/cli/cmd_send.py``, ``cmd_receive.py``) speaks
these JSON dicts as wormhole application messages under the app id below:
a text is ``{"offer": {"message": TEXT}}`` answered by
``{"answer": {"message_ack": "ok"}}``; either side may send
``{"error": TEXT}`` to abandon the transfer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ..errors import PeerRejectedError, TransferError

APPID = "lothar.com/wormhole/text-or-file-xfer"


@dataclass(frozen=True)
class TextOffer:
    message: str


@dataclass(frozen=True)
class UnsupportedOffer:
    """An offer kind we cannot take (yet): files, directories, unknown."""

    kind: str
    details: dict[str, Any]


@dataclass(frozen=True)
class Answer:
    fields: dict[str, Any]

    @property
    def text_acknowledged(self) -> bool:
        return self.fields.get("message_ack") == "ok"


@dataclass(frozen=True)
class TransitHints:
    transit: dict[str, Any]


@dataclass(frozen=True)
class Unrecognized:
    fields: dict[str, Any]


PeerMessage = TextOffer | UnsupportedOffer | Answer | TransitHints | Unrecognized


def encode(message: dict[str, Any]) -> bytes:
    return json.dumps(message).encode("utf-8")


def text_offer(text: str) -> bytes:
    return encode({"offer": {"message": text}})


def text_ack() -> bytes:
    return encode({"answer": {"message_ack": "ok"}})


def error_message(text: str) -> bytes:
    return encode({"error": text})


def parse(data: bytes) -> PeerMessage:
    """Decode one peer message; raises PeerRejectedError for ``{"error": ...}``."""
    try:
        fields = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise TransferError(f"the other side sent a message that is not JSON: {e}") from e
    if not isinstance(fields, dict):
        raise TransferError("the other side sent a message that is not a JSON object")
    if "error" in fields:
        raise PeerRejectedError(str(fields["error"]))
    if "offer" in fields:
        offer = fields["offer"]
        if not isinstance(offer, dict):
            raise TransferError("the other side sent a malformed offer")
        if isinstance(offer.get("message"), str):
            return TextOffer(offer["message"])
        kind = next((k for k in ("file", "directory") if k in offer), "unknown")
        return UnsupportedOffer(kind, offer)
    if "answer" in fields:
        answer = fields["answer"]
        if not isinstance(answer, dict):
            raise TransferError("the other side sent a malformed answer")
        return Answer(answer)
    if "transit" in fields:
        return TransitHints(fields["transit"])
    return Unrecognized(fields)
