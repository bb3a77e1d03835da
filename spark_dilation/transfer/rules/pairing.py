"""A stream's pairing that survives restarts: the record, its names, the meeting rule (pure).

A stream's first run meets over the human code. Both sides then derive the
same **pairing secret** from the confirmed wormhole key and each keeps a
:class:`PairingRecord`. Every later run of either side meets the other
without a code, on one **standing nameplate** derived from the secret:

* Each side claims it with a **side id fixed in its record** and never
  releases it while the pairing lives. The server therefore only ever sees
  two sides there, whatever restarts, kills and reconnects happen: nothing
  can crowd it. (A fresh side per run would: a killed run's claim stays on
  the server until it prunes the mailbox, 11 minutes later, and the next
  run would be the third side.)
* Each run of a side has an **incarnation**, one more than the last, which
  the run writes to its record before it posts anything: no two runs of a
  side ever share one.
* Each run posts ``hello-<incarnation>``. The mailbox keeps its history and
  replays it on ``open``, so a run learns the peer's latest incarnation in
  whatever order the two start, and learns each later one as it is posted.
* The **pair** ``(sender incarnation, receiver incarnation)`` names one
  connection: its key and its mailbox phases derive from the pair, so the
  messages of any earlier pair are ignored. A peer's later hello ends the
  current pair and starts the next.
* A hello from its own side with a later incarnation means a later run of
  this same side started (the query was started twice): the older run ends.
* ``revoked`` ends the pairing for both sides (``spark-dilation`` revokes it).

Every body is sealed with a key derived from the secret, the posting side
and the phase (as wormhole phases are): the server sees the nameplate, two
side ids, the phase names and message sizes, never a key or a row. A body
that does not open is ignored (nobody without the secret can post one).

:class:`Meeting` is the rule as a state machine (table ``STREAM_MEETING`` in
:mod:`.states`); the standing mailbox client in :mod:`...wormhole.standing`
carries its messages.
"""

from __future__ import annotations

import base64
import json
import re
import secrets
from dataclasses import asdict, dataclass, replace
from typing import Any

from ...errors import TransferError
from .directory import derived_code
from .states import STREAM_MEETING, MeetingEvent, MeetingState

SENDER, RECEIVER = "sender", "receiver"
ROLES = (SENDER, RECEIVER)
RECORD_VERSION = 1
PAIRING_PURPOSE = b"spark-dilation/stream-pairing/v1"
STANDING_INFO = "spark-dilation stream standing v1"
STREAM_APPID = "spark-dilation.org/stream/v1"
REVOKED_PHASE = "revoked"
RECORD_NAME = "pairing.json"  # a side's record, in its pairing folder
_HELLO = re.compile(r"hello-(\d+)")
_PAIR = re.compile(r"pair-(\d+)-(\d+)-(.+)")


class PairingError(TransferError):
    """A pairing record that cannot be used: unreadable, revoked, or superseded."""


@dataclass(frozen=True)
class Pair:
    """One connection between a run of the sender and a run of the receiver."""

    sender: int
    receiver: int

    def phase(self, name: str) -> str:
        """A mailbox phase of this pair's connection (its Dilation messages, say)."""
        return f"pair-{self.sender}-{self.receiver}-{name}"

    def key(self, secret: bytes) -> bytes:
        """The pair's connection key: each pair's Dilation runs under its own."""
        from ...wormhole.keys import derive_key

        info = f"spark-dilation stream pair {self.sender} {self.receiver}"
        return derive_key(secret, info.encode())


@dataclass(frozen=True)
class PairingRecord:
    """What one side keeps between runs (JSON at mode 0600: it holds the secret).

    Whoever holds it can resume the stream as this side, as an SSH key would.
    """

    role: str
    secret: bytes
    side: str  # this side's mailbox side id, fixed for the pairing's life
    mailbox: str
    stream: str  # an id both sides share, safe to show
    incarnation: int = 0  # the last run that started (0: none since the first pairing)
    schema: str | None = None  # base64 Arrow IPC schema: a receiver restarts knowing it
    revoked: str | None = None  # why, once revoked on this side
    version: int = RECORD_VERSION

    @property
    def peer_role(self) -> str:
        return RECEIVER if self.role == SENDER else SENDER

    @property
    def standing_code(self) -> str:
        """``NAMEPLATE-PASSWORD`` of the standing nameplate (the password is unused)."""
        return derived_code(self.secret, STANDING_INFO)

    @property
    def nameplate(self) -> str:
        return self.standing_code.split("-", 1)[0]

    def next_run(self) -> PairingRecord:
        """The record a new run writes before it posts anything."""
        if self.revoked:
            raise PairingError(f"this stream's pairing was revoked ({self.revoked})")
        return replace(self, incarnation=self.incarnation + 1)

    def to_json(self) -> str:
        body = asdict(self)
        body["secret"] = base64.b64encode(self.secret).decode()
        return json.dumps(body, sort_keys=True)

    @classmethod
    def from_json(cls, text: str, where: str = "the pairing record") -> PairingRecord:
        try:
            body = json.loads(text)
            if body.get("version") != RECORD_VERSION:
                raise ValueError(f"version {body.get('version')!r}, not {RECORD_VERSION}")
            body["secret"] = base64.b64decode(body["secret"], validate=True)
            record = cls(**body)
        except (ValueError, TypeError, KeyError) as e:
            raise PairingError(f"{where} is not a spark-dilation pairing record: {e}") from None
        if record.role not in ROLES or len(record.secret) != 32 or record.incarnation < 0:
            raise PairingError(f"{where} is not a spark-dilation pairing record: bad fields")
        return record


def new_record(
    key: bytes, role: str, mailbox: str, schema: str | None = None, side: str | None = None
) -> PairingRecord:
    """The record of a first pairing, from the wormhole key both sides confirmed."""
    from ...wormhole.keys import derive_key

    if role not in ROLES:
        raise ValueError(f"role is one of {ROLES}, not {role!r}")
    secret = derive_key(key, PAIRING_PURPOSE, 32)
    stream = derive_key(secret, b"spark-dilation stream id", 8).hex()
    return PairingRecord(role, secret, side or secrets.token_hex(5), mailbox, stream, 0, schema)


def seal_bytes(key: bytes, side: str, phase: str, data: bytes) -> bytes:
    """A mailbox body only holders of ``key`` can make or read (as wormhole phases are)."""
    from ...wormhole.keys import derive_phase_key, encrypt_data

    return encrypt_data(derive_phase_key(key, side, phase), data)


def open_bytes(key: bytes, side: str, phase: str, body: bytes) -> bytes | None:
    """What :func:`seal_bytes` sealed, or None if it does not open (forged or garbled)."""
    from nacl.exceptions import CryptoError

    from ...wormhole.keys import decrypt_data, derive_phase_key

    try:
        return decrypt_data(derive_phase_key(key, side, phase), body)
    except CryptoError:
        return None


def seal(secret: bytes, side: str, phase: str, body: dict[str, Any]) -> bytes:
    """A JSON body for the standing mailbox, sealed with the pairing secret."""
    return seal_bytes(secret, side, phase, json.dumps(body).encode())


def unseal(secret: bytes, side: str, phase: str, body: bytes) -> dict[str, Any] | None:
    """The body :func:`seal` made, or None if it does not open or is not a JSON object."""
    data = open_bytes(secret, side, phase, body)
    try:
        value = json.loads(data) if data is not None else None
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def hello(record: PairingRecord) -> tuple[str, bytes]:
    """This run's hello: ``(phase, sealed body)``, posted on every connection."""
    phase = f"hello-{record.incarnation}"
    body = {"role": record.role, "incarnation": record.incarnation, "stream": record.stream}
    return phase, seal(record.secret, record.side, phase, body)


def revocation(record: PairingRecord, reason: str) -> tuple[str, bytes]:
    """The ``revoked`` message: the peer's next run refuses to resume."""
    return REVOKED_PHASE, seal(record.secret, record.side, REVOKED_PHASE, {"reason": reason})


@dataclass(frozen=True)
class Heard:
    """What one mailbox message changed: a pair to connect, or the end of this run."""

    pair: Pair | None = None
    ended: PairingError | None = None


class Meeting:
    """One run of one side on the standing mailbox (the rules in the module docstring).

    Feed it every message the mailbox delivers (:meth:`heard`); it answers with
    the pair to connect whenever that changes. ``accepts(phase)`` says whether a
    pair phase belongs to the current pair.
    """

    def __init__(self, record: PairingRecord) -> None:
        if record.incarnation < 1:
            raise ValueError("a run meets with the record next_run() wrote")
        self.record = record
        self.state = STREAM_MEETING.initial
        self.peer_run: int | None = None

    @property
    def pair(self) -> Pair | None:
        if self.state is not MeetingState.PAIRED or self.peer_run is None:
            return None
        mine = self.record.incarnation
        if self.record.role == SENDER:
            return Pair(mine, self.peer_run)
        return Pair(self.peer_run, mine)

    def accepts(self, phase: str) -> str | None:
        """The name within the current pair of a pair phase, or None (another pair's)."""
        m = _PAIR.fullmatch(phase)
        pair = self.pair
        if m is None or pair is None or (int(m[1]), int(m[2])) != (pair.sender, pair.receiver):
            return None
        return m[3]

    def ahead(self, phase: str) -> bool:
        """Whether a pair phase names this run and a later run of the peer than the one
        heard: its hello is still on the way (keep it until then); every other pair
        phase is an earlier pair's, replayed with the mailbox's history (drop it)."""
        m = _PAIR.fullmatch(phase)
        if m is None or self.state in STREAM_MEETING.terminal:
            return False
        sender, receiver = int(m[1]), int(m[2])
        mine, theirs = (sender, receiver) if self.record.role == SENDER else (receiver, sender)
        return mine == self.record.incarnation and (self.peer_run is None or theirs > self.peer_run)

    def heard(self, side: str, phase: str, body: bytes) -> Heard:
        if self.state in STREAM_MEETING.terminal:
            return Heard()
        own = side == self.record.side
        value = unseal(self.record.secret, side, phase, body)
        if value is None:
            return Heard()  # not ours to read: forged, or garbled on the way
        if phase == REVOKED_PHASE:
            who = "this side" if own else f"the {self.record.peer_role}"
            reason = str(value.get("reason", ""))
            return self._end(
                MeetingEvent.REVOKED,
                f"{who} revoked this stream's pairing{': ' + reason if reason else ''}; "
                "pair again with a new code",
            )
        m = _HELLO.fullmatch(phase)
        if m is None or value.get("incarnation") != int(m[1]):
            return Heard()  # a pair phase (the connection's business) or not a hello
        run = int(m[1])
        if own:
            if run > self.record.incarnation:
                return self._end(
                    MeetingEvent.SUPERSEDED,
                    f"a later run of this stream's {self.record.role} started (run {run}, "
                    f"this is run {self.record.incarnation}); this run ends",
                )
            return Heard()  # this run's echo, or an earlier run's hello
        if value.get("role") != self.record.peer_role:
            return Heard()
        if self.peer_run is not None and run <= self.peer_run:
            return Heard()  # an earlier run of the peer, replayed
        self.peer_run = run
        self.state = STREAM_MEETING.next(self.state, MeetingEvent.PEER_RUN)
        return Heard(pair=self.pair)

    def _end(self, event: MeetingEvent, text: str) -> Heard:
        self.state = STREAM_MEETING.next(self.state, event)
        return Heard(ended=PairingError(text))
