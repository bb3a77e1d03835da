"""L4 outbound: number, queue and replay OPEN/DATA/CLOSE until the peer ACKs them.

Rules (magic-wormhole 0.24 ``_dilation/outbound.py``, WIRE.md §3.7):

* one seqnum counter for OPEN, DATA and CLOSE across all subchannels,
  starting at 0 and continuing across connection generations; there is no
  wrap-around, so numbering stops with :class:`SeqnumExhaustedError` at 2**32;
* every record is queued; it is also transmitted at once if a connection is
  in use, and only queued otherwise;
* an ACK for seqnum N retires every queued record with seqnum <= N;
* on a new connection every un-ACKed record is sent again, in order, before
  anything new.

Where we go past the reference: its queue is unbounded. Ours counts the
bytes of un-ACKed records and returns :class:`PauseWriters` from the
:meth:`Outbound.queue` call that takes them above ``high_water``, and
:class:`ResumeWriters` from the :meth:`Outbound.handle_ack` call that brings
them down to ``low_water`` or below. The bound holds only if writers obey:
a writer that receives PauseWriters must stop writing until ResumeWriters
(the Twisted glue turns these into ``pauseProducing()``/``resumeProducing()``
calls on the producers registered with the subchannels). Records are never
refused, because dropping one would corrupt the stream; a writer that
ignores the signal therefore still grows the queue. The marks stay in force
while no connection exists, so writers may run ahead by about
``high_water`` bytes during a reconnection, and no further.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass

from ..errors import DilationError
from .records import MAX_BE4, Close, Data, Open, Sequenced

log = logging.getLogger(__name__)

DEFAULT_HIGH_WATER = 8 * 1024 * 1024
DEFAULT_LOW_WATER = 4 * 1024 * 1024
# OPEN/DATA/CLOSE all start with a tag byte, a be4 scid and a be4 seqnum.
RECORD_HEADER_SIZE = 9


class OutboundError(DilationError):
    """The L4 outbound queue cannot do what was asked."""


class SeqnumExhaustedError(OutboundError):
    """2**32 records were sent: the 4-byte seqnum cannot number any more."""

    def __init__(self) -> None:
        super().__init__(
            "this Dilation connection has sent 2**32 subchannel records, the most the "
            "protocol can number; start a new wormhole to send more"
        )


class ConnectionInUseError(OutboundError):
    """use_connection() was called while another connection is still in use."""

    def __init__(self) -> None:
        super().__init__(
            "internal error: a new Dilation connection was handed to L4 before the old one "
            "was reported lost"
        )


# --- records before they have a seqnum (L5 builds these) -----------------------


@dataclass(frozen=True, slots=True)
class SendOpen:
    """Queue an OPEN for ``scid`` naming ``subprotocol``."""

    scid: int
    subprotocol: str


@dataclass(frozen=True, slots=True)
class SendData:
    """Queue a DATA record carrying ``data`` on ``scid``."""

    scid: int
    data: bytes


@dataclass(frozen=True, slots=True)
class SendClose:
    """Queue a CLOSE for ``scid``."""

    scid: int


Unsequenced = SendOpen | SendData | SendClose


# --- events returned to the caller ---------------------------------------------


@dataclass(frozen=True, slots=True)
class Transmit:
    """Write this record on the connection in use, now."""

    record: Sequenced


@dataclass(frozen=True, slots=True)
class PauseWriters:
    """Un-ACKed bytes went above the high-water mark: writers must stop."""

    queued_bytes: int


@dataclass(frozen=True, slots=True)
class ResumeWriters:
    """Un-ACKed bytes fell to the low-water mark or below: writers may go on."""

    queued_bytes: int


OutboundEvent = Transmit | PauseWriters | ResumeWriters


def record_size(record: Sequenced) -> int:
    """Plaintext bytes of an OPEN/DATA/CLOSE record: what we account for."""
    match record:
        case Data(_, _, data):
            return RECORD_HEADER_SIZE + len(data)
        case Open(_, _, subprotocol):
            return RECORD_HEADER_SIZE + len(subprotocol.encode("utf-8"))
        case Close():
            return RECORD_HEADER_SIZE
    raise TypeError(f"not an OPEN/DATA/CLOSE record: {record!r}")


class Outbound:
    """The durable, ordered, bounded L4 send queue of one Dilation session."""

    def __init__(
        self,
        *,
        high_water: int = DEFAULT_HIGH_WATER,
        low_water: int = DEFAULT_LOW_WATER,
        first_seqnum: int = 0,
    ) -> None:
        """``first_seqnum`` exists for tests; the protocol always starts at 0."""
        if not 0 <= low_water < high_water:
            raise ValueError(f"need 0 <= low_water < high_water, got {low_water}, {high_water}")
        if not 0 <= first_seqnum <= MAX_BE4 + 1:
            raise ValueError(f"first_seqnum {first_seqnum} out of range")
        self.high_water = high_water
        self.low_water = low_water
        self._next_seqnum = first_seqnum
        # Un-ACKed records in seqnum order, each with its accounted size.
        self._queue: deque[tuple[Sequenced, int]] = deque()
        self._queued_bytes = 0
        self._acked_bytes = 0  # retired by ACKs so far: what the peer has (a rate meter's input)
        self._connected = False
        self._paused = False

    # --- state, for the manager and for status displays ---------------------

    @property
    def connected(self) -> bool:
        return self._connected

    @property
    def next_seqnum(self) -> int:
        return self._next_seqnum

    @property
    def queued_records(self) -> int:
        return len(self._queue)

    @property
    def queued_bytes(self) -> int:
        """Bytes of un-ACKed OPEN/DATA/CLOSE records (header included)."""
        return self._queued_bytes

    @property
    def acked_bytes(self) -> int:
        """Bytes of records the peer ACKed so far (header included), over every connection."""
        return self._acked_bytes

    @property
    def is_full(self) -> bool:
        """True while un-ACKed bytes are above the high-water mark."""
        return self._queued_bytes > self.high_water

    @property
    def writers_paused(self) -> bool:
        """True between a PauseWriters and the matching ResumeWriters."""
        return self._paused

    # --- inputs ---------------------------------------------------------------

    def queue(self, message: Unsequenced) -> tuple[Sequenced, list[OutboundEvent]]:
        """Number ``message`` with the next seqnum and queue it until ACKed.

        Returns the numbered record and the events: :class:`Transmit` if a
        connection is in use, then :class:`PauseWriters` if this record took
        the queue above the high-water mark.
        """
        seqnum = self._next_seqnum
        if seqnum > MAX_BE4:
            raise SeqnumExhaustedError()
        record: Sequenced
        match message:
            case SendData(scid, data):
                record = Data(scid, seqnum, data)
            case SendOpen(scid, subprotocol):
                record = Open(scid, seqnum, subprotocol)
            case SendClose(scid):
                record = Close(scid, seqnum)
            case _:
                raise TypeError(f"not an OPEN/DATA/CLOSE to queue: {message!r}")
        self._next_seqnum = seqnum + 1
        size = record_size(record)
        self._queue.append((record, size))
        self._queued_bytes += size

        events: list[OutboundEvent] = []
        if self._connected:
            # Safe to send at once: use_connection() handed every older
            # record to the caller already, so the order on the wire holds.
            events.append(Transmit(record))
        if not self._paused and self._queued_bytes > self.high_water:
            self._paused = True
            events.append(PauseWriters(self._queued_bytes))
        return record, events

    def handle_ack(self, resp_seqnum: int) -> list[OutboundEvent]:
        """Retire every queued record with seqnum <= ``resp_seqnum`` (ACKs are cumulative).

        Returns :class:`ResumeWriters` if this brought the queue down to the
        low-water mark while writers were paused.
        """
        if resp_seqnum >= self._next_seqnum:
            # A correct peer cannot ACK what we never numbered. Retiring on it
            # could drop records the peer never got, so keep them and complain.
            log.warning(
                "ignoring an ACK for seqnum %d: we have numbered only up to %d",
                resp_seqnum,
                self._next_seqnum - 1,
            )
            return []
        queue = self._queue
        while queue and queue[0][0].seqnum <= resp_seqnum:
            _, size = queue.popleft()
            self._queued_bytes -= size
            self._acked_bytes += size
        assert self._queued_bytes >= 0, self._queued_bytes
        if self._paused and self._queued_bytes <= self.low_water:
            self._paused = False
            return [ResumeWriters(self._queued_bytes)]
        return []

    def use_connection(self) -> list[Sequenced]:
        """A new connection is selected: return every un-ACKed record to send, in order.

        The caller must write all of them before any record queued later
        (those come back as :class:`Transmit` events from :meth:`queue`).
        """
        if self._connected:
            raise ConnectionInUseError()
        self._connected = True
        return [record for record, _ in self._queue]

    def connection_lost(self) -> None:
        """The connection is gone: queue only, until the next use_connection()."""
        # Idempotent: the glue may learn of a loss from more than one place.
        self._connected = False
