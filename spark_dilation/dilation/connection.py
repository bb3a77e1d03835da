"""One L2 connection, sans I/O: prologue, Noise handshake, KCM, then records.

It composes the small pure pieces (:mod:`.framing`, :mod:`.noise`,
:mod:`.records`) into the per-connection sequence of magic-wormhole 0.24
(``_dilation/connection.py``):

1. (relay only) the sided relay handshake and ``ok\\n``;
2. both send their prologue; the Leader sends Noise msg1 when it sees the
   Follower's prologue, the Follower answers msg2;
3. the Follower sends its KCM right after msg2, on every connection; the
   Leader sends its KCM only on the connection it selects (:meth:`select`);
4. then every frame is one encrypted record.

Any protocol violation yields one :class:`Failed` event and the connection is
dead: the owner must drop it (abort, not a polite close: a hostile or broken
peer gets no say in how long we wait).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from ..errors import DilationError
from . import framing, noise
from .records import (
    KCM,
    Data,
    Record,
    RecordError,
    decode_record,
    encode_data_header,
    encode_record,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Write:
    data: bytes | bytearray


@dataclass(frozen=True)
class HandshakeComplete:
    """Noise is done; records may be sent once this connection is selected."""


@dataclass(frozen=True)
class PeerKCM:
    """The peer's key confirmation arrived.

    For the Leader this makes the connection a candidate; for the Follower it
    means the Leader selected this connection.
    """


@dataclass(frozen=True)
class RecordReceived:
    record: Record


@dataclass(frozen=True)
class Failed:
    error: DilationError


Event = Write | HandshakeComplete | PeerKCM | RecordReceived | Failed


class L2Connection:
    """The state of one Dilation connection (direct or relayed)."""

    def __init__(
        self,
        dilation_key: bytes,
        *,
        leader: bool,
        relay_side: str | None = None,
        max_frame: int = framing.DEFAULT_MAX_FRAME,
    ) -> None:
        self.leader = leader
        ours, theirs = (
            (framing.LEADER_PROLOGUE, framing.FOLLOWER_PROLOGUE)
            if leader
            else (framing.FOLLOWER_PROLOGUE, framing.LEADER_PROLOGUE)
        )
        relay = framing.relay_handshake(dilation_key, relay_side) if relay_side else None
        # Until Noise completes only 48-byte handshake messages and the 17-byte
        # KCM may arrive: a stranger cannot make us buffer a big frame.
        self._max_frame = max_frame
        self._framer = framing.Framer(
            ours,
            theirs,
            relay_handshake=relay,
            max_frame=min(max_frame, noise.HANDSHAKE_MESSAGE_SIZE),
        )
        self._handshake = noise.NoiseHandshake(dilation_key, leader=leader)
        self._transport: noise.NoiseTransport | None = None
        self.kcm_received = False
        self.kcm_sent = False
        self.failed = False

    @property
    def ready(self) -> bool:
        """The Noise handshake is complete."""
        return self._transport is not None

    @property
    def missing(self) -> int:
        """Bytes of a record that has begun to arrive and is not complete yet."""
        return self._framer.missing

    def connection_made(self) -> list[Event]:
        return [Write(self._framer.connection_made())]

    def data_received(self, data: bytes | bytearray | memoryview) -> list[Event]:
        if self.failed:
            return []
        out: list[Event] = []
        try:
            events = self._framer.data_received(data)
        except framing.FramingError as e:
            events = [*e.events, e]  # handle the good frames before the failure
        for event in events:
            if self.failed:
                break
            try:
                self._handle(event, out)
            except (noise.HandshakeError, noise.DecryptError, RecordError) as e:
                self._fail(e, out)
        return out

    def _handle(self, event: framing.Event | framing.FramingError, out: list[Event]) -> None:
        match event:
            case framing.SendBytes(data):
                out.append(Write(data))
            case framing.PrologueReceived():
                first = self._handshake.start()
                if first is not None:  # the Leader speaks first
                    out.append(Write(framing.encode_frame(first)))
            case framing.Frame(payload):
                if self._transport is None:
                    self._handshake_frame(payload, out)
                else:
                    self._record_frame(payload, out)
            case framing.FramingError() as error:
                self._fail(error, out)

    def _handshake_frame(self, payload: bytes | memoryview, out: list[Event]) -> None:
        reply = self._handshake.receive(payload)
        if reply is not None:
            out.append(Write(framing.encode_frame(reply)))
        if self._handshake.complete:
            self._framer.max_frame = self._max_frame
            self._transport = self._handshake.transport()
            out.append(HandshakeComplete())
            if not self.leader:
                out.append(Write(self._kcm()))

    def _record_frame(self, payload: bytes | memoryview, out: list[Event]) -> None:
        assert self._transport is not None
        # A view into a reused buffer: decode_record copies what it keeps.
        record = decode_record(self._transport.decrypt_frame_view(payload))
        if isinstance(record, KCM):
            if self.kcm_received:
                log.info("ignoring an unexpected second KCM")
                return
            self.kcm_received = True
            out.append(PeerKCM())
        else:
            out.append(RecordReceived(record))

    def _fail(self, error: DilationError, out: list[Event]) -> None:
        if not self.failed:
            self.failed = True
            out.append(Failed(error))

    def _kcm(self) -> bytes:
        self.kcm_sent = True
        return self.encode(KCM())

    def select(self) -> bytes:
        """(Leader) This connection won: the bytes of our KCM to write on it."""
        assert self.leader and self.ready and not self.kcm_sent
        return self._kcm()

    def encode(self, record: Record) -> bytes:
        """One record as the bytes to write (length prefix and ciphertext)."""
        assert self._transport is not None, "the handshake is not complete"
        if isinstance(record, Data):  # encrypt header and payload without joining them
            header = encode_data_header(record.scid, record.seqnum)
            return self._transport.encrypt_frame_parts(header, record.data)
        return self._transport.encrypt_frame(encode_record(record))
