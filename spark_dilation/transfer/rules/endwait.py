"""When a lane that ends the transfer stops waiting for the senders (pure, no clock).

The receiving side ends a transfer (a cancel, a failure of its own): each
lane sends ``A`` on a control subchannel of every sender connection it holds
and waits for one answer. The sender's answer queues behind the partition
data it had sent (instant on a fast link, seconds on a slow one), so the
wait is bounded, and the directory link may answer first. :class:`EndWait`
is that rule; the lane (``receive/lane.py``, ``end_transfer``) feeds it what
happens and the time, and asks :meth:`EndWait.over` and :attr:`EndWait.outcome`.
"""

from __future__ import annotations

from dataclasses import dataclass

OTHER_WAY_GRACE = 1.0
"""Seconds the directory link still gets once every connection of the lane has answered
or failed (its ``end`` is a mailbox round trip behind)."""

CONFIRMED, SENT, UNTOLD = "confirmed", "sent", ""


@dataclass
class EndWait:
    """One lane's wait for the senders' answer to its ``A``.

    ``deadline``: when the wait ends anyway (start + the caller's timeout).
    ``flush``: stop this long after ``A`` was first handed to a connection,
    answered or not (a process about to exit). ``other_way``: the directory
    link may answer too (then the lane stops at once, with no linger).
    """

    deadline: float
    flush: float | None = None
    other_way: bool = False
    sent: bool = False  # A was handed to at least one connection
    confirmed: bool = False  # a sender answered K on a connection
    heard: bool = False  # the writing end answered "end" on the directory link
    tellers_done: bool = False  # every connection answered or failed

    def on_sent(self, now: float) -> None:
        if self.flush is not None and not self.sent:
            self.deadline = min(self.deadline, now + self.flush)
        self.sent = True

    def on_confirmed(self) -> None:
        self.confirmed = True

    def on_heard(self) -> None:
        self.heard = True

    def on_tellers_done(self, now: float) -> None:
        """Nothing more can come on the connections: the other way gets a moment."""
        if not self.tellers_done:
            self.tellers_done = True
            self.deadline = min(self.deadline, now + (OTHER_WAY_GRACE if self.other_way else 0.0))

    def over(self, now: float) -> bool:
        return self.confirmed or self.heard or now >= self.deadline

    @property
    def outcome(self) -> str:
        """``confirmed`` (either way), ``sent`` (no answer) or ``""`` (no connection took it)."""
        if self.heard or self.confirmed:
            return CONFIRMED
        return SENT if self.sent else UNTOLD

    @property
    def linger(self) -> bool:
        """Whether the lane lingers for its closes: not when the directory confirmed it
        (the sender waits for nothing more on the connections)."""
        return not self.heard
