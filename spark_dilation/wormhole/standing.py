"""Sans-IO client of a *standing* mailbox: one fixed side on one nameplate, kept for good.

A wormhole claims a nameplate, meets once and releases it. A standing
mailbox is for two parties that meet again and again without a new code
(a stream's runs, :mod:`spark_dilation.transfer.rules.pairing`):

* The side id is the caller's and fixed. On every connection the client
  binds with it and claims the nameplate again; the server accepts a claim
  from a side that holds it, so restarts and reconnects never add a side.
* It never releases the nameplate nor closes the mailbox until :meth:`close`.
  While the mailbox lives (the server prunes one nobody has listened to for
  about 11 minutes) it keeps every message and replays them on ``open``: a
  run learns what the other posted before it started.
* A posted message stays pending until the server echoes it, and goes out
  again after a reconnect. A *kept* message (:meth:`keep`: a run's hello)
  also goes out again whenever the server answers the claim with a mailbox
  other than the last one: it pruned the old one, and its history with it.
  Every message is delivered to the owner once per ``(side, phase, body)``;
  bodies are opaque here (the pairing seals them).

Like :class:`~.core.WormholeCore`, it is fed events and returns events; the
Twisted adapter owns the socket and the reconnect timer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .core import Closed, Event, SendFrame, StopConnection
from .messages import ProtocolError, WormholeError, decode_server_message, encode_client_message


@dataclass(frozen=True)
class GotPosted:
    """A message on the standing mailbox (ours echoed, or the other party's)."""

    side: str
    phase: str
    body: bytes


Out = Event | GotPosted


class StandingMailbox:
    def __init__(self, appid: str, side: str, nameplate: str) -> None:
        self.appid, self.side, self.nameplate = appid, side, nameplate
        self.connected = False
        self.mailbox: str | None = None
        self._open = False  # the mailbox is open on this connection
        self.pending: list[tuple[str, bytes]] = []  # posted, not yet echoed
        self.kept: list[tuple[str, bytes]] = []  # posted again into every new mailbox
        self._seen: set[tuple[str, str, bytes]] = set()
        self.closing = False
        self.closed = False
        self._awaiting: set[str] = set()  # "released", "closed" during close()
        self._mood = "happy"
        self._out: list[Out] = []

    # --- connection --------------------------------------------------------------------

    def connection_made(self) -> list[Out]:
        if self.closed:
            return []
        self.connected, self._open = True, False
        self._tx("bind", appid=self.appid, side=self.side)
        # Claimed again on every connection: the mailbox the server answers with is the
        # current one (after a prune it is a new one, and our messages go out again).
        self._tx("claim", nameplate=self.nameplate)
        return self._flush()

    def connection_lost(self) -> list[Out]:
        self.connected, self._open = False, False
        return []

    def frame_received(self, payload: bytes | str) -> list[Out]:
        if self.closed:
            return []
        try:
            msg = decode_server_message(payload)
        except ProtocolError as e:
            return self._fail(e)
        kind = msg["type"]
        if kind == "welcome" and "error" in msg.get("welcome", {}):
            refused = msg["welcome"]["error"]
            return self._fail(WormholeError(f"the mailbox server refused us: {refused}"))
        if kind == "error":
            return self._fail(WormholeError(f"the mailbox server said: {msg.get('error')}"))
        if kind == "claimed":
            mailbox = str(msg["mailbox"])
            if mailbox != self.mailbox and self.mailbox is not None:
                # Pruned while nobody listened: what we keep there is gone with it.
                self.pending += [m for m in self.kept if m not in self.pending]
            self.mailbox = mailbox
            self._tx("open", mailbox=self.mailbox)
            self._open = True
            for phase, body in self.pending:
                self._tx("add", phase=phase, body=body.hex())
            if self.closing:
                self._send_close()
        elif kind == "message":
            side, phase, body = msg["side"], msg["phase"], msg["body"]
            if side == self.side and (phase, body) in self.pending:
                self.pending.remove((phase, body))
            if (side, phase, body) not in self._seen:
                self._seen.add((side, phase, body))
                self._out.append(GotPosted(side, phase, body))
        elif kind in ("released", "closed") and self.closing:
            self._awaiting.discard(kind)
            if not self._awaiting:
                self.closed = True
                self._out += [Closed(None), StopConnection()]
        return self._flush()

    # --- the owner's requests ------------------------------------------------------------

    def post(self, phase: str, body: bytes) -> list[Out]:
        """Add a message; it stays pending until echoed, and is re-sent after a reconnect."""
        if self.closing or self.closed:
            raise WormholeError("the standing mailbox is closed")
        self.pending.append((phase, body))
        if self._open:
            self._tx("add", phase=phase, body=body.hex())
        return self._flush()

    def keep(self, phase: str, body: bytes) -> list[Out]:
        """Post a message that must stay in the mailbox: posted again into a new one."""
        self.kept.append((phase, body))
        return self.post(phase, body)

    def close(self, mood: str = "happy") -> list[Out]:
        """Give up the nameplate and the mailbox (the pairing ends: revoked, or finished).

        Pending messages go out first, on the same connection.
        """
        if self.closing or self.closed:
            return []
        self.closing, self._mood = True, mood
        self._awaiting = {"released", "closed"}
        if self._open:
            self._send_close()
        return self._flush()

    # --- internals -------------------------------------------------------------------------

    def _send_close(self) -> None:
        self._tx("release", nameplate=self.nameplate)
        self._tx("close", mailbox=self.mailbox, mood=self._mood)

    def _tx(self, mtype: str, **fields: Any) -> None:
        if self.connected:
            self._out.append(SendFrame(encode_client_message(mtype, **fields)))

    def _fail(self, error: WormholeError) -> list[Out]:
        self.closed = True
        self._out += [Closed(error), StopConnection()]
        return self._flush()

    def _flush(self) -> list[Out]:
        out, self._out = self._out, []
        return out
