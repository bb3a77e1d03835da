"""L2 Noise, sans-IO: the NNpsk0 handshake and a fast transport cipher.

Wire facts (magic-wormhole 0.24 ``_dilation/connector.py:build_noise``,
``connection.py:_Record``; shared/WIRE.md §3.5):

* ``Noise_NNpsk0_25519_ChaChaPoly_BLAKE2s`` with the dilation key as PSK, an
  empty Noise prologue and empty handshake payloads. The Leader is the
  initiator: it sends msg1 (48 bytes) when the Follower's L2 prologue arrives;
  the Follower answers with msg2 (48 bytes).
* Transport: one CipherState per direction, ChaCha20-Poly1305 with the nonce
  ``4 zero bytes + 8-byte little-endian counter`` counting from 0 per Noise
  message, empty associated data.
* A record larger than :data:`NOISE_MAX_PAYLOAD` is cut into 65519-byte
  pieces, each encrypted on its own (one nonce each), and the ciphertexts are
  concatenated into ONE frame; the receiver decrypts a frame in 65535-byte
  slices.

The handshake runs on ``noiseprotocol`` (it is tiny and rare). The transport
does not: noiseprotocol copies every message and checks nothing about sizes,
so after the handshake we take the two CipherState keys and encrypt with
``cryptography``'s ChaCha20Poly1305 directly, into preallocated buffers.
"""

from __future__ import annotations

import struct
from collections.abc import Callable

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from noise.connection import NoiseConnection
from noise.exceptions import NoiseInvalidMessage

from ..errors import DilationError
from .framing import FRAME_HEADER_SIZE, frame_header

NOISE_PROTOCOL_NAME = b"Noise_NNpsk0_25519_ChaChaPoly_BLAKE2s"
NOISE_MAX_CIPHERTEXT = 65535  # the largest Noise message
NOISE_TAG_SIZE = 16  # Poly1305 tag on every message
NOISE_MAX_PAYLOAD = NOISE_MAX_CIPHERTEXT - NOISE_TAG_SIZE  # 65519
HANDSHAKE_MESSAGE_SIZE = 48  # an ephemeral key (32) + the tag of the empty payload
DILATION_KEY_SIZE = 32
# Frames up to this size are encrypted/decrypted in a per-connection scratch
# buffer (see NoiseTransport.encrypt_frame); bigger ones get a fresh buffer so
# one huge record does not pin that much memory for the connection's life.
SCRATCH_LIMIT = 4 * 1024 * 1024
# Noise reserves nonce 2**64 - 1; nobody sends that many messages on one
# connection, but we refuse rather than wrap.
MAX_NONCE = 2**64 - 1

BytesLike = bytes | bytearray | memoryview

# 4 zero bytes, then the counter as 8 little-endian bytes (noiseprotocol's
# ChaCha20Cipher.format_nonce; Noise spec §12.4).
_pack_nonce = struct.Struct("<4xQ").pack

# encrypt_into/decrypt_into write straight into our buffers; they are recent
# (cryptography 47), so older releases get an equivalent that copies once.
_HAS_INTO = hasattr(ChaCha20Poly1305, "encrypt_into")


class HandshakeError(DilationError):
    """The Noise handshake failed: the peer does not hold our dilation key."""


class DecryptError(DilationError):
    """A frame failed to decrypt: the connection is corrupt or forged; drop it."""


def encrypted_length(plaintext_length: int) -> int:
    """The frame length that carries a record of ``plaintext_length`` bytes."""
    pieces = max(1, -(-plaintext_length // NOISE_MAX_PAYLOAD))
    return plaintext_length + NOISE_TAG_SIZE * pieces


def decrypted_length(frame_length: int) -> int:
    """The plaintext length of a frame; :class:`DecryptError` if no frame is that long."""
    full, last = divmod(frame_length, NOISE_MAX_CIPHERTEXT)
    if (last and last < NOISE_TAG_SIZE) or frame_length == 0:
        raise DecryptError(
            f"a frame of {frame_length} bytes cannot be Noise ciphertext "
            f"(a piece shorter than the {NOISE_TAG_SIZE}-byte tag)"
        )
    return frame_length - NOISE_TAG_SIZE * (full + (1 if last else 0))


class NoiseHandshake:
    """One connection's Noise NNpsk0 handshake, sans I/O.

    Leader: ``msg1 = start()``, send it; ``receive(msg2)`` completes.
    Follower: ``start()`` returns None; ``msg2 = receive(msg1)``, send it;
    complete. Then :meth:`transport` gives the record cipher.
    """

    def __init__(self, dilation_key: bytes, *, leader: bool) -> None:
        if len(dilation_key) != DILATION_KEY_SIZE:
            raise ValueError(f"the dilation key must be {DILATION_KEY_SIZE} bytes")
        self.leader = leader
        self._noise = NoiseConnection.from_name(NOISE_PROTOCOL_NAME)
        self._noise.set_psks(dilation_key)
        if leader:
            self._noise.set_as_initiator()
        else:
            self._noise.set_as_responder()
        self._noise.start_handshake()
        self._started = False
        self._complete = False

    @property
    def complete(self) -> bool:
        """True once both handshake messages went through."""
        return self._complete

    def start(self) -> bytes | None:
        """Leader: msg1, to send as the first frame. Follower: None (it waits)."""
        if self._started:
            raise RuntimeError("NoiseHandshake.start() called twice")
        self._started = True
        if not self.leader:
            return None
        return bytes(self._noise.write_message())

    def receive(self, message: BytesLike) -> bytes | None:
        """Take the peer's handshake frame; the Follower gets msg2 back to send.

        Raises :class:`HandshakeError` if the peer used another key (another
        code) or sent something that is not a handshake message.
        """
        if not self._started or self._complete:
            raise RuntimeError("NoiseHandshake.receive() before start() or after completion")
        if len(message) < HANDSHAKE_MESSAGE_SIZE:
            raise HandshakeError(
                f"the peer sent a malformed Noise handshake message ({len(message)} bytes, "
                f"expected {HANDSHAKE_MESSAGE_SIZE})"
            )
        try:
            # The payload is empty and, like the reference, we ignore it.
            self._noise.read_message(bytes(message))
        except (InvalidTag, NoiseInvalidMessage):
            raise HandshakeError(
                "the peer used a different code (Noise handshake failed): this connection "
                "is not from our wormhole partner"
            ) from None
        except ValueError as e:
            # cryptography refuses a low-order X25519 point, for example.
            raise HandshakeError(f"the peer sent an invalid Noise handshake message: {e}") from e
        reply = None if self.leader else bytes(self._noise.write_message())
        if not self._noise.handshake_finished:  # pragma: no cover - NN is two messages
            raise RuntimeError("Noise handshake did not finish after two messages")
        self._complete = True
        return reply

    def transport(self) -> NoiseTransport:
        """The record cipher for this connection (only once :attr:`complete`)."""
        if not self._complete:
            raise RuntimeError("the Noise handshake is not complete")
        # noiseprotocol's split() leaves one CipherState per direction on the
        # NoiseProtocol object, already oriented for our role (initiator
        # sends with c1). Their ``k`` is the raw 32-byte ChaCha20 key.
        proto = self._noise.noise_protocol
        send, receive = proto.cipher_state_encrypt, proto.cipher_state_decrypt
        for state in (send, receive):
            if not (isinstance(state.k, bytes) and len(state.k) == 32 and state.n == 0):
                raise RuntimeError(  # pragma: no cover - a noiseprotocol we do not know
                    "unexpected noiseprotocol CipherState layout; pin noiseprotocol 0.3"
                )
        return NoiseTransport(send.k, receive.k)


class NoiseTransport:
    """Encrypts records into frame payloads and decrypts frames, one connection.

    Not thread-safe. After a :class:`DecryptError` the receive side is
    unusable (nonces of a half-decrypted frame are spent): drop the connection.
    """

    def __init__(self, send_key: bytes, receive_key: bytes) -> None:
        self._send = ChaCha20Poly1305(send_key)
        self._receive = ChaCha20Poly1305(receive_key)
        if _HAS_INTO:
            self._encrypt_into = self._send.encrypt_into
            self._decrypt_into = self._receive.decrypt_into
        else:
            self._encrypt_into = _copying_into(self._send.encrypt)
            self._decrypt_into = _copying_into(self._receive.decrypt)
        self._send_nonce = 0
        self._receive_nonce = 0
        self._receive_failed = False
        # Reusable buffers for multi-piece frames, one per direction (see
        # encrypt_frame and decrypt_frame_view).
        self._send_scratch = bytearray()
        self._receive_scratch = bytearray()

    @property
    def send_nonce(self) -> int:
        """The nonce of the next Noise message we send (= messages sent so far)."""
        return self._send_nonce

    @property
    def receive_nonce(self) -> int:
        """The nonce of the next Noise message we expect."""
        return self._receive_nonce

    # -- sending ---------------------------------------------------------------

    def encrypt_record(self, plaintext: BytesLike) -> bytes:
        """One frame payload for ``plaintext`` (65519-byte pieces, one nonce each)."""
        size = len(plaintext)
        if size <= NOISE_MAX_PAYLOAD:
            # The common case: cryptography hands back the bytes, no copy of ours.
            return self._send.encrypt(_pack_nonce(self._take_send_nonces(1)), plaintext, None)
        out = bytearray(encrypted_length(size))
        self.encrypt_record_into(plaintext, out)
        # One copy, because transports want bytes; encrypt_frame() avoids it.
        return bytes(out)

    def encrypt_frame(self, plaintext: BytesLike) -> bytes:
        """A whole frame (length prefix + ciphertext) as one new ``bytes``.

        Twisted's ``transport.write`` takes only ``bytes``, so this is what
        the connection writes. A multi-piece frame is encrypted into a
        scratch buffer that this transport keeps, then copied out once: the
        only fresh memory per frame is the returned ``bytes`` (fresh memory
        costs page faults, which dominated the CPU profile of ~1 MiB records).
        """
        size = len(plaintext)
        length = encrypted_length(size)
        if length <= NOISE_MAX_CIPHERTEXT:
            nonce = self._take_send_nonces(1)
            return frame_header(length) + self._send.encrypt(_pack_nonce(nonce), plaintext, None)
        out = self._send_buffer(FRAME_HEADER_SIZE + length)
        out[:FRAME_HEADER_SIZE] = frame_header(length)
        self.encrypt_record_into(plaintext, out[FRAME_HEADER_SIZE:])
        return bytes(out)

    def encrypt_frame_parts(self, head: BytesLike, body: BytesLike) -> bytes:
        """:meth:`encrypt_frame` of ``head + body`` without building that concatenation.

        For DATA records: ``head`` is the 9-byte record header
        (:func:`~.records.encode_data_header`), ``body`` the payload, which is
        read in place; only the first Noise piece (at most 65519 bytes) is
        assembled by copying. Same bytes on the wire as ``encrypt_frame``.
        """
        step = NOISE_MAX_PAYLOAD
        size = len(head) + len(body)
        length = encrypted_length(size)
        if length <= NOISE_MAX_CIPHERTEXT or len(head) > step:
            return self.encrypt_frame(bytes(head) + bytes(body))
        out = self._send_buffer(FRAME_HEADER_SIZE + length)
        out[:FRAME_HEADER_SIZE] = frame_header(length)
        pieces = (length - size) // NOISE_TAG_SIZE
        nonce = self._take_send_nonces(pieces)
        encrypt_into = self._encrypt_into
        src = memoryview(body)
        pos = step - len(head)  # body bytes that go in piece 0 (it is full: size > step)
        at = FRAME_HEADER_SIZE + step + NOISE_TAG_SIZE
        encrypt_into(_pack_nonce(nonce), bytes(head) + src[:pos], None, out[FRAME_HEADER_SIZE:at])
        for i in range(1, pieces):
            piece = src[pos : pos + step]
            end = at + len(piece) + NOISE_TAG_SIZE
            encrypt_into(_pack_nonce(nonce + i), piece, None, out[at:end])
            at, pos = end, pos + step
        return bytes(out)

    def _send_buffer(self, size: int) -> memoryview:
        """The reusable send buffer, ``size`` bytes long (a fresh one above SCRATCH_LIMIT)."""
        if size > SCRATCH_LIMIT:
            return memoryview(bytearray(size))
        if len(self._send_scratch) < size:
            self._send_scratch = _grown(self._send_scratch, size)
        return memoryview(self._send_scratch)[:size]

    def encrypt_record_into(self, plaintext: BytesLike, out: bytearray | memoryview) -> int:
        """Encrypt into ``out[:encrypted_length(len(plaintext))]``; return that length."""
        size = len(plaintext)
        length = encrypted_length(size)
        if len(out) < length:
            raise ValueError(f"output buffer of {len(out)} bytes, need {length}")
        src = memoryview(plaintext)
        dst = memoryview(out)
        pieces = (length - size) // NOISE_TAG_SIZE
        nonce = self._take_send_nonces(pieces)
        encrypt_into = self._encrypt_into
        step = NOISE_MAX_PAYLOAD
        pos = 0
        for i in range(pieces):
            n = min(step, size - pos)
            at = pos + NOISE_TAG_SIZE * i
            encrypt_into(
                _pack_nonce(nonce + i), src[pos : pos + n], None, dst[at : at + n + NOISE_TAG_SIZE]
            )
            pos += n
        return length

    def _take_send_nonces(self, count: int) -> int:
        first = self._send_nonce
        if first + count >= MAX_NONCE:
            raise DilationError("the Noise send nonce is exhausted: reconnect")
        self._send_nonce = first + count
        return first

    # -- receiving -------------------------------------------------------------

    def decrypt_frame(self, frame: BytesLike) -> bytes:
        """The plaintext record of one frame; :class:`DecryptError` if it is not authentic."""
        size = len(frame)
        if NOISE_TAG_SIZE <= size <= NOISE_MAX_CIPHERTEXT and not self._receive_failed:
            try:
                plaintext = self._receive.decrypt(_pack_nonce(self._receive_nonce), frame, None)
            except InvalidTag:
                raise self._failed() from None
            self._receive_nonce += 1
            return plaintext
        return bytes(self._decrypt_in_buffer(frame))

    def decrypt_frame_view(self, frame: BytesLike) -> bytes | memoryview:
        """Like :meth:`decrypt_frame`, but a multi-piece frame's plaintext is a
        view of a buffer this transport reuses: valid only until the next call.

        For a caller that parses the record at once and copies what it keeps
        (``decode_record`` does): it saves a fresh copy of every large record.
        """
        if len(frame) <= NOISE_MAX_CIPHERTEXT:
            return self.decrypt_frame(frame)
        return self._decrypt_in_buffer(frame)

    def _decrypt_in_buffer(self, frame: BytesLike) -> memoryview:
        """Decrypt any frame into the reusable receive buffer (fresh above SCRATCH_LIMIT)."""
        length = decrypted_length(len(frame))  # refuses impossible lengths first
        if length > SCRATCH_LIMIT:
            out = memoryview(bytearray(length))
        else:
            if len(self._receive_scratch) < length:
                self._receive_scratch = _grown(self._receive_scratch, length)
            out = memoryview(self._receive_scratch)[:length]
        self.decrypt_frame_into(frame, out)
        return out

    def decrypt_frame_into(self, frame: BytesLike, out: bytearray | memoryview) -> int:
        """Decrypt into ``out[:decrypted_length(len(frame))]``; return that length."""
        if self._receive_failed:
            raise DecryptError("this connection already failed to decrypt a frame")
        size = len(frame)
        length = decrypted_length(size)
        if len(out) < length:
            raise ValueError(f"output buffer of {len(out)} bytes, need {length}")
        src = memoryview(frame)
        dst = memoryview(out)
        decrypt_into = self._decrypt_into
        step = NOISE_MAX_CIPHERTEXT
        pos = 0
        at = 0
        try:
            while pos < size:
                piece = src[pos : pos + step]
                n = len(piece) - NOISE_TAG_SIZE
                decrypt_into(_pack_nonce(self._receive_nonce), piece, None, dst[at : at + n])
                self._receive_nonce += 1
                pos += step
                at += n
        except InvalidTag:
            raise self._failed() from None
        return length

    def _failed(self) -> DecryptError:
        self._receive_failed = True
        return DecryptError(
            "a frame failed Noise authentication: it was corrupted or forged "
            "(or the peer lost track of its nonces); dropping the connection"
        )


def _grown(buffer: bytearray, size: int) -> bytearray:
    """A new scratch buffer of at least ``size`` bytes (at most SCRATCH_LIMIT)."""
    return bytearray(min(SCRATCH_LIMIT, max(size, 2 * len(buffer))))


def _copying_into(operation: Callable[[bytes, BytesLike, None], bytes]) -> Callable[..., int]:
    """``encrypt_into``/``decrypt_into`` for cryptography releases without them."""

    def into(nonce: bytes, data: BytesLike, associated_data: None, buf: memoryview) -> int:
        result = operation(nonce, data, associated_data)
        buf[:] = result
        return len(result)

    return into
