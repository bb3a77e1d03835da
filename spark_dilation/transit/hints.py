"""Connection hints: how to reach a peer (direct TCP, relay, Tor).

Encodings are those of magic-wormhole 0.24 (``wormhole/_hints.py``); Transit
and Dilation share them. Unknown or malformed hints parse to ``None`` and are
dropped, never fatal: a newer peer may advertise kinds we do not know.
"""

from __future__ import annotations

import ipaddress
import logging
import re
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)


@dataclass(frozen=True, order=True)
class DirectTCPV1Hint:
    hostname: str
    port: int
    priority: float = 0.0


@dataclass(frozen=True, order=True)
class TorTCPV1Hint:
    hostname: str
    port: int
    priority: float = 0.0


@dataclass(frozen=True)
class RelayV1Hint:
    hints: tuple[DirectTCPV1Hint | TorTCPV1Hint, ...]


Hint = DirectTCPV1Hint | TorTCPV1Hint | RelayV1Hint

ABILITIES = [{"type": "direct-tcp-v1"}, {"type": "relay-v1"}]


def parse_tcp_v1_hint(hint: Any) -> DirectTCPV1Hint | TorTCPV1Hint | None:
    if not isinstance(hint, dict):
        return None
    kind = hint.get("type")
    if kind not in ("direct-tcp-v1", "tor-tcp-v1"):
        log.debug("ignoring unknown hint type %r", kind)
        return None
    hostname, port = hint.get("hostname"), hint.get("port")
    priority = hint.get("priority", 0.0)
    if not isinstance(hostname, str) or not hostname:
        log.info("ignoring hint with a bad hostname: %r", hint)
        return None
    if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
        log.info("ignoring hint with a bad port: %r", hint)
        return None
    if not isinstance(priority, int | float) or isinstance(priority, bool):
        priority = 0.0
    cls = DirectTCPV1Hint if kind == "direct-tcp-v1" else TorTCPV1Hint
    return cls(hostname, port, float(priority))


def parse_hint(hint: Any) -> Hint | None:
    """One hint dict from the peer, or None if we cannot use it."""
    if isinstance(hint, dict) and hint.get("type") == "relay-v1":
        inner = hint.get("hints")
        if not isinstance(inner, list):
            return None
        parsed = tuple(h for h in (parse_tcp_v1_hint(x) for x in inner) if h is not None)
        return RelayV1Hint(parsed) if parsed else None
    return parse_tcp_v1_hint(hint)


def parse_hints(hints: Any) -> list[Hint]:
    if not isinstance(hints, list):
        return []
    return [h for h in (parse_hint(x) for x in hints) if h is not None]


def encode_hint(hint: Hint) -> dict[str, Any]:
    if isinstance(hint, RelayV1Hint):
        return {"type": "relay-v1", "hints": [encode_hint(h) for h in hint.hints]}
    kind = "direct-tcp-v1" if isinstance(hint, DirectTCPV1Hint) else "tor-tcp-v1"
    return {"type": kind, "priority": hint.priority, "hostname": hint.hostname, "port": hint.port}


def parse_relay_url(text: str) -> DirectTCPV1Hint:
    """``tcp:HOST:PORT[:priority=F]`` (IPv6 as ``[addr]``), like ``--transit-helper``."""
    match = re.fullmatch(r"tcp:(?:\[([0-9a-fA-F:.]+)\]|([^:\[\]]+)):(\d+)((?::[^:]+)*)", text)
    if not match:
        raise ValueError(f"not a relay address: {text!r} (expected tcp:HOST:PORT)")
    host = match.group(1) or match.group(2)
    if match.group(1):
        ipaddress.IPv6Address(host)
    priority = 0.0
    for extra in filter(None, match.group(4).split(":")):
        key, _, value = extra.partition("=")
        if key == "priority":
            try:
                priority = float(value)
            except ValueError:
                raise ValueError(f"bad priority in relay address {text!r}") from None
    port = int(match.group(3))
    if not 0 < port < 65536:
        raise ValueError(f"bad port in relay address {text!r}")
    return DirectTCPV1Hint(host, port, priority)


def describe(hint: Hint, relay: bool = False) -> str:
    if isinstance(hint, RelayV1Hint):
        return "relay:" + ",".join(describe(h) for h in hint.hints)
    prefix = "relay:" if relay else ""
    kind = "tcp" if isinstance(hint, DirectTCPV1Hint) else "tor"
    return f"{prefix}{kind}:{hint.hostname}:{hint.port}"
