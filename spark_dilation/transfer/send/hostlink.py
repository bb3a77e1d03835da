"""Spark tasks' side of the sender host: hand a partition over a local socket.

``DilationDataSource.writer()`` starts one sender host per transfer on the
driver's machine (:class:`HostLaunch`, option ``sender_host``): the host runs
the session over the code and hands the agreed spec back to ``writer()``,
which then loads no network stack of its own. A task or the commit on that
machine hands its work to the host, which holds the Dilation connections to
the lanes (:mod:`.senderhost`); the task encodes its partition (Arrow IPC,
checksum) and never loads Twisted, pairs with a lane or opens a connection.
Where no host runs (another machine, ``sender_host`` false, the host gone),
the caller sends in-process (:mod:`.pool`).

The local protocol (a Unix socket in a 0700 directory; both ends are this
package, same version)::

    client: b"SDH1" token(32) kind(1) len(4) JSON     kind P, M, A or L
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
import logging
import os
import pickle
import shutil
import socket
import struct
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pyarrow as pa

from ...errors import TransferError
from ..machine import alive, private_dir, spawn, write_private
from ..rules import codec
from ..rules.errors import LaneLostError, ProtocolError, rebuild_error
from ..rules.protocol import CommittedPartition, Complete
from ..rules.report import ConnectionStats, with_choice
from ..rules.spec import TransferSpec
from .stream import PartitionStream

log = logging.getLogger(__name__)

MAGIC = b"SDH1"
KIND_PARTITION = b"P"
KIND_MANIFEST = b"M"
KIND_ABORT = b"A"
KIND_LINK = b"L"  # compression=auto: what the host's connections carry (no frames)
_LEN = struct.Struct(">I")
MAX_REQUEST = 64 * 1024 * 1024  # a manifest of many partitions is still far below
HOST_START_WAIT = 30.0  # a host being started: how long a task waits for its socket
_NOSIGNAL = getattr(socket, "MSG_NOSIGNAL", 0)  # EPIPE, not SIGPIPE, if the host is gone
_AF_UNIX_PATH_MAX = 100  # sun_path is 104-108 bytes; stay under it everywhere
# A longer socket path is reached through its directory's descriptor: the
# kernel resolves /proc/self/fd/N/host.sock to the real (0700) directory.
_PROC_FD = Path("/proc/self/fd")
_warned_long: set[str] = set()


def host_dir(spec: TransferSpec) -> Path:
    return Path(tempfile.gettempdir()) / "spark-dilation" / f"send-{spec.transfer_id}"


def socket_path(spec: TransferSpec) -> Path:
    return host_dir(spec) / "host.sock"


def host_token(spec: TransferSpec) -> bytes:
    message = b"spark-dilation sender host v1:" + spec.transfer_id.encode()
    return hmac.new(spec.secret, message, hashlib.sha256).digest()


def start_sender_host(spec: TransferSpec) -> bool:
    """Start this machine's sender host for an agreed ``spec`` unless one runs (no waiting).

    Returns False (and the tasks send in-process) when the socket path would
    be too long for this system. Tasks on executor machines call it, so each
    sending machine holds at most one connection per lane.
    """
    if not socket_path_fits(spec):
        return False
    directory = private_dir(host_dir(spec))
    if socket_path(spec).exists() or _pid_alive(directory / "host.pid"):
        return True
    proc = _spawn(directory, "--spec", write_private(directory, spec))
    # Now, so that the tasks arriving meanwhile wait for its socket (_connect).
    (directory / "host.pid").write_text(str(proc.pid))
    return True


def socket_path_fits(spec: TransferSpec) -> bool:
    """Whether the host's socket can be bound here: its path fits ``sun_path``, or
    /proc/self/fd gives a short name for it. If not, one warning says why the
    sender host is not used (the tasks then send in-process)."""
    path = socket_path(spec)
    if len(os.fsencode(path)) <= _AF_UNIX_PATH_MAX or _PROC_FD.is_dir():
        return True
    if str(path) not in _warned_long:
        _warned_long.add(str(path))
        log.warning(
            "not using a sender host for transfer %s: its socket path %s is %d bytes, over "
            "this system's Unix socket limit (%d); the tasks send on their own. Set TMPDIR "
            "to a shorter directory to use one.",
            spec.transfer_id,
            path,
            len(os.fsencode(path)),
            _AF_UNIX_PATH_MAX,
        )
    return False


@contextlib.contextmanager
def unix_address(path: Path) -> Iterator[str]:
    """The name to ``bind``/``connect`` the Unix socket ``path`` by (valid inside the block).

    ``path`` itself when it fits ``sun_path``; else ``/proc/self/fd/N/NAME``
    with N a descriptor of its directory (thread-safe, unlike a chdir, and the
    directory's permissions still apply).
    """
    if len(os.fsencode(path)) <= _AF_UNIX_PATH_MAX:
        yield str(path)
        return
    fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        yield str(_PROC_FD / str(fd) / path.name)
    finally:
        os.close(fd)


class HostLaunch:
    """A sender host that first runs the session over the code (``writer()``).

    The planner worker that calls ``writer()`` then needs no network stack
    of its own: it waits for the agreed spec (:meth:`wait_spec`), or for the
    session's error, which it raises as the same class with the same message.
    """

    def __init__(self, schema: pa.Schema, options: Any, code: str) -> None:
        self.dir = private_dir(
            Path(tempfile.gettempdir()) / "spark-dilation" / f"start-{uuid.uuid4().hex}"
        )
        self.peer_timeout = float(options.peer_timeout)
        start = write_private(self.dir, {"schema": schema, "options": options, "code": code})
        self.proc = _spawn(self.dir, "--session", start)

    def wait_spec(self) -> TransferSpec:
        """The agreed spec, once the receiver used the code (bounded by ``peer_timeout``)."""
        deadline = time.monotonic() + self.peer_timeout + 60  # + the host's own start
        while True:
            # Whether it had exited before we look for its files: one that wrote
            # them and then exited is not mistaken for one that wrote nothing.
            exited = self.proc.poll() is not None
            if (self.dir / "spec.pkl").exists():
                with open(self.dir / "spec.pkl", "rb") as f:
                    spec = pickle.load(f)
                os.unlink(self.dir / "spec.pkl")  # it holds the transfer secret
                return spec
            if (self.dir / "error.json").exists():
                error = json.loads((self.dir / "error.json").read_text())
                self.proc.wait(10)
                shutil.rmtree(self.dir, ignore_errors=True)  # the error says it all
                raise rebuild_error(error)
            if exited:
                raise TransferError(
                    f"the sender process exited (code {self.proc.returncode}) before the "
                    f"session over the code was agreed; see {self.dir / 'host.log'}"
                )
            if time.monotonic() > deadline:
                self.proc.kill()
                raise TransferError(
                    f"the sender process did not agree on the code within "
                    f"{self.peer_timeout:g} s (option peer_timeout); see {self.dir / 'host.log'}"
                )
            time.sleep(0.02)


def _spawn(directory: Path, mode: str, start: Path) -> subprocess.Popen:
    return spawn(
        "spark_dilation.transfer.send.senderhost", [mode, str(start)], directory / "host.log"
    )


def _pid_alive(pid_file: Path) -> bool:
    try:
        return alive(int(pid_file.read_text()))
    except (OSError, ValueError):
        return False


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
        with unix_address(path) as address:
            sock.connect(address)
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
        raise rebuild_error(answer["error"])
    return answer


def host_dir_log(sock: socket.socket) -> str:
    with contextlib.suppress(OSError):
        peer = sock.getpeername()
        if not peer.startswith(str(_PROC_FD)):  # a descriptor's name says nothing later
            return str(Path(peer).parent / "host.log")
    return "host.log in the transfer's sender directory"


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
    stream = PartitionStream(spec, partition, attempt, link=lambda: host_link(spec, partition))
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
    return stream.committed(done, done.lane), with_choice(ConnectionStats(**stats), stream.choice)


def host_link(spec: TransferSpec, partition: int) -> codec.Link:
    """The link to ``partition``'s lane as this machine's host sees it (it holds the
    connections and measures); the host answers once that connection is up."""
    sock = _connect(spec, KIND_LINK, {"partition": partition})
    if sock is None:
        return codec.current_link(spec.transfer_id)
    sock.settimeout(spec.options.lane_start_timeout + 30)
    with sock:
        answer = _reply(sock, "the link query")
    return codec.observed_link(str(answer["path"]), answer["rate"], bool(answer["exact"]))


def _host_error_or(sock: socket.socket, what: str, error: OSError) -> BaseException:
    sock.settimeout(1.0)
    try:
        _reply(sock, what)
    except (TransferError, ProtocolError) as e:
        return e
    return LaneLostError(f"this machine's sender host stopped taking {what}: {error}")


def deliver_manifest_via_host(
    spec: TransferSpec, partitions: list[CommittedPartition]
) -> ConnectionStats | None:
    """The manifest through the host (its connection stats); None if no host runs."""
    request = {"partitions": [asdict(p) for p in partitions]}
    sock = _connect(spec, KIND_MANIFEST, request)
    if sock is None:
        return None
    with sock:
        sock.settimeout(spec.options.lane_start_timeout + 30)
        stats = _reply(sock, "the final manifest")["stats"]
    stats["paths"] = tuple(stats["paths"])
    return ConnectionStats(**stats)


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


def read_frame(sock: socket.socket) -> bytearray | None:
    """Host side: the next message of a partition, or None at its end marker.

    Each message gets a new buffer: the connection may still hold the last one.
    """
    (n,) = _LEN.unpack(recv_exactly(sock, _LEN.size))
    if n == 0:
        return None
    if n > MAX_REQUEST:
        raise ProtocolError(f"a message of {n} bytes from a task")
    return recv_exactly(sock, n)


def write_answer(sock: socket.socket, answer: dict) -> None:
    body = json.dumps(answer).encode()
    sock.sendall(_LEN.pack(len(body)) + body)
