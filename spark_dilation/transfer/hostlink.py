"""Spark tasks' side of the sender host: hand a partition over a local socket.

``DilationDataSource.writer()`` starts one sender host per transfer on the
driver's machine (:func:`start_sender_host`, option ``sender_host``). A task
or the commit on that machine hands its work to the host, which holds the
Dilation connections to the lanes (:mod:`.senderhost`); the task encodes its
partition (Arrow IPC, checksum) and never loads Twisted, pairs with a lane or
opens a connection. Where no host runs (another machine, ``sender_host``
false, the host gone), the caller sends in-process (:mod:`.sender`).

The local protocol (a Unix socket in a 0700 directory; both ends are this
package, same version)::

    client: b"SDH1" token(32) kind(1) len(4) JSON     kind P, M or A
    P only: len(4) message ... len(4)=0               header .. trailer, then end
    host:   len(4) JSON                               {"ok": ...} or {"error": ...}

``token`` is an HMAC of the transfer secret, so only a process that holds
the transfer's spec can use its host.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import pickle
import socket
import struct
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pyarrow as pa

from ..errors import TransferError
from . import partition as errors_module
from .partition import LaneLostError, PartitionStream
from .protocol import CommittedPartition, Complete, ProtocolError, SchemaMismatchError
from .report import ConnectionStats
from .spec import TransferSpec

MAGIC = b"SDH1"
KIND_PARTITION = b"P"
KIND_MANIFEST = b"M"
KIND_ABORT = b"A"
_LEN = struct.Struct(">I")
MAX_REQUEST = 64 * 1024 * 1024  # a manifest of many partitions is still far below
HOST_START_WAIT = 30.0  # a host being started: how long a task waits for its socket
_NOSIGNAL = getattr(socket, "MSG_NOSIGNAL", 0)  # EPIPE, not SIGPIPE, if the host is gone
_AF_UNIX_PATH_MAX = 100  # sun_path is 104-108 bytes; stay under it everywhere


def host_dir(spec: TransferSpec) -> Path:
    return Path(tempfile.gettempdir()) / "spark-dilation" / f"send-{spec.transfer_id}"


def socket_path(spec: TransferSpec) -> Path:
    return host_dir(spec) / "host.sock"


def host_token(spec: TransferSpec) -> bytes:
    message = b"spark-dilation sender host v1:" + spec.transfer_id.encode()
    return hmac.new(spec.secret, message, hashlib.sha256).digest()


def start_sender_host(spec: TransferSpec) -> bool:
    """Start this machine's sender host for ``spec`` in the background (no waiting).

    Returns False (and the tasks send in-process) when the socket path would
    be too long for this system.
    """
    if len(str(socket_path(spec)).encode()) > _AF_UNIX_PATH_MAX:
        return False
    directory = host_dir(spec)
    directory.parent.mkdir(parents=True, exist_ok=True)
    directory.mkdir(mode=0o700, exist_ok=True)
    spec_path = directory / f".spec-{uuid.uuid4().hex}.pkl"
    fd = os.open(spec_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # holds the secret
    with os.fdopen(fd, "wb") as f:
        pickle.dump(spec, f)
    with open(directory / "host.log", "ab") as log_file:
        proc = subprocess.Popen(
            [sys.executable, "-m", "spark_dilation.transfer.senderhost", str(spec_path)],
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=log_file,
            start_new_session=True,  # outlives the planner worker that starts it
            close_fds=True,
        )
    (directory / "host.pid").write_text(str(proc.pid))
    return True


def _pid_alive(pid_file: Path) -> bool:
    try:
        pid = int(pid_file.read_text())
    except (OSError, ValueError):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie (exited, not reaped by its parent) still answers kill(0).
    with contextlib.suppress(OSError):
        if Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1].startswith("Z"):
            return False
    return True


def _connect(spec: TransferSpec, kind: bytes, request: dict) -> socket.socket | None:
    """A connection to this machine's host with the request sent, or None if none runs."""
    path = socket_path(spec)
    deadline = time.monotonic() + HOST_START_WAIT
    while not path.exists():
        # Started but not listening yet (it imports the stack first): worth the wait.
        if not _pid_alive(host_dir(spec) / "host.pid") or time.monotonic() > deadline:
            return None
        time.sleep(0.02)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(str(path))
    except OSError:  # gone meanwhile (refused, no such file)
        sock.close()
        return None
    body = json.dumps(request).encode()
    try:
        sock.sendall(MAGIC + host_token(spec) + kind + _LEN.pack(len(body)) + body, _NOSIGNAL)
    except OSError:
        sock.close()
        return None
    return sock


def recv_exactly(sock: socket.socket, n: int) -> bytearray:
    """``n`` bytes from ``sock`` in a new buffer; EOFError if it closes first."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise EOFError(f"closed after {got} of {n} bytes")
        got += k
    return buf


def _reply(sock: socket.socket, what: str) -> dict:
    """The host's answer; its error re-raised as the same class, or LaneLostError."""
    try:
        (n,) = _LEN.unpack(recv_exactly(sock, 4))
        if n > MAX_REQUEST:
            raise ProtocolError(f"the sender host's answer is {n} bytes")
        answer = json.loads(recv_exactly(sock, n))
    except (OSError, EOFError, ValueError) as e:
        raise LaneLostError(
            f"this machine's sender host went away before it confirmed {what} ({e}); "
            f"its log is {host_dir_log(sock)}"
        ) from e
    if "error" in answer:
        raise rebuild_error(answer["error"], answer.get("message", ""))
    return answer


def host_dir_log(sock: socket.socket) -> str:
    with contextlib.suppress(OSError):
        return str(Path(sock.getpeername()).parent / "host.log")
    return "host.log in the transfer's sender directory"


# Errors the host may answer with, by name: the task raises the same class.
_ERRORS: dict[str, type[BaseException]] = {
    "LaneNotStartedError": errors_module.LaneNotStartedError,
    "LaneLostError": LaneLostError,
    "LaneRefusedError": errors_module.LaneRefusedError,
    "ProtocolError": ProtocolError,
    "SchemaMismatchError": SchemaMismatchError,
}


def rebuild_error(name: str, message: str) -> BaseException:
    cls = _ERRORS.get(name)
    if cls is None:
        return TransferError(f"{message} ({name} in this machine's sender host)")
    error = cls.__new__(cls)
    Exception.__init__(error, message)
    return error


def send_partition_via_host(
    spec: TransferSpec, partition: int, attempt: int, batches: Iterable[pa.RecordBatch]
) -> tuple[CommittedPartition, ConnectionStats] | None:
    """Hand one partition to the host; None if no host runs here (send in-process)."""
    sock = _connect(spec, KIND_PARTITION, {"partition": partition, "attempt": attempt})
    if sock is None:
        return None
    opts = spec.options
    # The host enforces the real deadlines and explains them; this one only
    # bounds a host that stopped answering.
    sock.settimeout(opts.lane_start_timeout + 2 * opts.reconnect_timeout + 30)
    stream = PartitionStream(spec, partition, attempt)
    with sock:
        try:
            for message in stream.messages(batches):
                sock.sendall(_LEN.pack(len(message)), _NOSIGNAL)
                sock.sendall(message, _NOSIGNAL)
            sock.sendall(_LEN.pack(0), _NOSIGNAL)
        except OSError as e:
            # The host closed on us: its answer (if it managed one) says why.
            raise _host_error_or(sock, f"partition {partition}", e) from e
        answer = _reply(sock, f"partition {partition}")
    done = Complete.from_body(answer["complete"])
    stats = answer["stats"]
    stats["paths"] = tuple(stats["paths"])
    return stream.committed(done, done.lane), ConnectionStats(**stats)


def _host_error_or(sock: socket.socket, what: str, error: OSError) -> BaseException:
    sock.settimeout(1.0)
    try:
        _reply(sock, what)
    except (TransferError, ProtocolError) as e:
        return e
    return LaneLostError(f"this machine's sender host stopped taking {what}: {error}")


def deliver_manifest_via_host(
    spec: TransferSpec, partitions: list[CommittedPartition]
) -> int | None:
    """The manifest through the host (connections opened for it); None if no host runs."""
    request = {"partitions": [asdict(p) for p in partitions]}
    sock = _connect(spec, KIND_MANIFEST, request)
    if sock is None:
        return None
    with sock:
        sock.settimeout(spec.options.lane_start_timeout + 30)
        return int(_reply(sock, "the final manifest")["opened"])


def deliver_abort_via_host(spec: TransferSpec, reason: str, timeout: float) -> bool:
    """The abort through the host; False if no host runs here."""
    sock = _connect(spec, KIND_ABORT, {"reason": reason, "timeout": timeout})
    if sock is None:
        return False
    with sock:
        sock.settimeout(timeout + 10)
        _reply(sock, "the abort")
    return True


def read_request(sock: socket.socket, token: bytes) -> tuple[bytes, dict[str, Any]]:
    """Host side: the kind and JSON body of a request; ValueError if it is not ours."""
    head = recv_exactly(sock, len(MAGIC) + len(token) + 1 + 4)
    if head[:4] != MAGIC or not hmac.compare_digest(head[4 : 4 + len(token)], token):
        raise ValueError("not a request of this transfer")
    kind = bytes(head[4 + len(token) : 5 + len(token)])
    (n,) = _LEN.unpack(head[-4:])
    if n > MAX_REQUEST:
        raise ValueError(f"request of {n} bytes")
    return kind, json.loads(recv_exactly(sock, n))


def write_answer(sock: socket.socket, answer: dict) -> None:
    body = json.dumps(answer).encode()
    sock.sendall(_LEN.pack(len(body)) + body)
