"""Meeting by introduction: the directory's rules (pure, no I/O, no clock).

Worker processes never look for each other on shared nameplates. Two sides
meet only on a **door**: a nameplate derived from the transfer secret and
``(lane, epoch, sender, attempt)``, which exactly two processes ever claim,
because the directory told exactly those two about it:

* every sending process has a **sender id** issued once by the writing end
  (:class:`SenderIds`; never reused, not even after the process is gone);
* every lane has an **epoch**, bumped by the reading end each time a new
  process takes the lane over (:class:`LaneEpochs`);
* the two ends share their halves of this state over the **directory link**
  (one wormhole between the reading end and the writing end, itself a
  one-to-one pair: :func:`directory_code`). Each message carries the whole
  half (:meth:`DirectoryState.merge`): senders only grow, epochs only rise,
  so order, loss of an intermediate message and repeats change nothing.

A lane host of epoch ``e`` keeps one door open per known sender
(:class:`LaneDoors`); a sender that needs lane ``l`` claims the door of the
lane's current epoch (:class:`SenderDoors`). Either side may claim first:
there is no pairing timer, no crowding and no slot walk. A door is used once:
after a pairing on attempt ``a`` the lane opens ``a + 1`` for that sender, so
a sender's next connection (another pool, or one whose connection was given up
while the lane host lives) comes on the next attempt. When the epoch of a lane
rises, its senders close their claim on the old door and claim the new epoch's
door at once (the push replaces every form of probing).

Sender side, per lane, for each new connection (two pools of one process
are two connections)::

    event                                   action
    --------------------------------------  ------------------------------------------
    epoch of the lane unknown               wait for the directory's push
    epoch e known                           claim (l, e, s, a), a = the next attempt
    paired                                  dilate
    spoiled (crowded, or a wrong code)      the next attempt, a + 1; report the door
    the lane reported the door spoiled      give the claim up; the next attempt, a + 1
    the caller's deadline passes            the caller fails; the claim stays until it
                                            pairs (the lane waits on exactly this door)
    lane l ended at epoch e, no new host    the connection fails at once with the lane's
                                            error (the claim is closed: nobody will come)
    epoch e' > e pushed                     claims and connections at e are stale: close
                                            them; new connections claim (l, e', s, 0...)

Lane side, per (lane host of epoch e, sender s)::

    state       event                         next        action
    ---------   ---------------------------   ---------   -------------------------------
    (none)      sender s known                OPEN(a=0)   claim door (l, e, s, 0)
    OPEN(a)     paired                        OPEN(a+1)   keep the connection; claim a + 1
    OPEN(a)     spoiled (a stranger on it)    OPEN(a+1)   keep the spoiled claim; claim a + 1;
                                                          report the door
    OPEN(a)     a sender reported it spoiled  OPEN(a+1)   give the claim up; claim a + 1
    OPEN(a)     lane finished                 (none)      close (releases the claim)

A stranger whose PAKE never reaches one side spoils the door for the side that
meets it only: that side reports the door in its end's half (``spoiled``, every
door so far: :func:`spoiled_message`), and the other side's claim there is given
up as spoiled when the report reaches it (:mod:`.meeting`).

A lane can end for good with no new epoch (the registry failed it: its host's
own failure, every hosting attempt failed, the sender's abort): the reading end
adds it to its half (``lanes_ended``, lane -> its last epoch and its error), so
a sender waiting at the lane's door, or about to claim one, fails at once with
that error instead of waiting out ``lane_start_timeout`` ("never hosted"). A
later epoch of the lane (a new host) outranks an end at an older one.

The end of a transfer also travels here: a writing end that aborts adds
``abort`` to its half (:func:`abort_message`), which reaches the reading end
through the mailbox, ahead of the megabytes queued on the data connections;
a reading end that hears it answers ``end`` (:func:`end_message`) and ends its lanes.
A reading end that does not know ``abort`` ignores it (unknown keys are
ignored), so the writing end's in-band abort still decides.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .protocol import NAMEPLATE_DIGITS, RENDEZVOUS_APPID

SENDERS = "senders"
LANES = "lanes"
END = "end"
ABORT = "abort"
LANES_ENDED = "lanes_ended"
SPOILED = "spoiled"


def derived_code(secret: bytes, info: str) -> str:
    """``NAMEPLATE-PASSWORD`` derived from ``secret`` for ``info`` (the table in docs §2)."""
    from ...wormhole.keys import derive_key  # lazy: task workers encode without SPAKE2/HKDF

    raw = info.encode()
    number = int.from_bytes(derive_key(secret, raw + b" nameplate", 16), "big")
    nameplate = str(number % 10**NAMEPLATE_DIGITS).rjust(NAMEPLATE_DIGITS, "1")
    password = derive_key(secret, raw + b" password", 16).hex()
    return f"{nameplate}-{password}"


def rendezvous_appid(secret: bytes, private: bool) -> str:
    """The appid of a transfer's doors and directory link: with ``private`` (both ends
    agreed, protocol.DOORS_PRIVATE) one derived from the secret, so that a server's
    ``list`` of an appid anyone else can name shows none of them; else the public one."""
    if not private:
        return RENDEZVOUS_APPID
    from ...wormhole.keys import derive_key  # lazy, as in derived_code

    return f"{RENDEZVOUS_APPID}/{derive_key(secret, b'spark-dilation doors appid', 16).hex()}"


def directory_code(secret: bytes) -> str:
    """The code of the directory link: claimed by the reading end and the writing end only."""
    return derived_code(secret, "spark-dilation directory v2")


def door_code(secret: bytes, lane: int, epoch: int, sender: int, attempt: int) -> str:
    """The code ``NAMEPLATE-PASSWORD`` of one door (digits only, at most 40: the server's rule).

    Anyone holding the secret computes it; nobody else can guess the 128-bit
    password, and the nameplate reveals nothing about the secret.
    """
    if min(lane, epoch, sender, attempt) < 0:
        raise ValueError("lane, epoch, sender and attempt are non-negative")
    info = f"spark-dilation door lane {lane} epoch {epoch} sender {sender} attempt {attempt}"
    return derived_code(secret, info)


# --- the two halves of the directory --------------------------------------------------


class SenderIds:
    """The writing end's allocator: every sending process gets an id never given before."""

    def __init__(self) -> None:
        self._next = 0

    def issue(self) -> int:
        sender = self._next
        self._next += 1
        return sender

    @property
    def issued(self) -> list[int]:
        return list(range(self._next))


class LaneEpochs:
    """The reading end's epochs: each new host of a lane gets the next epoch of that lane."""

    def __init__(self, lanes: int) -> None:
        self._epochs: dict[int, int] = {}
        self.lanes = lanes

    def host(self, lane: int) -> int:
        """A process takes ``lane`` over; its epoch (0 for the first)."""
        if not 0 <= lane < self.lanes:
            raise ValueError(f"lane {lane} of {self.lanes}")
        epoch = self._epochs.get(lane, -1) + 1
        self._epochs[lane] = epoch
        return epoch

    def current(self) -> dict[int, int]:
        return dict(self._epochs)


@dataclass
class DirectoryState:
    """What one side knows of the other's half; :meth:`merge` is order-free and idempotent."""

    senders: set[int] = field(default_factory=set)
    epochs: dict[int, int] = field(default_factory=dict)
    ended: str = ""
    # Lanes that ended for good (the reading end's half): lane -> (its epoch then, error).
    lanes_ended: dict[int, tuple[int, str]] = field(default_factory=dict)
    # The writing end's abort ({"reason", "cancelled"}, :class:`.protocol.Abort`'s body):
    # the end of the transfer on a path no data is queued on.
    abort: dict[str, Any] | None = None
    # Doors the other end's side found a stranger on (either half; only grows).
    spoiled: set[Door] = field(default_factory=set)

    def merge(self, message: dict[str, Any]) -> tuple[set[int], dict[int, int]]:
        """Take one directory message; returns (new senders, lanes whose epoch rose).

        Unknown keys are ignored (a later version may add some); malformed
        values raise ``ValueError``.
        """
        new_senders: set[int] = set()
        risen: dict[int, int] = {}
        for s in message.get(SENDERS, ()):
            s = _non_negative(s, "sender")
            if s not in self.senders:
                self.senders.add(s)
                new_senders.add(s)
        for lane, epoch in (message.get(LANES) or {}).items():
            lane, epoch = _non_negative(lane, "lane"), _non_negative(epoch, "epoch")
            if epoch > self.epochs.get(lane, -1):
                self.epochs[lane] = epoch
                risen[lane] = epoch
        for lane, body in (message.get(LANES_ENDED) or {}).items():
            lane = _non_negative(lane, "lane")
            if not isinstance(body, dict):
                raise ValueError(f"directory: the end of lane {lane} is not an object")
            epoch = _non_negative(body.get("epoch"), "epoch")
            if epoch > self.lanes_ended.get(lane, (-1, ""))[0]:
                self.lanes_ended[lane] = (epoch, str(body.get("error") or "it ended"))
        self.spoiled |= spoiled_doors(message)
        if message.get(END) and not self.ended:
            self.ended = str(message[END])
        if isinstance(message.get(ABORT), dict) and self.abort is None:
            self.abort = dict(message[ABORT])
        return new_senders, risen

    def lane_ended(self, lane: int) -> str:
        """The error of ``lane`` if it ended for good at its latest epoch, else ""."""
        epoch, error = self.lanes_ended.get(lane, (-1, ""))
        if epoch < 0 or epoch < self.epochs.get(lane, -1):
            return ""  # never ended, or a new host took it over since
        return error


def senders_message(senders: list[int] | set[int]) -> dict[str, Any]:
    """The writing end's half: every sender id issued so far."""
    return {SENDERS: sorted(senders)}


def lanes_message(
    epochs: dict[int, int], ended: dict[int, tuple[int, str]] | None = None
) -> dict[str, Any]:
    """The reading end's half: the current epoch of every hosted lane, and the lanes that
    ended for good (lane -> (epoch, error); a lane never hosted ends at epoch 0)."""
    message: dict[str, Any] = {LANES: {str(lane): epoch for lane, epoch in sorted(epochs.items())}}
    if ended:
        message[LANES_ENDED] = {
            str(lane): {"epoch": epoch, "error": error}
            for lane, (epoch, error) in sorted(ended.items())
        }
    return message


def spoiled_message(doors: set[Door] | list[Door]) -> dict[str, Any]:
    """Either end's: the doors its side found a stranger on (all of them, each message)."""
    return {SPOILED: sorted([d.lane, d.epoch, d.sender, d.attempt] for d in doors)}


def spoiled_doors(message: dict[str, Any]) -> set[Door]:
    """The doors a directory message says are spoiled (malformed values raise ValueError)."""
    doors = set()
    for item in message.get(SPOILED) or ():
        if not isinstance(item, list) or len(item) != 4:
            raise ValueError(
                f"directory: a spoiled door {item!r} is not [lane, epoch, sender, attempt]"
            )
        lane, epoch, sender, attempt = (_non_negative(v, "door part") for v in item)
        doors.add(Door(lane, epoch, sender, attempt))
    return doors


def end_message(reason: str) -> dict[str, Any]:
    """Either end's: the transfer is over here (the reading end: it heard the abort)."""
    return {END: reason}


def abort_message(reason: str, cancelled: bool) -> dict[str, Any]:
    """The writing end's abort, sent with its half (an end that no queued data delays)."""
    return {ABORT: {"reason": reason, "cancelled": cancelled}}


def _non_negative(value: Any, what: str) -> int:
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"directory: {what} {value!r} is not a number") from None
    if number < 0 or str(number) != str(value).strip():
        raise ValueError(f"directory: {what} {value!r} is not a non-negative integer")
    return number


# --- doors ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Door:
    lane: int
    epoch: int
    sender: int
    attempt: int

    def code(self, secret: bytes) -> str:
        return door_code(secret, self.lane, self.epoch, self.sender, self.attempt)


class LaneDoors:
    """Which doors a lane host of one epoch keeps open (see the module's lane table)."""

    def __init__(self, lane: int, epoch: int) -> None:
        self.lane = lane
        self.epoch = epoch
        self._attempt: dict[int, int] = {}  # sender -> attempt of its open door
        self.reported: set[Door] = set()  # doors the senders' side found spoiled

    def report(self, doors: set[Door]) -> list[Door]:
        """The directory says senders found a stranger on ``doors``; the ones open now (their
        claims are given up, and the next door opened, as by our own spoiled door)."""
        self.reported |= doors
        return [d for d in sorted(doors, key=_door_key) if self._is_open(d)]

    def _is_open(self, door: Door) -> bool:
        return (door.lane, door.epoch) == (self.lane, self.epoch) and self._attempt.get(
            door.sender
        ) == door.attempt

    def learn(self, senders: set[int] | list[int]) -> list[Door]:
        """Senders the directory named; the doors to open now (one per new sender)."""
        opened = []
        for s in sorted(senders):
            if s not in self._attempt:
                self._attempt[s] = 0
                opened.append(Door(self.lane, self.epoch, s, 0))
        return opened

    def paired(self, door: Door) -> Door | None:
        """``door`` paired; the door to open next for its sender (None: a stale door)."""
        if door.lane != self.lane or door.epoch != self.epoch:
            return None
        if self._attempt.get(door.sender) != door.attempt:
            return None
        self._attempt[door.sender] = door.attempt + 1
        return Door(self.lane, self.epoch, door.sender, door.attempt + 1)

    def spoiled(self, door: Door) -> Door | None:
        """A stranger was on ``door`` (crowded, or a PAKE that did not confirm): the door
        is used up as by a pairing; the next one for its sender (None: a stale door). The
        sender, who finds the door crowded or the code wrong, moves to that one too."""
        return self.paired(door)

    def open_doors(self) -> list[Door]:
        return [Door(self.lane, self.epoch, s, a) for s, a in sorted(self._attempt.items())]


def _door_key(door: Door) -> tuple[int, int, int, int]:
    return door.lane, door.epoch, door.sender, door.attempt


class SenderDoors:
    """Which door each new connection of one sender process claims (the module's sender
    table). Attempts are handed out one per connection, so two pools of one process
    never claim the same door, and never twice: a claim is never given up before it
    pairs (only when its epoch is stale), so the lane's open door is always the next
    one this process claims, or one it claims now."""

    def __init__(self, sender: int) -> None:
        self.sender = sender
        self._epoch: dict[int, int] = {}
        self._next: dict[int, int] = {}
        self._wanted: set[int] = set()

    def epoch(self, lane: int) -> int | None:
        return self._epoch.get(lane)

    def epochs(self, risen: dict[int, int]) -> dict[int, int]:
        """Epochs rose (the directory's push); those of lanes this process uses: their
        connections and claims at older epochs are stale."""
        stale = {}
        for lane, epoch in risen.items():
            if epoch <= self._epoch.get(lane, -1):
                continue
            self._epoch[lane] = epoch
            self._next[lane] = 0
            if lane in self._wanted:
                stale[lane] = epoch
        return stale

    def want(self, lane: int) -> Door | None:
        """A new connection to ``lane``: the door to claim (None: no epoch known yet)."""
        self._wanted.add(lane)
        if lane not in self._epoch:
            return None
        attempt = self._next[lane]
        self._next[lane] = attempt + 1
        return Door(lane, self._epoch[lane], self.sender, attempt)

    def paired(self, door: Door) -> bool:
        """``door`` paired; False if it is stale (the lane's epoch rose meanwhile)."""
        return self._epoch.get(door.lane) == door.epoch


__all__ = [
    "DirectoryState",
    "Door",
    "LaneDoors",
    "LaneEpochs",
    "SenderDoors",
    "SenderIds",
    "directory_code",
    "door_code",
    "end_message",
    "lanes_message",
    "rendezvous_appid",
    "senders_message",
    "spoiled_doors",
    "spoiled_message",
]
