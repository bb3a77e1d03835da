"""Key schedule of the wormhole: SPAKE2, HKDF purposes, phase encryption.

Byte-for-byte what magic-wormhole 0.24 does (``wormhole/_key.py``): a peer
that derives anything differently cannot read our messages.
"""

from __future__ import annotations

import json
import unicodedata
from hashlib import sha256

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from nacl.exceptions import CryptoError
from nacl.secret import SecretBox
from nacl.utils import random as random_bytes
from spake2 import SPAKE2_Symmetric

__all__ = [
    "CryptoError",
    "Pake",
    "decrypt_data",
    "derive_key",
    "derive_phase_key",
    "derive_verifier",
    "encrypt_data",
    "hkdf",
    "to_bytes",
]

KEY_SIZE = SecretBox.KEY_SIZE


def to_bytes(text: str) -> bytes:
    """Codes and purposes are NFC-normalised UTF-8, as the reference does."""
    return unicodedata.normalize("NFC", text).encode("utf-8")


def hkdf(ikm: bytes, length: int, info: bytes, salt: bytes | None = None) -> bytes:
    """RFC 5869 HKDF with SHA-256."""
    return HKDF(algorithm=hashes.SHA256(), length=length, salt=salt, info=info).derive(ikm)


def derive_key(key: bytes, purpose: bytes, length: int = KEY_SIZE) -> bytes:
    """A subkey of the wormhole key for one purpose."""
    if not isinstance(key, bytes) or not isinstance(purpose, bytes):
        raise TypeError("key and purpose must be bytes")
    return hkdf(key, length, purpose)


def derive_phase_key(key: bytes, side: str, phase: str) -> bytes:
    """The SecretBox key of one mailbox phase sent by one side."""
    purpose = (
        b"wormhole:phase:"
        + sha256(side.encode("ascii")).digest()
        + sha256(phase.encode("ascii")).digest()
    )
    return derive_key(key, purpose)


def derive_verifier(key: bytes) -> bytes:
    """What both users may compare out of band (``--verify``)."""
    return derive_key(key, b"wormhole:verifier")


def encrypt_data(key: bytes, plaintext: bytes) -> bytes:
    """SecretBox with a random 24-byte nonce, nonce prepended."""
    return bytes(SecretBox(key).encrypt(plaintext, random_bytes(SecretBox.NONCE_SIZE)))


def decrypt_data(key: bytes, encrypted: bytes) -> bytes:
    """Inverse of :func:`encrypt_data`; raises :class:`CryptoError`."""
    return SecretBox(key).decrypt(encrypted)


class Pake:
    """One side of SPAKE2-Symmetric keyed by the code and the app id."""

    def __init__(self, code: str, appid: str) -> None:
        self._spake = SPAKE2_Symmetric(to_bytes(code), idSymmetric=to_bytes(appid))
        self.outbound = self._spake.start()

    def message_body(self) -> bytes:
        """The plaintext body of the ``pake`` phase."""
        return json.dumps({"pake_v1": self.outbound.hex()}).encode("utf-8")

    def finish(self, body: bytes) -> bytes:
        """The shared key from the peer's ``pake`` body.

        Raises ``ValueError`` when the body is not a PAKE message or SPAKE2
        rejects it (including our own message reflected back at us).
        """
        try:
            payload = json.loads(body.decode("utf-8"))
            inbound = bytes.fromhex(payload["pake_v1"])
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"malformed PAKE message: {e}") from e
        try:
            return self._spake.finish(inbound)
        except Exception as e:  # spake2 raises several types for bad input
            raise ValueError(f"PAKE failed: {e!r}") from e
