"""The Spark sink's side of a stream's sending run (:mod:`.streamhost`).

``commit(batch)`` calls :func:`deliver_batch`: it starts this machine's
stream host for the pairing folder unless one runs, hands it the micro-batch
over a Unix socket (a :class:`~..link.LocalLink` in a 0700 folder; the token is
a file only this user can read) and returns when the receiving side has the
batch staged durably. Loads no network stack::

    client: hello(b"SDH1" token(32) b"B") frame(JSON request)
            per partition: frame(bytes) ... frame(empty)
    host:   frame({"waiting": why}) ... frame({"ok": {"seq": N}} or {"error": ...})
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import secrets
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ...errors import TransferError
from ..link import LocalLink
from ..machine import alive, atomic_write, private_dir, spawn, wait_ready, write_private
from ..rules.errors import LinkError, rebuild_error
from .hostlink import unix_address

log = logging.getLogger(__name__)

KIND_BATCH = b"B"
PART_FRAME = 16 * 1024 * 1024
HOST_START_WAIT = 60.0  # a host being started imports Twisted before it listens
# In the pairing folder, not the host's temp folder: why the last sending run ended,
# for the next commit to raise (and take). Nothing is left in $TMPDIR when a run ends.
HOST_ERROR = "host-error.json"


def stream_host_path(pairing_dir: Path, temp: str | None = None) -> Path:
    """This machine's folder for the stream host of ``pairing_dir`` (not made here), in
    ``temp`` (default: this process's temp folder, as the sink's and the host's)."""
    digest = hashlib.sha256(str(Path(pairing_dir).resolve()).encode()).hexdigest()[:16]
    return Path(temp or tempfile.gettempdir()) / "spark-dilation" / f"stream-{digest}"


def stream_host_dir(pairing_dir: Path) -> Path:
    """This machine's folder for the stream host of ``pairing_dir`` (created, 0700)."""
    return private_dir(stream_host_path(pairing_dir))


def _pid(directory: Path) -> int | None:
    with contextlib.suppress(OSError, ValueError):
        pid = int((directory / "host.pid").read_text())
        return pid if alive(pid) else None
    return None


def _left_error(pairing_dir: Path) -> BaseException | None:
    """The error a host that ended left (taken: the next start tries afresh)."""
    path = Path(pairing_dir) / HOST_ERROR
    with contextlib.suppress(OSError, ValueError):
        error = rebuild_error(json.loads(path.read_text()))
        path.unlink()
        return error
    return None


def ensure_host(pairing_dir: Path, start: dict[str, Any]) -> Path:
    """Start the stream host of ``pairing_dir`` unless one runs; its folder.

    ``start``: the code, the schema (base64 IPC), the mailbox URL, the
    Dilation options, the deadline and how the deadline's option is spelled.
    """
    import fcntl

    directory = stream_host_dir(pairing_dir)
    if _pid(directory) is not None:
        return directory
    # Spark asks for the writer in two driver processes at once: one launch at a time,
    # or the second would replace the first's token and pid under its host.
    fd = os.open(directory / "launch.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        if _pid(directory) is not None:
            return directory
        error = _left_error(pairing_dir)
        if error is not None:
            # The host ended with it (and removed its folder): leave nothing behind us
            # either, the lock file and the folder this call made again (if empty).
            for leave in (lambda: (directory / "launch.lock").unlink(), directory.rmdir):
                with contextlib.suppress(OSError):
                    leave()
            raise error
        token = secrets.token_bytes(32)
        atomic_write(directory / "token", token, mode=0o600)
        body = {**start, "pairing_dir": str(Path(pairing_dir).resolve()), "token": token}
        proc = spawn(
            "spark_dilation.transfer.send.streamhost",
            [str(write_private(directory, body))],
            directory / "host.log",
        )
        atomic_write(directory / "host.pid", str(proc.pid))
    finally:
        os.close(fd)
    return directory


def _open(directory: Path, pairing_dir: Path) -> LocalLink:
    sock = directory / "host.sock"

    def failed() -> BaseException | None:
        if _pid(directory) is not None:
            return None
        return _left_error(pairing_dir) or TransferError(
            f"the stream's sending process ended; see {directory / 'host.log'}"
        )

    wait_ready(
        None,
        lambda: sock.exists() or None,
        failed,
        time.monotonic() + HOST_START_WAIT,
        "this stream's sending process to start",
        log=directory / "host.log",
    )
    with unix_address(sock) as address:
        return LocalLink.open(address, (directory / "token").read_bytes(), KIND_BATCH)


def deliver_batch(
    pairing_dir: Path,
    start: dict[str, Any],
    request: dict[str, Any],
    parts: Sequence[bytes],
) -> int:
    """Hand micro-batch ``request["batch"]`` to the stream host; its sequence number on
    the receiving side once it is staged there (the host's error otherwise)."""
    directory = ensure_host(pairing_dir, start)
    link = _open(directory, pairing_dir)
    try:
        link.send_json(request)
        for data in parts:  # each in frames under the link's limit, then an empty one
            view = memoryview(data)
            for at in range(0, len(data), PART_FRAME):
                link.send(view[at : at + PART_FRAME])
            link.send(b"")
        while True:
            try:
                answer = link.recv_json(timeout=None)
            except LinkError as e:
                raise TransferError(
                    f"the stream's sending process went away before micro-batch "
                    f"{request['batch']} was staged ({e}); see {directory / 'host.log'}"
                ) from e
            if "waiting" in answer:
                log.warning(
                    "spark-dilation: micro-batch %s waits: %s", request["batch"], answer["waiting"]
                )
                continue
            if "error" in answer:
                raise rebuild_error(answer["error"])
            return int(answer["ok"]["seq"])
    finally:
        link.close()


def abort_batch(pairing_dir: Path, batch: int) -> None:
    """The sink aborted ``batch``: the host forgets it (if a host runs)."""
    directory = stream_host_dir(pairing_dir)
    if _pid(directory) is None or not (directory / "host.sock").exists():
        return
    with contextlib.suppress(TransferError, OSError):
        link = _open(directory, pairing_dir)
        try:
            link.send_json({"abort": batch})
            link.recv_json(timeout=10)
        finally:
            link.close()
