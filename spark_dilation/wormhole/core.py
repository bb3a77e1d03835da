"""Sans-IO core of a wormhole client: mailbox protocol, PAKE, phases.

``WormholeCore`` is fed events (the WebSocket connected or dropped, a frame
arrived, the application asked for something) and returns a list of
*events* for its owner: frames to send, results to hand to the application.
It has no sockets, timers or reactor; the Twisted adapter in ``client.py``
owns those.

Compatibility notes (magic-wormhole 0.24):

* Outbound mailbox messages stay queued until the server echoes them back
  to us, and are sent again after a reconnect (``_mailbox.py``). Inbound
  phases are processed once each, so replays are harmless.
* The nameplate is released as soon as the peer's first message arrives.
* A claim the server refused as ``crowded`` is still released: the server
  wrote our ``nameplate_sides`` row before its crowded test, and without the
  release the nameplate outlives everyone else's release. The reference does
  the same: a refused claim closes the Boss ("errory"), the Terminator closes
  the nameplate, then the mailbox (``_terminator.py:127``); the nameplate,
  claim sent, sends ``release`` (``_nameplate.py:190``, ``S2B.upon(close)``),
  and the mailbox, never learned, sends nothing (``_mailbox.py:200``).
* The ``pake`` phase is plaintext; every other phase is SecretBox-encrypted
  with a key derived from the sender's side and the phase name. The first
  phase that decrypts confirms the key; one that does not means the codes
  differ (or someone interfered), and both sides learn it because both send
  a ``version`` phase.
* Application phases are ``"0"``, ``"1"``, ... and are delivered in order;
  ``dilate-N`` phases have their own counter and order.

Deliberate difference from the reference (the "ghost" rule):

* A claim that may have reached the server is never abandoned. The server's
  ``claim`` also opens the mailbox for our side, so once it lands a peer
  already waiting there counts us as its second side and waits for our PAKE.
  If ``close()`` is called while the claim is unanswered (or was sent on a
  connection that dropped), the core sends nothing yet: it waits for
  ``claimed`` (sending the claim again after a reconnect, which the server
  accepts because we have not released), then sends ``open``, its pending
  ``add`` frames (always including the ``pake`` phase), ``release`` and
  ``close``, in that order on one connection. The server handles one
  connection's frames in order, so our PAKE is stored (and echoed to the
  peer) before our side of the mailbox closes; pending ``add`` frames the
  server never echoed are sent again before the ``close`` after a reconnect.
  The waiting peer therefore always receives our PAKE, releases the
  nameplate, and the mailbox is freed when it closes. (The reference 0.24
  releases at once and ignores the late ``claimed``, ``_nameplate.py:190``
  and ``:202``: the peer then waits for a PAKE that never comes, and our side
  of the mailbox stays open until the server prunes it.)

The re-claim rule (also ours): a claim whose peer has not been seen is sent
again on every reconnect. A server that kept its database answers with the
same mailbox (the server accepts a claim again from a side that has not
released). A server restarted without it (``:memory:``) makes the nameplate
anew with a new mailbox; the core then moves there and adds its PAKE again,
so the peer's later claim meets it (``server_lost_state`` says it happened).
Once the peer has been seen a reconnect sends no claim: the pairing is made.

The replay check (also ours): a reopened mailbox that had stored phases of ours,
or of the peer's that we processed, is followed by a ``ping``; the server
replays the mailbox before it answers (it handles a connection's frames in
order), so by the ``pong`` every phase it stored has come back. One that did
not means the server lost its state (``server_lost_state``); the core adds
its own missing phases again, so a peer still in that mailbox gets them.
What the harness still strands (a restart that lost the database between one
side's receiving the other's PAKE and the other's receiving its PAKE: one
side moves to the nameplate's new mailbox, the other stays) is named:
``server_lost_state`` is set, and a meeting that times out says so.

The guard rule (also ours, ``guard_door``: the dataset rendezvous's doors): the
nameplate is released only once the key is confirmed, not at the peer's
first message, and a wrong code (a stranger's PAKE) leaves without releasing
it or closing our side of the mailbox (the server prunes both in time). A
door a stranger spoiled so stays crowded for whoever comes to it later.
A refused ``close`` (on a new connection the server opens the mailbox for the
close, and a mailbox a stranger crowded refuses that) leaves nothing of ours to
close: the wormhole ends instead of waiting for a ``closed`` that never comes.
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass
from typing import Any

from .. import __version__
from ..errors import (
    CrowdedError,
    LonelyError,
    OnlyOneCodeError,
    ServerError,
    WelcomeError,
    WormholeClosedError,
    WormholeError,
    WrongCodeError,
)
from . import codes
from .keys import (
    CryptoError,
    Pake,
    decrypt_data,
    derive_phase_key,
    derive_verifier,
    encrypt_data,
)
from .messages import ProtocolError, decode_server_message, encode_client_message

log = logging.getLogger(__name__)

_DILATE_PHASE = re.compile(r"^dilate-(\d+)$")
_APP_PHASE = re.compile(r"^\d+$")


# --- events returned to the owner -------------------------------------------


@dataclass(frozen=True)
class SendFrame:
    """Send this text frame on the WebSocket."""

    payload: bytes


@dataclass(frozen=True)
class StopConnection:
    """The wormhole is finished: close the WebSocket, do not reconnect."""


@dataclass(frozen=True)
class GotWelcome:
    welcome: dict[str, Any]


@dataclass(frozen=True)
class GotCode:
    code: str


@dataclass(frozen=True)
class GotPeer:
    """The peer's first message arrived: the code has been used."""


@dataclass(frozen=True)
class GotUnverifiedKey:
    key: bytes


@dataclass(frozen=True)
class GotVerifier:
    """The key is confirmed: the peer proved it knows the same code."""

    verifier: bytes


@dataclass(frozen=True)
class GotVersions:
    versions: dict[str, Any]

    @property
    def app_versions(self) -> dict[str, Any]:
        value = self.versions.get("app_versions", {})
        return value if isinstance(value, dict) else {}


@dataclass(frozen=True)
class GotMessage:
    plaintext: bytes


@dataclass(frozen=True)
class GotDilate:
    plaintext: bytes


@dataclass(frozen=True)
class GotNameplates:
    nameplates: tuple[str, ...]


@dataclass(frozen=True)
class GotPong:
    ping: Any


@dataclass(frozen=True)
class Closed:
    """The wormhole is closed. ``error`` is None after a happy close."""

    error: WormholeError | None


Event = (
    SendFrame
    | StopConnection
    | GotWelcome
    | GotCode
    | GotPeer
    | GotUnverifiedKey
    | GotVerifier
    | GotVersions
    | GotMessage
    | GotDilate
    | GotNameplates
    | GotPong
    | Closed
)

_MOODS = {
    WrongCodeError: "scary",
    WelcomeError: "unwelcome",
    LonelyError: "lonely",
    ServerError: "errory",
}


def _mood_for(error: WormholeError | None, verified: bool) -> str:
    if error is None:
        return "happy" if verified else "lonely"
    for kind, mood in _MOODS.items():
        if isinstance(error, kind):
            return mood
    return "errory"


class InOrder:
    """Deliver numbered items in order, buffering gaps."""

    def __init__(self) -> None:
        self._next = 0
        self._held: dict[int, bytes] = {}

    def add(self, number: int, item: bytes) -> list[bytes]:
        if number >= self._next:
            self._held[number] = item
        ready = []
        while self._next in self._held:
            ready.append(self._held.pop(self._next))
            self._next += 1
        return ready


class WormholeCore:
    """One side of one wormhole, as a pure state machine.

    Every public method returns the events it caused, in order.
    """

    def __init__(
        self,
        appid: str,
        *,
        versions: dict[str, Any] | None = None,
        side: str | None = None,
        client_version: tuple[str, str] = ("spark-dilation", __version__),
        keep_nameplate: bool = False,
        guard_door: bool = False,
    ) -> None:
        self.appid = appid
        # Keep our claim on the nameplate until close() instead of releasing it at
        # the peer's first message: the nameplate then stays "crowded" for third
        # parties as long as we live (the dataset rendezvous relies on this).
        self.keep_nameplate = keep_nameplate
        # A door's wormhole (the guard rule): release only once the key is confirmed,
        # and never after a wrong code, so that a door a stranger spoiled stays crowded
        # for whoever comes to it later (who then moves on, instead of waiting alone).
        self.guard_door = guard_door
        self.side = side or os.urandom(5).hex()
        # The plaintext of our "version" phase: {"can-dilate": ..., "app_versions": ...}.
        self._versions = dict(versions or {"app_versions": {}})
        self._client_version = list(client_version)
        self._out: list[Event] = []

        self.connected = False
        self.code: str | None = None
        self._nameplate: str | None = None
        self._code_length: int | None = None  # set while an allocation is wanted
        self._want_list = False
        # None -> "claiming" -> "claimed" -> "releasing" -> "released" (or "held": the
        # guard rule's spoiled door, never released)
        self._claim: str | None = None
        self._claim_sent = False
        self.mailbox: str | None = None
        self._mailbox_open = False  # "open" sent on the current connection
        self._release_sent = False  # "release" sent on the current connection
        self._mailbox_closed = False
        self._pending: dict[str, bytes] = {}  # phase -> encrypted body, until echoed
        # Every phase we added, and those the server echoed (stored): a server that lost
        # its state gets them again (the re-claim rule and the replay check).
        self._added: dict[str, bytes] = {}
        self._echoed: set[str] = set()
        self._replayed: set[str] | None = None  # our phases replayed since the last reopen
        self._replayed_theirs: set[str] = set()  # ... and the peer's
        self._reopens = 0
        self.server_lost_state = False
        """The server lost its state: a re-claim found our nameplate on a new mailbox, or
        a reopened mailbox did not replay a phase of ours it had stored."""

        self._pake: Pake | None = None
        self._key: bytes | None = None
        self.their_side: str | None = None
        self.verified = False
        self._processed: set[str] = set()
        self._early_inbound: list[tuple[str, str, bytes]] = []
        self._unsent_app: list[tuple[str, bytes]] = []  # waits for key confirmation
        self._next_app_phase = 0
        self._next_dilate_phase = 0
        self._app_in = InOrder()
        self._dilate_in = InOrder()
        self._welcomed = False

        self.closing = False
        self.closed = False
        self.result: WormholeError | None = None
        self._mood: str | None = None

    # --- helpers ---------------------------------------------------------

    def _flush(self) -> list[Event]:
        out, self._out = self._out, []
        return out

    def _tx(self, mtype: str, **fields: Any) -> None:
        assert self.connected, mtype
        self._out.append(SendFrame(encode_client_message(mtype, **fields)))

    @property
    def key(self) -> bytes | None:
        return self._key

    # --- connection events -------------------------------------------------

    def connection_made(self) -> list[Event]:
        """The WebSocket is open (first time or after a reconnect)."""
        if self.closed:
            return []
        self.connected = True
        self._mailbox_open = False
        self._release_sent = False
        self._tx("bind", appid=self.appid, side=self.side, client_version=self._client_version)
        if self.closing:
            if self._claim == "claiming":
                # The claim went out on an earlier connection and may have
                # landed: claim again to learn the mailbox (the ghost rule).
                self._send_claim()
                return self._flush()
            if self._pending and self.mailbox is not None and not self._mailbox_closed:
                # Messages the server never echoed (our version, say) go out
                # before the close; the peer would otherwise never see them.
                self._open_mailbox()
            self._send_close_requests()
            self._maybe_finish()
            return self._flush()
        if self._code_length is not None:
            self._tx("allocate")
        if self._want_list:
            self._tx("list")
        if self._claim == "claimed" and self.their_side is None:
            # The re-claim rule: a lonely claim is claimed again on every reconnect,
            # since a server restarted without its database forgot the nameplate
            # and would give the peer's claim a new mailbox. A server that kept it
            # answers with our mailbox, as the first time.
            self._claim = "claiming"
        if self._claim == "claiming":
            self._send_claim()  # "open" follows its answer
        elif self._claim == "releasing":
            self._send_release()
        if self.mailbox is not None and self._claim != "claiming":
            self._open_mailbox()
        return self._flush()

    def connection_lost(self) -> list[Event]:
        """The WebSocket dropped; the owner reconnects and calls connection_made."""
        self.connected = False
        self._mailbox_open = False
        return []

    def frame_received(self, payload: bytes | str) -> list[Event]:
        """A text frame from the server."""
        if self.closed:
            return []
        try:
            msg = decode_server_message(payload)
        except ProtocolError as e:
            self._fail(e)
            return self._flush()
        handler = getattr(self, "_rx_" + msg["type"], None)
        if handler is None:
            log.warning("ignoring unknown mailbox server message type %r", msg["type"])
        else:
            handler(msg)
        return self._flush()

    # --- application requests ----------------------------------------------

    def allocate_code(self, length: int = 2) -> list[Event]:
        """Ask the server for a nameplate and build a code of ``length`` words."""
        self._start_code()
        if length < 1:
            raise ValueError("a code needs at least one word")
        self._code_length = length
        if self.connected:
            self._tx("allocate")
        return self._flush()

    def set_code(self, code: str) -> list[Event]:
        """Use a code the user typed (or both sides agreed on)."""
        code = codes.normalize_code(code)
        codes.validate_code(code)
        self._start_code()
        self._got_code(code)
        return self._flush()

    def list_nameplates(self) -> list[Event]:
        """Ask for the nameplates in use (for code completion)."""
        self._want_list = True
        if self.connected:
            self._tx("list")
        return self._flush()

    def ping(self, value: int) -> list[Event]:
        if self.connected:
            self._tx("ping", ping=value)
        return self._flush()

    def send_message(self, plaintext: bytes) -> list[Event]:
        """Queue an application message (phases "0", "1", ...)."""
        self._check_open()
        phase = str(self._next_app_phase)
        self._next_app_phase += 1
        self._send_encrypted(phase, plaintext)
        return self._flush()

    def send_dilate(self, plaintext: bytes) -> list[Event]:
        """Queue a Dilation L1 record (phases "dilate-0", "dilate-1", ...)."""
        self._check_open()
        phase = f"dilate-{self._next_dilate_phase}"
        self._next_dilate_phase += 1
        self._send_encrypted(phase, plaintext)
        return self._flush()

    def close(self, error: WormholeError | None = None) -> list[Event]:
        """Close the wormhole: release the nameplate, close the mailbox.

        With ``error`` the close reports it (and picks the matching mood);
        without, the result is happy if the key was confirmed, lonely if not.
        """
        if self.closing or self.closed:
            return []
        self.closing = True
        if error is None and not self.verified:
            error = LonelyError()
        self.result = error
        self._mood = _mood_for(error, self.verified)
        if self.connected:
            self._send_close_requests()
        self._maybe_finish()
        return self._flush()

    # --- server messages ----------------------------------------------------

    def _rx_welcome(self, msg: dict[str, Any]) -> None:
        welcome = msg["welcome"]
        if "error" in welcome:
            self._fail(WelcomeError(str(welcome["error"])))
            return
        if not self._welcomed:
            self._welcomed = True
            self._out.append(GotWelcome(welcome))

    def _rx_ack(self, msg: dict[str, Any]) -> None:
        pass

    def _rx_pong(self, msg: dict[str, Any]) -> None:
        value = msg.get("pong")
        if value == self._replay_marker():
            self._check_replay()
            return
        self._out.append(GotPong(value))

    def _replay_marker(self) -> str:
        return f"spark-dilation reopen {self._reopens}"

    def _check_replay(self) -> None:
        """The pong after a reopen: the server has replayed the mailbox by now (it
        answers a connection's frames in order). A phase of ours it had echoed but
        did not replay means it lost its state (restarted without its database): add
        those phases again, so the peer still in this mailbox gets them."""
        replayed, self._replayed = self._replayed, None
        if replayed is None or self.closing or self.closed:
            return
        if self._processed - self._replayed_theirs:
            # The peer's phases are gone too: if it moved to the nameplate's new
            # mailbox meanwhile (its re-claim), we cannot follow on this claim. Say so.
            log.info("the mailbox server lost mailbox %s and the peer's phases", self.mailbox)
            self.server_lost_state = True
        missing = self._echoed - replayed
        if not missing:
            return
        log.info(
            "the mailbox server lost mailbox %s (restarted without its database?):"
            " adding %d phases of ours again", self.mailbox, len(missing),
        )  # fmt: skip
        self.server_lost_state = True
        for phase, body in self._added.items():
            if phase in missing:
                self._echoed.discard(phase)
                self._add(phase, body)

    def _rx_nameplates(self, msg: dict[str, Any]) -> None:
        self._want_list = False
        ids = tuple(str(n["id"]) for n in msg["nameplates"] if isinstance(n, dict) and "id" in n)
        self._out.append(GotNameplates(ids))

    def _rx_allocated(self, msg: dict[str, Any]) -> None:
        if self._code_length is None or self.code is not None:
            return  # a late duplicate after a reconnect
        length, self._code_length = self._code_length, None
        self._got_code(codes.make_code(msg["nameplate"], length))

    def _rx_claimed(self, msg: dict[str, Any]) -> None:
        if self._claim != "claiming":
            return
        self._claim = "claimed"
        if self.mailbox is None:
            self.mailbox = msg["mailbox"]
        elif msg["mailbox"] != self.mailbox and self.their_side is None and not self.closing:
            log.info(
                "the mailbox server lost nameplate %s (restarted without its database?):"
                " claimed it again, on mailbox %s", self._nameplate, msg["mailbox"],
            )  # fmt: skip
            self.server_lost_state = True
            self.mailbox = msg["mailbox"]
            self._mailbox_closed = False
            self._pending.update(self._added)
            self._echoed.clear()  # nothing of ours is in the new mailbox yet
        if not self._mailbox_open:
            self._open_mailbox()  # sends the pending adds, our PAKE among them
        if self.closing:
            # close() came while the claim was in flight (the ghost rule):
            # our PAKE is now ahead of the release and close on this connection.
            self._send_close_requests()
            self._maybe_finish()
        elif self.their_side is not None and self._releases_now():
            self._release()

    def _rx_released(self, msg: dict[str, Any]) -> None:
        if self._claim == "releasing":
            self._claim = "released"
        self._maybe_finish()

    def _rx_closed(self, msg: dict[str, Any]) -> None:
        self._mailbox_closed = True
        self._maybe_finish()

    def _rx_error(self, msg: dict[str, Any]) -> None:
        orig = msg.get("orig") if isinstance(msg.get("orig"), dict) else {}
        orig_type = orig.get("type")
        if orig_type == "claim":
            if msg["error"] == "crowded" and self._claim == "claiming":
                # The server recorded our side before refusing it: release it
                # (even with keep_nameplate), like the reference does, before
                # the close reports the error. No mailbox to close: a refused
                # claim does not name one.
                self._claim = "releasing"
                if self.connected:
                    self._send_release()
            else:
                self._claim = None  # a claim refused for another reason holds nothing
        elif orig_type == "open":
            self.mailbox = None  # a refused open holds nothing we can close
        elif orig_type == "close":
            # A refused close (the server opens the mailbox for it on a new connection,
            # and a crowded one refuses that): nothing more of ours to close there, and
            # waiting for a "closed" that never comes would never end the wormhole.
            self._mailbox_closed = True
        if self.closing:
            log.info("mailbox server error while closing: %s", msg["error"])
            self._maybe_finish()
            return
        if msg["error"] == "crowded":
            self._fail(CrowdedError(orig))
        else:
            self._fail(ServerError(msg["error"], orig))

    def _rx_message(self, msg: dict[str, Any]) -> None:
        side, phase, body = msg["side"], msg["phase"], msg["body"]
        if side == self.side:
            self._pending.pop(phase, None)  # the server has it: stop resending
            self._echoed.add(phase)
            if self._replayed is not None:
                self._replayed.add(phase)
            return
        if self.closing:
            return
        if self.their_side is None:
            self.their_side = side
            self._out.append(GotPeer())
            if self._releases_now():
                self._release()
        elif side != self.their_side:
            log.warning("ignoring a mailbox message from a third side %r", side)
            return
        if self._replayed is not None:
            self._replayed_theirs.add(phase)
        if phase in self._processed:
            return  # replayed after a reconnect
        self._processed.add(phase)
        if phase == "pake":
            self._got_pake(body)
        elif self._key is None:
            self._early_inbound.append((side, phase, body))
        else:
            self._got_encrypted(side, phase, body)

    # --- internals ------------------------------------------------------------

    def _check_open(self) -> None:
        if self.closing or self.closed:
            raise WormholeClosedError()

    def _start_code(self) -> None:
        self._check_open()
        if self.code is not None or self._code_length is not None:
            raise OnlyOneCodeError()

    def _got_code(self, code: str) -> None:
        self.code = code
        self._nameplate = codes.validate_code(code)
        self._out.append(GotCode(code))
        self._claim = "claiming"
        if self.connected:
            self._send_claim()
        self._pake = Pake(code, self.appid)
        self._add("pake", self._pake.message_body())

    def _send_claim(self) -> None:
        self._claim_sent = True
        self._tx("claim", nameplate=self._nameplate)

    def _release(self) -> None:
        if self._claim in ("claiming", "claimed"):
            self._claim = "releasing"
            if self.connected:
                self._send_release()

    def _send_release(self) -> None:
        # The server allows one release per connection.
        if not self._release_sent:
            self._release_sent = True
            self._tx("release", nameplate=self._nameplate)

    def _open_mailbox(self) -> None:
        self._tx("open", mailbox=self.mailbox)
        self._mailbox_open = True
        for phase, body in self._pending.items():
            self._tx("add", phase=phase, body=body.hex())
        if self._echoed - set(self._pending) or self._processed:
            # A reopen of a mailbox that stored phases of ours or the peer's: the
            # replay check.
            self._reopens += 1
            self._replayed, self._replayed_theirs = set(), set()
            self._tx("ping", ping=self._replay_marker())

    def _add(self, phase: str, body: bytes) -> None:
        self._pending[phase] = body
        self._added[phase] = body
        if self._mailbox_open:
            self._tx("add", phase=phase, body=body.hex())

    def _send_encrypted(self, phase: str, plaintext: bytes) -> None:
        if self.verified:
            assert self._key is not None
            self._add(phase, encrypt_data(derive_phase_key(self._key, self.side, phase), plaintext))
        else:
            self._unsent_app.append((phase, plaintext))

    def _got_pake(self, body: bytes) -> None:
        assert self._pake is not None  # the peer can only know the mailbox through a code
        try:
            self._key = self._pake.finish(body)
        except ValueError as e:
            log.info("PAKE failed: %s", e)
            self._fail(WrongCodeError())
            return
        self._out.append(GotUnverifiedKey(self._key))
        version_key = derive_phase_key(self._key, self.side, "version")
        self._add("version", encrypt_data(version_key, json.dumps(self._versions).encode()))
        early, self._early_inbound = self._early_inbound, []
        for side, phase, data in early:
            if self.closing:
                break
            self._got_encrypted(side, phase, data)

    def _got_encrypted(self, side: str, phase: str, body: bytes) -> None:
        assert self._key is not None
        try:
            plaintext = decrypt_data(derive_phase_key(self._key, side, phase), body)
        except CryptoError:
            self._fail(WrongCodeError())
            return
        if not self.verified:
            self.verified = True
            self._out.append(GotVerifier(derive_verifier(self._key)))
            if self._releases_now():
                self._release()  # the guard rule's release, once the key is confirmed
            unsent, self._unsent_app = self._unsent_app, []
            for unsent_phase, data in unsent:
                self._send_encrypted(unsent_phase, data)
        if phase == "version":
            try:
                versions = json.loads(plaintext)
                if not isinstance(versions, dict):
                    raise ValueError("not an object")
            except ValueError:
                self._fail(WormholeError("the other side sent an unreadable version message"))
                return
            self._out.append(GotVersions(versions))
        elif match := _DILATE_PHASE.match(phase):
            for item in self._dilate_in.add(int(match.group(1)), plaintext):
                self._out.append(GotDilate(item))
        elif _APP_PHASE.match(phase):
            for item in self._app_in.add(int(phase), plaintext):
                self._out.append(GotMessage(item))
        else:
            log.warning("ignoring unknown mailbox phase %r", phase)

    def _fail(self, error: WormholeError) -> None:
        if self.closing or self.closed:
            return
        log.info("wormhole failed: %s", error)
        # close() flushes self._out: bind the list only after it returns.
        events = self.close(error)
        self._out.extend(events)

    def _releases_now(self) -> bool:
        """Release the nameplate now that the peer is known? (Not with keep_nameplate; a
        guarded door only once the key is confirmed.)"""
        return not self.keep_nameplate and (self.verified or not self.guard_door)

    def _send_close_requests(self) -> None:
        if self.guard_door and self._claim == "claimed" and isinstance(self.result, WrongCodeError):
            # The guard rule: the spoiled door keeps our claim and our side of its mailbox
            # (the server prunes both in time; a mailbox all of whose sides closed would
            # have its nameplate deleted under our claim), so a third side finds it
            # crowded instead of claiming it anew. We just leave.
            self._claim = "held"
        if self._claim == "held":
            return
        if self._claim == "claiming":
            if self._claim_sent:
                return  # the ghost rule: wait for "claimed", see the module docstring
            self._claim = None  # never reached the server
        if self._claim in ("claimed", "releasing"):
            self._claim = "releasing"
            self._send_release()
        if self.mailbox is not None and not self._mailbox_closed:
            self._tx("close", mailbox=self.mailbox, mood=self._mood)

    def _maybe_finish(self) -> None:
        if not self.closing or self.closed:
            return
        if self._claim == "claiming" and not self._claim_sent:
            self._claim = None
        if self._claim in ("claiming", "claimed", "releasing"):
            return
        if self.mailbox is not None and not self._mailbox_closed and self._claim != "held":
            return
        self.closed = True
        self._out.append(Closed(self.result))
        self._out.append(StopConnection())
