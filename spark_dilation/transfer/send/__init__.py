"""The writer's side of a transfer; this package is the Spark sink's one door.

``agree`` (the session, on the driver), ``send`` (one partition, in a task),
``commit`` and ``abort`` (on the driver) are :mod:`.verbs`; the modules under
them are the partition stream (:mod:`.stream`), the connection pool and its
deliveries (:mod:`.pool`), the local link to this machine's sender host
(:mod:`.hostlink`) and the host itself (:mod:`.senderhost`). Importing this
package loads no network stack.
"""

from __future__ import annotations

from ..meet.record import load_record
from .streamclient import abort_batch, deliver_batch
from .streamclient import ensure_host as ensure_stream_host
from .verbs import abort, agree, commit, send

__all__ = [
    "abort",
    "abort_batch",
    "agree",
    "commit",
    "deliver_batch",
    "ensure_stream_host",
    "load_record",
    "send",
]
