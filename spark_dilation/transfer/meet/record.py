"""A stream's pairing record on disk: read, written whole at mode 0600, revoked.

The record (:class:`~..rules.pairing.PairingRecord`) holds the pairing
secret: whoever reads it can resume the stream as this side. It is written
whole (a reader finds the old record or the new one) and only this user may
read it. Revoking keeps the file, marked, so the next run says why it cannot
resume instead of asking for a code as if nothing had been paired.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from ..machine import atomic_write
from ..rules.pairing import PairingError, PairingRecord


def load_record(path: str | Path) -> PairingRecord | None:
    """The record at ``path``, or None if there is none yet (the first run)."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise PairingError(f"cannot read the pairing record {path}: {e.strerror}") from None
    if path.stat().st_mode & 0o077:
        raise PairingError(
            f"the pairing record {path} can be read by other users; it holds the stream's "
            f"secret: revoke it and pair again, or chmod 600 it if nobody else could have"
        )
    return PairingRecord.from_json(text, str(path))


def save_record(path: str | Path, record: PairingRecord) -> None:
    """Write ``record`` whole, readable by this user only, and on disk before this
    returns: a run's incarnation must never be reused, even after a power loss."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, record.to_json(), mode=0o600, durable=True)


def revoke_record(path: str | Path, reason: str) -> PairingRecord:
    """Mark the record revoked (no run of this side resumes); the revoked record."""
    record = load_record(path)
    if record is None:
        raise PairingError(f"no pairing record at {path}")
    revoked = replace(record, revoked=reason or "revoked")
    save_record(path, revoked)
    return revoked
