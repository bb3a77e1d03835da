"""L4 inbound: ACK every OPEN/DATA/CLOSE and deliver each seqnum only once.

Rules (magic-wormhole 0.24 ``_dilation/inbound.py`` and ``Manager.got_record``,
WIRE.md §3.7): every OPEN, DATA and CLOSE is answered with an ACK carrying
its seqnum, old duplicates included (the sender replays everything un-ACKed
on each new connection, and our earlier ACK may have been lost with the old
one); a record whose seqnum is not above the highest seen is a replay and is
not delivered.

Where we go past the reference: a seqnum that skips ahead is refused with
:class:`SeqnumGapError`. A correct sender replays from its oldest un-ACKed
record, so a gap means records were lost for good; the reference would
deliver the rest silently.
"""

from __future__ import annotations

from ..errors import DilationError
from .records import Ack, Close, Data, Open, Sequenced


class SeqnumGapError(DilationError):
    """The peer skipped seqnums: records it believes delivered never arrived."""

    def __init__(self, expected: int, got: int) -> None:
        self.expected = expected
        self.got = got
        super().__init__(
            f"the other side skipped subchannel records (expected seqnum {expected}, "
            f"got {got}), so data was lost; the Dilation connection cannot continue. "
            "Start the transfer again."
        )


class Inbound:
    """Duplicate suppression and ACKs for records arriving from the peer."""

    def __init__(self) -> None:
        # -1: nothing seen yet, so the first record must be seqnum 0.
        self._highest = -1

    @property
    def highest_seqnum(self) -> int:
        """The highest seqnum delivered so far (-1 before the first)."""
        return self._highest

    def received(self, record: Sequenced) -> tuple[bool, Ack]:
        """Returns (deliver it upstairs?, the ACK to send if connected).

        Raises :class:`SeqnumGapError` if the record skips ahead; no ACK is
        due then, since we did not take it.
        """
        if not isinstance(record, Open | Data | Close):
            raise TypeError(f"not an OPEN/DATA/CLOSE record: {record!r}")
        seqnum = record.seqnum
        if seqnum <= self._highest:
            return False, Ack(seqnum)
        if seqnum != self._highest + 1:
            raise SeqnumGapError(self._highest + 1, seqnum)
        self._highest = seqnum
        return True, Ack(seqnum)
