"""L5: the subchannel table, its ids, listeners and per-subchannel close states.

Pure: the table is fed local calls and the OPEN/DATA/CLOSE records that L4
delivered (duplicates already removed) and returns actions in the order they
must happen: :class:`~.outbound.SendOpen`/``SendData``/``SendClose`` for the
L4 queue, and events for the application (:class:`Accepted`,
:class:`DataReceived`, the three ``...ConnectionLost`` and :class:`Rejected`).

Rules (magic-wormhole 0.24 ``_dilation/subchannel.py``, ``inbound.py``,
``Manager.allocate_subchannel_id``; WIRE.md §3.7):

* scids: the Leader uses 1, 3, 5, ..., the Follower 2, 4, 6, ...; 0 is
  reserved; ids are never reused and not reset on reconnection;
* full close: ``lose_connection`` sends CLOSE (``closing``); the peer's CLOSE
  then gives ``ConnectionLost``. A CLOSE received while open is answered
  with CLOSE and gives ``ConnectionLost``. Both sides always send one CLOSE;
* half close (half-closeable protocols): ``lose_write_connection`` sends
  CLOSE and gives ``WriteConnectionLost``; the peer's CLOSE gives
  ``ReadConnectionLost``. Either may come first;
* DATA received while we are closing is still delivered; writing after our
  CLOSE is an error;
* a duplicate OPEN, or DATA/CLOSE for an unknown scid, is logged and ignored.

Where we go past the reference (which queues an OPEN with no listener
forever, and ignores ``expected_subprotocols``): an OPEN for a name without
a listener is answered with CLOSE and a logged reason (:class:`Rejected`),
unless the name is in ``expected_subprotocols``. Those are held, with their
DATA and CLOSE, until :meth:`SubchannelTable.register_listener`, up to
``max_pending_bytes`` in total; a subchannel that would exceed the bound is
rejected instead.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field

from ..errors import DilationError
from .l1 import Role
from .outbound import RECORD_HEADER_SIZE, SendClose, SendData, SendOpen
from .records import MAX_BE4, Close, Data, Open

log = logging.getLogger(__name__)

DEFAULT_MAX_PENDING_BYTES = 4 * 1024 * 1024
# The largest DATA payload whose frame length still fits the 4-byte length
# prefix after the 9-byte header and the 16-byte Noise tag (the reference's
# MAX_FRAME_LENGTH).
MAX_WRITE_SIZE = 2**32 - 1 - 9 - 16


# --- errors ---------------------------------------------------------------------


class SubchannelError(DilationError):
    """A subchannel operation that the protocol does not allow."""


class RoleUnknownError(SubchannelError):
    """A subchannel was opened before the Leader/Follower roles were settled."""

    def __init__(self) -> None:
        super().__init__(
            "internal error: a subchannel was opened before Dilation chose Leader and "
            "Follower; wait for the wormhole to be dilated first"
        )


class SubchannelIdsExhaustedError(SubchannelError):
    def __init__(self) -> None:
        super().__init__(
            "this Dilation connection has used every subchannel id; start a new wormhole"
        )


class SubchannelClosedError(SubchannelError):
    """Writing to (or closing again) a subchannel that we already closed."""

    def __init__(self, scid: int, what: str) -> None:
        self.scid = scid
        super().__init__(f"cannot {what} subchannel {scid}: it is closed or closing")


class NormalCloseUsedOnHalfCloseable(SubchannelError):
    def __init__(self, scid: int) -> None:
        self.scid = scid
        super().__init__(
            f"subchannel {scid} carries a half-closeable protocol: use "
            "lose_write_connection() (loseWriteConnection) instead of lose_connection()"
        )


class HalfCloseUsedOnNonHalfCloseable(SubchannelError):
    def __init__(self, scid: int) -> None:
        self.scid = scid
        super().__init__(
            f"subchannel {scid} carries a protocol that is not half-closeable: use "
            "lose_connection() (loseConnection) instead of lose_write_connection()"
        )


class WriteTooLargeError(SubchannelError, ValueError):
    def __init__(self, size: int) -> None:
        self.size = size
        super().__init__(
            f"a single subchannel write of {size} bytes is larger than the Dilation limit "
            f"of {MAX_WRITE_SIZE} bytes; split it into smaller writes"
        )


class InvalidSubprotocolError(SubchannelError, ValueError):
    def __init__(self, name: object) -> None:
        super().__init__(f"a subprotocol name must be a non-empty string, not {name!r}")


class ListenerExistsError(SubchannelError, ValueError):
    def __init__(self, name: str) -> None:
        self.name = name
        super().__init__(f'already listening for subprotocol "{name}"')


# --- events for the application ---------------------------------------------------


@dataclass(frozen=True, slots=True)
class Accepted:
    """The peer opened ``scid`` for a subprotocol we listen for: build its protocol."""

    scid: int
    subprotocol: str


@dataclass(frozen=True, slots=True)
class DataReceived:
    scid: int
    data: bytes


@dataclass(frozen=True, slots=True)
class ConnectionLost:
    """Full close finished: the subchannel is gone."""

    scid: int


@dataclass(frozen=True, slots=True)
class ReadConnectionLost:
    """(half-closeable) The peer closed its writing side: nothing more will arrive."""

    scid: int


@dataclass(frozen=True, slots=True)
class WriteConnectionLost:
    """(half-closeable) Our writing side is closed: writes are now errors."""

    scid: int


@dataclass(frozen=True, slots=True)
class Rejected:
    """We refused the peer's OPEN (a CLOSE goes back with it); ``reason`` was logged."""

    scid: int
    subprotocol: str
    reason: str


L5Event = (
    Accepted | DataReceived | ConnectionLost | ReadConnectionLost | WriteConnectionLost | Rejected
)
# What the table returns: L4 sends and application events, in order.
L5Action = SendClose | L5Event


class SubchannelState(enum.Enum):
    PENDING = "pending"  # the peer opened an expected name; no listener yet
    OPEN = "open"
    CLOSING = "closing"  # full close: we sent CLOSE, theirs is due
    WRITE_CLOSED = "write-closed"  # half close: we sent CLOSE, we may still read
    READ_CLOSED = "read-closed"  # half close: they sent CLOSE, we may still write


@dataclass(frozen=True, slots=True)
class SubchannelInfo:
    scid: int
    subprotocol: str
    state: SubchannelState
    opened_by_us: bool
    half_closeable: bool


@dataclass(frozen=True, slots=True)
class TableStatus:
    """A snapshot for UIs and logs."""

    role: Role | None
    subchannels: tuple[SubchannelInfo, ...]
    listeners: tuple[str, ...]
    expected_subprotocols: tuple[str, ...]
    pending_bytes: int

    @property
    def names(self) -> tuple[str, ...]:
        """The subprotocol name of each subchannel, in table order."""
        return tuple(s.subprotocol for s in self.subchannels)


@dataclass(slots=True)
class _Subchannel:
    scid: int
    subprotocol: str
    state: SubchannelState
    opened_by_us: bool
    half_closeable: bool
    # Only while PENDING: what arrived before the listener did.
    pending_data: list[bytes] = field(default_factory=list)
    pending_close: bool = False
    pending_bytes: int = 0


_OPEN_FOR_WRITING = (SubchannelState.OPEN, SubchannelState.READ_CLOSED)


def _check_name(name: object) -> str:
    if not isinstance(name, str) or not name:
        raise InvalidSubprotocolError(name)
    return name


class SubchannelTable:
    """Every live subchannel of one Dilation session, keyed by scid."""

    def __init__(
        self,
        *,
        expected_subprotocols: Iterable[str] = (),
        max_pending_bytes: int = DEFAULT_MAX_PENDING_BYTES,
    ) -> None:
        """``expected_subprotocols``: names whose OPEN may arrive before the listener."""
        self._expected = tuple(_check_name(n) for n in expected_subprotocols)
        self._max_pending = max_pending_bytes
        self._pending_bytes = 0
        self._role: Role | None = None
        self._next_index = 0  # scid = 2*index + 1 (Leader) or 2*index + 2 (Follower)
        self._subchannels: dict[int, _Subchannel] = {}  # insertion order = arrival order
        self._listeners: dict[str, bool] = {}  # name -> half_closeable
        # scids we refused: their DATA and the peer's answering CLOSE are
        # expected, so they are dropped quietly rather than logged as errors.
        self._rejected: set[int] = set()

    # --- roles and ids ------------------------------------------------------------

    @property
    def role(self) -> Role | None:
        return self._role

    def set_role(self, role: Role) -> None:
        """Called once roles are chosen; ids keep counting across reconnections."""
        if self._role is not None and self._role is not role:
            raise ValueError(f"the Dilation role cannot change from {self._role} to {role}")
        self._role = role

    def _scid_for(self, index: int) -> int:
        return 2 * index + (1 if self._role is Role.LEADER else 2)

    def _is_ours(self, scid: int) -> bool:
        return (scid % 2 == 1) == (self._role is Role.LEADER)

    def _allocate(self) -> int:
        if self._role is None:
            raise RoleUnknownError()
        scid = self._scid_for(self._next_index)
        if scid > MAX_BE4:
            raise SubchannelIdsExhaustedError()
        self._next_index += 1
        return scid

    # --- local calls ------------------------------------------------------------

    def open(self, subprotocol: str, *, half_closeable: bool = False) -> SendOpen:
        """Open a subchannel to the peer's listener; queue the returned OPEN.

        The new scid is ``result.scid``. DATA may be written at once: there
        is no answer to an OPEN.
        """
        _check_name(subprotocol)
        scid = self._allocate()
        self._subchannels[scid] = _Subchannel(
            scid, subprotocol, SubchannelState.OPEN, True, half_closeable
        )
        return SendOpen(scid, subprotocol)

    def write(self, scid: int, data: bytes) -> SendData:
        """Returns the DATA to queue; raises :class:`SubchannelClosedError` after our CLOSE."""
        sc = self._subchannels.get(scid)
        if sc is None or sc.state not in _OPEN_FOR_WRITING:
            raise SubchannelClosedError(scid, "write to")
        if len(data) > MAX_WRITE_SIZE:
            raise WriteTooLargeError(len(data))
        return SendData(scid, bytes(data))

    def lose_connection(self, scid: int) -> list[L5Action]:
        """Full close (``loseConnection``): send CLOSE and wait for the peer's."""
        sc = self._subchannels.get(scid)
        if sc is None:
            # Already closed: closing again is harmless, as in the reference.
            return []
        if sc.half_closeable:
            raise NormalCloseUsedOnHalfCloseable(scid)
        if sc.state is not SubchannelState.OPEN:
            raise SubchannelClosedError(scid, "close")
        sc.state = SubchannelState.CLOSING
        return [SendClose(scid)]

    def lose_write_connection(self, scid: int) -> list[L5Action]:
        """Half close (``loseWriteConnection``): send CLOSE; reading may go on."""
        sc = self._subchannels.get(scid)
        if sc is None:
            return []
        if not sc.half_closeable:
            raise HalfCloseUsedOnNonHalfCloseable(scid)
        if sc.state is SubchannelState.OPEN:
            sc.state = SubchannelState.WRITE_CLOSED
        elif sc.state is SubchannelState.READ_CLOSED:
            del self._subchannels[scid]
        else:
            raise SubchannelClosedError(scid, "close")
        return [SendClose(scid), WriteConnectionLost(scid)]

    def register_listener(
        self, subprotocol: str, *, half_closeable: bool = False
    ) -> list[L5Action]:
        """Accept the peer's OPENs for ``subprotocol`` from now on.

        Returns what was held for it (expected names only): for each such
        subchannel, in arrival order, :class:`Accepted`, its buffered
        :class:`DataReceived`, and the effects of a buffered CLOSE.
        """
        _check_name(subprotocol)
        if subprotocol in self._listeners:
            raise ListenerExistsError(subprotocol)
        self._listeners[subprotocol] = half_closeable
        actions: list[L5Action] = []
        held = [
            sc
            for sc in self._subchannels.values()
            if sc.state is SubchannelState.PENDING and sc.subprotocol == subprotocol
        ]
        for sc in held:
            sc.state = SubchannelState.OPEN
            sc.half_closeable = half_closeable
            self._pending_bytes -= sc.pending_bytes
            actions.append(Accepted(sc.scid, subprotocol))
            actions.extend(DataReceived(sc.scid, d) for d in sc.pending_data)
            sc.pending_data = []
            sc.pending_bytes = 0
            if sc.pending_close:
                actions.extend(self._remote_close(sc))
        assert self._pending_bytes >= 0, self._pending_bytes
        return actions

    # --- records from the peer (after L4 removed duplicates) -------------------------

    def received(self, record: Open | Data | Close) -> list[L5Action]:
        """Dispatch one OPEN/DATA/CLOSE that L4 delivered."""
        match record:
            case Data(scid, _, data):
                return self._got_data(scid, data)
            case Open(scid, _, subprotocol):
                return self._got_open(scid, subprotocol)
            case Close(scid, _):
                return self._got_close(scid)
        raise TypeError(f"not an OPEN/DATA/CLOSE record: {record!r}")

    def _reject(self, scid: int, subprotocol: str, reason: str) -> list[L5Action]:
        log.warning("refusing subchannel %d (%r) opened by the peer: %s", scid, subprotocol, reason)
        self._rejected.add(scid)
        return [SendClose(scid), Rejected(scid, subprotocol, reason)]

    def _got_open(self, scid: int, subprotocol: str) -> list[L5Action]:
        if scid == 0:
            log.warning("ignoring an OPEN for the reserved subchannel id 0")
            return []
        if scid in self._subchannels or scid in self._rejected:
            log.warning("ignoring a duplicate OPEN for subchannel %d (%r)", scid, subprotocol)
            return []
        if self._role is not None and self._is_ours(scid):
            # The peer took an id from our half of the space. Refuse it, and
            # never allocate it ourselves, so the two cannot collide.
            index = (scid - 1) // 2 if self._role is Role.LEADER else (scid - 2) // 2
            self._next_index = max(self._next_index, index + 1)
            return self._reject(scid, subprotocol, "the peer used a subchannel id from our range")
        if subprotocol in self._listeners:
            self._subchannels[scid] = _Subchannel(
                scid,
                subprotocol,
                SubchannelState.OPEN,
                False,
                self._listeners[subprotocol],
            )
            return [Accepted(scid, subprotocol)]
        if subprotocol not in self._expected:
            return self._reject(scid, subprotocol, f"no listener for subprotocol {subprotocol!r}")
        cost = RECORD_HEADER_SIZE + len(subprotocol.encode("utf-8"))
        if self._pending_bytes + cost > self._max_pending:
            return self._reject(scid, subprotocol, self._overflow_reason(subprotocol))
        sc = _Subchannel(scid, subprotocol, SubchannelState.PENDING, False, False)
        sc.pending_bytes = cost
        self._pending_bytes += cost
        self._subchannels[scid] = sc
        log.info("holding subchannel %d until a listener for %r registers", scid, subprotocol)
        return []

    def _overflow_reason(self, subprotocol: str) -> str:
        return (
            f"more than {self._max_pending} bytes are waiting for listeners that are not "
            f"registered yet (subprotocol {subprotocol!r})"
        )

    def _got_data(self, scid: int, data: bytes) -> list[L5Action]:
        sc = self._subchannels.get(scid)
        if sc is None:
            if scid in self._rejected:
                log.debug("dropping DATA for refused subchannel %d", scid)
            else:
                log.warning("ignoring DATA for unknown subchannel %d", scid)
            return []
        if sc.state is SubchannelState.PENDING:
            if sc.pending_close:
                log.warning("ignoring DATA after CLOSE on subchannel %d", scid)
                return []
            cost = RECORD_HEADER_SIZE + len(data)
            if self._pending_bytes + cost > self._max_pending:
                # Drop what we held for it: the bound is the whole point.
                self._pending_bytes -= sc.pending_bytes
                del self._subchannels[scid]
                return self._reject(scid, sc.subprotocol, self._overflow_reason(sc.subprotocol))
            sc.pending_data.append(data)
            sc.pending_bytes += cost
            self._pending_bytes += cost
            return []
        if sc.state is SubchannelState.READ_CLOSED:
            log.warning("ignoring DATA after CLOSE on subchannel %d", scid)
            return []
        return [DataReceived(scid, data)]

    def _got_close(self, scid: int) -> list[L5Action]:
        sc = self._subchannels.get(scid)
        if sc is None:
            if scid in self._rejected:
                # The peer's answer to our refusal: this scid is finished.
                self._rejected.discard(scid)
            else:
                log.warning("ignoring CLOSE for unknown subchannel %d", scid)
            return []
        if sc.state is SubchannelState.PENDING:
            if sc.pending_close:
                log.warning("ignoring a second CLOSE for subchannel %d", scid)
            sc.pending_close = True
            return []
        return self._remote_close(sc)

    def _remote_close(self, sc: _Subchannel) -> list[L5Action]:
        scid = sc.scid
        state = sc.state
        if state is SubchannelState.OPEN:
            if sc.half_closeable:
                sc.state = SubchannelState.READ_CLOSED
                return [ReadConnectionLost(scid)]
            del self._subchannels[scid]
            return [SendClose(scid), ConnectionLost(scid)]
        if state is SubchannelState.CLOSING:
            del self._subchannels[scid]
            return [ConnectionLost(scid)]
        if state is SubchannelState.WRITE_CLOSED:
            del self._subchannels[scid]
            return [ReadConnectionLost(scid)]
        log.warning("ignoring a second CLOSE for subchannel %d", scid)
        return []

    # --- status -------------------------------------------------------------------

    def state_of(self, scid: int) -> SubchannelState | None:
        """The state of ``scid``, or None once it is gone (or was never known)."""
        sc = self._subchannels.get(scid)
        return None if sc is None else sc.state

    def status(self) -> TableStatus:
        return TableStatus(
            role=self._role,
            subchannels=tuple(
                SubchannelInfo(s.scid, s.subprotocol, s.state, s.opened_by_us, s.half_closeable)
                for s in self._subchannels.values()
            ),
            listeners=tuple(self._listeners),
            expected_subprotocols=self._expected,
            pending_bytes=self._pending_bytes,
        )
