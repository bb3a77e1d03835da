"""A stream's pairing, from Python and the command line: revoke it.

``revoke_stream(path)`` takes a pairing folder (``pairing_dir``) or its
``pairing.json``. The record is marked revoked on disk first, so no run of
this side resumes whatever happens next; then the ``revoked`` message goes to
the standing mailbox, where every run of the other side hears it and ends.
"""

from __future__ import annotations

from pathlib import Path

from ...wormhole.blocking import ensure_reactor, run_and_wait
from ..meet.resume import revoke_pairing
from ..rules.errors import SessionTimeout
from ..rules.pairing import RECORD_NAME


def record_path(path: str | Path) -> Path:
    """``path`` if it is a record file, else the record in the folder ``path``."""
    path = Path(path).expanduser()
    return path / RECORD_NAME if path.is_dir() else path


def revoke_stream(path: str | Path, reason: str = "", timeout: float = 30.0) -> bool:
    """Revoke the pairing at ``path``; whether the mailbox server confirmed it in time."""
    from twisted.internet import defer

    ensure_reactor()
    record = record_path(path)

    def revoke() -> defer.Deferred:
        from twisted.internet import reactor

        return defer.ensureDeferred(revoke_pairing(reactor, record, reason, timeout))

    _, confirmed = run_and_wait(
        revoke,
        timeout=timeout + 15,
        on_timeout=lambda: SessionTimeout(f"revoking {record} did not finish"),
    )
    return confirmed
