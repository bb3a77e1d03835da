"""L1: the Dilation records that travel through the mailbox (``dilate-N`` phases).

This module only builds and parses the JSON bodies; the wormhole core
numbers the phases and encrypts them (``WormholeCore.send_dilate``).

Wire facts (magic-wormhole 0.24 ``_dilation/manager.py``, WIRE.md §3.1-3.3):

* the versions message advertises ``"can-dilate": ["ged"]`` and the
  abilities ``direct-tcp-v1`` then ``relay-v1``, in that order, before
  ``app_versions``;
* each body is ``json.dumps(dict)`` with default separators and ``"type"``
  first: ``please`` (``side``, optional ``use-version``),
  ``connection-hints`` (``hints``), ``reconnect``, ``reconnecting``;
* the Dilation side is 8 random bytes as 16 lowercase hex characters; the
  larger side (plain ``str`` comparison) is the Leader;
* an unknown ``type`` is logged and ignored.
"""

from __future__ import annotations

import enum
import json
import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import DilationError

log = logging.getLogger(__name__)

# The order is the order of preference. Versions are named after Earthsea
# wizards in the reference, so they are strings, never numbers.
DILATION_VERSIONS: list[str] = ["ged"]
DILATION_ABILITIES: tuple[Mapping[str, str], ...] = (
    {"type": "direct-tcp-v1"},
    {"type": "relay-v1"},
)


class L1Error(DilationError):
    """A Dilation mailbox record could not be used."""


class MalformedL1Message(L1Error):
    """The peer sent a ``dilate-N`` body that is not a well-formed record."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(
            f"the other side sent a malformed Dilation message ({reason}); "
            "it may run an incompatible or broken version of magic-wormhole"
        )


class SameSideError(L1Error, ValueError):
    """Both sides picked the same Dilation side: almost surely a reflection."""

    def __init__(self, side: str) -> None:
        self.side = side
        super().__init__(
            f"the other side claims our own Dilation side {side!r}: our messages are being "
            "reflected back to us (a misbehaving mailbox server?). Start again with a new code."
        )


class Role(enum.Enum):
    """Who decides which connection is used and when to replace it."""

    LEADER = "leader"
    FOLLOWER = "follower"


def dilation_versions_message(abilities: Iterable[Mapping[str, Any]] | None = None) -> dict:
    """The Dilation entries of our ``version`` phase; the caller appends ``app_versions``.

    The key order matters for byte-equality with the reference, so callers
    must add ``"app_versions"`` after these keys.
    """
    chosen = DILATION_ABILITIES if abilities is None else abilities
    return {
        "can-dilate": list(DILATION_VERSIONS),
        "dilation-abilities": [dict(a) for a in chosen],
    }


def choose_version(ours: Sequence[str], theirs: Iterable[Any]) -> str | None:
    """The best shared version: the earliest in OUR list that they also offer.

    ``theirs`` comes straight from the peer's JSON, so non-strings are ignored
    instead of trusted.
    """
    shared = {v for v in theirs if isinstance(v, str)}
    for version in ours:
        if version in shared:
            return version
    return None


def make_side() -> str:
    """A fresh Dilation side (independent of the 10-hex mailbox side)."""
    return os.urandom(8).hex()


def choose_role(my_side: str, their_side: str) -> Role:
    """LEADER if our side is the larger string, FOLLOWER if smaller; equal raises."""
    if my_side > their_side:
        return Role.LEADER
    if their_side > my_side:
        return Role.FOLLOWER
    raise SameSideError(my_side)


# --- encoders: exact bytes the reference sends ---------------------------------


def _dumps(message: dict) -> bytes:
    # Same as the reference's util.dict_to_bytes: default separators and
    # ensure_ascii, so the bytes are identical.
    return json.dumps(message).encode("utf-8")


def please(side: str, use_version: str | None) -> bytes:
    """``please``: sent once, when dilate() was called and the peer's versions arrived.

    ``use_version`` is None when no version is shared; the reference still
    sends ``please`` then, without the key.
    """
    message: dict[str, Any] = {"type": "please", "side": side}
    if use_version is not None:
        message["use-version"] = use_version
    return _dumps(message)


def connection_hints(hints: Sequence[Mapping[str, Any]]) -> bytes:
    """``connection-hints`` with already-encoded hint dicts (see the hints module)."""
    return _dumps({"type": "connection-hints", "hints": [dict(h) for h in hints]})


def reconnect() -> bytes:
    """``reconnect``: the Leader abandons the current generation."""
    return _dumps({"type": "reconnect"})


def reconnecting() -> bytes:
    """``reconnecting``: the Follower has dropped the old generation."""
    return _dumps({"type": "reconnecting"})


# --- parsed records -------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PleaseMsg:
    side: str
    # The reference never checks the peer's use-version; we keep it for logs.
    use_version: str | None


@dataclass(frozen=True, slots=True)
class HintsMsg:
    # Raw hint dicts: the hints module parses them and drops unknown types.
    hints: tuple[dict[str, Any], ...]


@dataclass(frozen=True, slots=True)
class ReconnectMsg:
    pass


@dataclass(frozen=True, slots=True)
class ReconnectingMsg:
    pass


@dataclass(frozen=True, slots=True)
class UnknownMsg:
    """A record type we do not know: log it and carry on (as the reference does)."""

    type: str
    message: dict[str, Any] = field(hash=False)


L1Message = PleaseMsg | HintsMsg | ReconnectMsg | ReconnectingMsg | UnknownMsg


def parse_l1(plaintext: bytes) -> L1Message:
    """Decode one decrypted ``dilate-N`` body; raises :class:`MalformedL1Message`."""
    try:
        message = json.loads(plaintext.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise MalformedL1Message(f"not UTF-8 JSON: {e}") from None
    if not isinstance(message, dict):
        raise MalformedL1Message("not a JSON object")
    kind = message.get("type")
    if not isinstance(kind, str):
        raise MalformedL1Message("no string 'type' key")
    if kind == "please":
        side = message.get("side")
        if not isinstance(side, str):
            raise MalformedL1Message("'please' without a string 'side'")
        version = message.get("use-version")
        return PleaseMsg(side, version if isinstance(version, str) else None)
    if kind == "connection-hints":
        hints = message.get("hints")
        if not isinstance(hints, list):
            raise MalformedL1Message("'connection-hints' without a 'hints' list")
        usable = tuple(h for h in hints if isinstance(h, dict))
        if len(usable) != len(hints):
            # A hint we cannot even look at is like a hint of unknown type:
            # the reference drops those, so we do too.
            log.warning(
                "ignoring %d connection hints that are not objects", len(hints) - len(usable)
            )
        return HintsMsg(usable)
    if kind == "reconnect":
        return ReconnectMsg()
    if kind == "reconnecting":
        return ReconnectingMsg()
    return UnknownMsg(kind, message)
