"""L2 framing, sans-IO: relay handshake, prologue, then length-prefixed frames.

Wire facts (magic-wormhole 0.24 ``_dilation/connection.py:_Framer`` and
``connector.py``; see shared/WIRE.md §3.5):

1. Outbound to a transit relay only: send :func:`relay_handshake` and wait
   for exactly ``ok\\n``.
2. Both ends send their prologue (:data:`LEADER_PROLOGUE` or
   :data:`FOLLOWER_PROLOGUE`) and expect the other one.
3. After that everything is a frame: a 4-byte big-endian length and that many
   bytes (a Noise handshake message or Noise ciphertext).

:class:`Framer` is fed received bytes and returns events; it never touches a
socket. Unlike the reference, which re-slices one growing ``bytes`` per frame
(quadratic for many frames in one chunk), it slices complete frames out of the
received chunk without copying and keeps only the one incomplete frame in a
private buffer, which it hands over whole when the frame completes.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass

from ..errors import DilationError
from ..wormhole.keys import hkdf

LEADER_PROLOGUE = b"Magic-Wormhole Dilation Handshake v1 Leader\n\n"
FOLLOWER_PROLOGUE = b"Magic-Wormhole Dilation Handshake v1 Follower\n\n"
RELAY_OK = b"ok\n"

FRAME_HEADER_SIZE = 4
MAX_FRAME_LENGTH = 2**32 - 1  # what a 4-byte length can say
# The wire allows 4 GiB frames and the reference never splits a write(), but
# holding one 4 GiB frame in memory is never what we want: by default we accept
# records up to 64 MiB (our DATA records are about 1 MiB) plus the Noise tags
# (16 bytes per 65519-byte piece: 16,400 bytes at 64 MiB, so 64 KiB is ample).
# A longer length prefix fails at once, before anything is allocated for it.
DEFAULT_MAX_FRAME = 64 * 1024 * 1024 + 64 * 1024

_BE4 = struct.Struct(">L")
# How much of an unexpected reply we quote in an error message.
_QUOTE = 64


class FramingError(DilationError):
    """The byte stream broke the L2 framing rules: drop the connection.

    ``events`` holds whatever the failing :meth:`Framer.data_received` call
    produced before the error (for example good frames before a bad length),
    so a caller may still act on them.
    """

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.events: list[Event] = []


# --- events -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SendBytes:
    """Write these bytes (our prologue, once the relay said ok)."""

    data: bytes


@dataclass(frozen=True, slots=True)
class PrologueReceived:
    """The peer's prologue arrived intact: frames may flow both ways now."""


@dataclass(frozen=True, slots=True)
class Frame:
    """One frame's payload (without the length prefix).

    A ``memoryview`` into a received chunk, or a buffer the framer no longer
    uses: either way the receiver may keep it without copying.
    """

    payload: memoryview | bytes


Event = SendBytes | PrologueReceived | Frame


# --- encoding -----------------------------------------------------------------


def relay_handshake(dilation_key: bytes, dilation_side: str) -> bytes:
    """The sided transit-relay handshake (104 bytes for a 16-hex-digit side)."""
    token = hkdf(dilation_key, 32, b"transit_relay_token").hex()
    return f"please relay {token} for side {dilation_side}\n".encode("ascii")


def frame_header(length: int) -> bytes:
    """The 4-byte big-endian length prefix, for writers that send payloads separately."""
    if not 0 <= length <= MAX_FRAME_LENGTH:
        raise ValueError(f"a frame of {length} bytes does not fit a 4-byte length")
    return _BE4.pack(length)


def encode_frame(payload: bytes | bytearray | memoryview) -> bytes:
    """Length prefix + payload (copies the payload; see :func:`frame_header`)."""
    return frame_header(len(payload)) + payload


# --- decoding -----------------------------------------------------------------

_WANT_RELAY, _WANT_PROLOGUE, _WANT_FRAMES, _FAILED = range(4)


class Framer:
    """The receive side of one L2 connection, sans I/O.

    Call :meth:`connection_made` once and write what it returns, then feed
    every received chunk to :meth:`data_received`. Any violation raises
    :class:`FramingError`; after that the framer stays failed.
    """

    def __init__(
        self,
        outbound_prologue: bytes,
        inbound_prologue: bytes,
        *,
        relay_handshake: bytes | None = None,
        max_frame: int = DEFAULT_MAX_FRAME,
    ) -> None:
        if not 0 <= max_frame <= MAX_FRAME_LENGTH:
            raise ValueError(f"max_frame must be between 0 and {MAX_FRAME_LENGTH}")
        self._outbound_prologue = outbound_prologue
        self._inbound_prologue = inbound_prologue
        self._relay_handshake = relay_handshake
        self.max_frame = max_frame
        self._state = _WANT_RELAY if relay_handshake is not None else _WANT_PROLOGUE
        # Relay reply / prologue: how many bytes of the expected string matched.
        self._matched = 0
        # The one incomplete frame, from its length prefix on; never a
        # complete frame and never more than max_frame + 4 bytes.
        self._partial = bytearray()
        self._need = 0  # total size of the partial frame, once its header is known
        self._error: FramingError | None = None

    @property
    def prologue_received(self) -> bool:
        """True once the peer's prologue arrived: sending frames is allowed."""
        return self._state == _WANT_FRAMES

    @property
    def buffered(self) -> int:
        """Bytes held for an incomplete frame (at most ``max_frame + 4``)."""
        return len(self._partial)

    @property
    def missing(self) -> int:
        """Bytes known to be on their way: the rest of the incomplete frame (0 if none;
        only its header's rest while the header itself is incomplete)."""
        if not self._partial:
            return 0
        if self._need == 0:
            return FRAME_HEADER_SIZE - len(self._partial)
        return self._need - len(self._partial)

    def connection_made(self) -> bytes:
        """What to write first: the relay handshake if relaying, else our prologue."""
        if self._relay_handshake is not None:
            return self._relay_handshake
        return self._outbound_prologue

    def data_received(self, data: bytes | bytearray | memoryview) -> list[Event]:
        """Consume received bytes; return the events they complete, in order."""
        if self._error is not None:
            raise self._error
        if not isinstance(data, bytes):
            # Frames are zero-copy views into ``data``: it must not change later.
            data = bytes(data)
        events: list[Event] = []
        try:
            view = memoryview(data)
            if self._state == _WANT_RELAY:
                done, view = self._expect(view, RELAY_OK, self._relay_refused)
                if not done:
                    return events
                self._state, self._matched = _WANT_PROLOGUE, 0
                events.append(SendBytes(self._outbound_prologue))
            if self._state == _WANT_PROLOGUE:
                done, view = self._expect(view, self._inbound_prologue, self._bad_prologue)
                if not done:
                    return events
                self._state = _WANT_FRAMES
                events.append(PrologueReceived())
            self._frames(view, events)
        except FramingError as e:
            self._state, self._error = _FAILED, e
            self._partial = bytearray()
            e.events = events
            raise
        return events

    # -- relay reply and prologue ------------------------------------------------

    def _expect(
        self, view: memoryview, expected: bytes, complain: Callable[[bytes], FramingError]
    ) -> tuple[bool, memoryview]:
        """Match the next bytes against ``expected``, failing at the first wrong byte.

        Returns (all of ``expected`` has now arrived, the bytes after what we took).
        """
        start = self._matched
        take = min(len(expected) - start, len(view))
        if view[:take] != expected[start : start + take]:
            raise complain(expected[:start] + bytes(view[:_QUOTE]))
        self._matched += take
        return self._matched == len(expected), view[take:]

    def _relay_refused(self, got: bytes) -> FramingError:
        return FramingError(
            f"the transit relay did not accept the connection (it said {got!r}, "
            f"expected {RELAY_OK!r}): is the relay hint really a transit relay?"
        )

    def _bad_prologue(self, got: bytes) -> FramingError:
        if self._outbound_prologue.startswith(got[: len(self._outbound_prologue)]):
            # The first diverging byte is the role name: both ends chose the
            # same role, which only a broken peer (or a loop to ourselves) does.
            return FramingError(
                f"the peer announced the same Dilation role as ours ({got!r}): "
                "a connection to ourselves, or a broken peer"
            )
        return FramingError(
            f"the peer is not a Dilation peer: expected the prologue "
            f"{self._inbound_prologue!r}, got {got!r}"
        )

    # -- frames --------------------------------------------------------------------

    def _frames(self, view: memoryview, events: list[Event]) -> None:
        if self._partial:
            view = self._continue_partial(view, events)
        header = FRAME_HEADER_SIZE
        size = len(view)
        pos = 0
        unpack = _BE4.unpack_from
        # Complete frames inside this chunk: zero-copy views, no buffering.
        while size - pos >= header:
            length = unpack(view, pos)[0]
            if length > self.max_frame:
                raise self._too_long(length)
            end = pos + header + length
            if end > size:
                break
            events.append(Frame(view[pos + header : end]))
            pos = end
        if pos < size:
            self._start_partial(view[pos:])

    def _start_partial(self, rest: memoryview) -> None:
        self._partial = bytearray(rest)
        self._need = 0
        if len(rest) >= FRAME_HEADER_SIZE:
            self._need = FRAME_HEADER_SIZE + _BE4.unpack_from(rest, 0)[0]

    def _continue_partial(self, view: memoryview, events: list[Event]) -> memoryview:
        partial = self._partial
        if self._need == 0:
            # The length prefix itself arrived in pieces.
            take = min(FRAME_HEADER_SIZE - len(partial), len(view))
            partial += view[:take]
            view = view[take:]
            if len(partial) < FRAME_HEADER_SIZE:
                return view
            length = _BE4.unpack_from(partial, 0)[0]
            if length > self.max_frame:
                raise self._too_long(length)
            self._need = FRAME_HEADER_SIZE + length
        take = min(self._need - len(partial), len(view))
        partial += view[:take]  # bytearray growth is amortised: no quadratic copying
        if len(partial) == self._need:
            # Hand the buffer over whole (no copy) and start a fresh one.
            events.append(Frame(memoryview(partial)[FRAME_HEADER_SIZE:]))
            self._partial = bytearray()
            self._need = 0
        return view[take:]

    def _too_long(self, length: int) -> FramingError:
        return FramingError(
            f"the peer announced a frame of {length} bytes, above our limit of "
            f"{self.max_frame}: the connection is corrupt or hostile (raise max_frame "
            "if a peer really sends records this large)"
        )
