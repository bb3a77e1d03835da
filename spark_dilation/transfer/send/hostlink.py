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

The local protocol is a :class:`~..link.LocalLink` (a Unix socket in a 0700
directory, frames in the clear; both ends are this package, same version)::

    client: hello(b"SDH1" token(32) kind(1)) frame(JSON)    kind P, M, A or L
    P only: frame(message) ... frame(empty)                 header .. trailer, then end
    host:   frame(JSON)                                     {"ok": ...} or {"error": ...}

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
from ..link import FrameTooLarge, LocalLink
from ..machine import alive, atomic_write, private_dir, spawn, wait_ready, write_private
from ..rules import codec
from ..rules.errors import LaneLostError, LinkError, ProtocolError, rebuild_error
from ..rules.protocol import CommittedPartition, Complete
from ..rules.report import ConnectionStats, with_choice
from ..rules.spec import TransferSpec
from . import meter
from .stream import PartitionStream

log = logging.getLogger(__name__)

KIND_PARTITION = b"P"
KIND_MANIFEST = b"M"
KIND_ABORT = b"A"
KIND_LINK = b"L"  # compression=auto: what the host's connections carry (no frames)
HOST_START_WAIT = 30.0  # a host being started: how long a task waits for its socket
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
    atomic_write(directory / "host.pid", str(proc.pid))
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
        return wait_ready(
            self.proc,
            self._spec,
            self._failed,
            time.monotonic() + self.peer_timeout + 60,  # + the host's own start
            "the sender process to agree on the code",
            "peer_timeout",
            log=self.dir / "host.log",
        )

    def _spec(self) -> TransferSpec | None:
        path = self.dir / "spec.pkl"
        if not path.exists():
            return None
        with open(path, "rb") as f:
            spec = pickle.load(f)
        os.unlink(path)  # it holds the transfer secret
        return spec

    def _failed(self) -> BaseException | None:
        # Whether it had exited before we look for its file: one that wrote its
        # error and then exited is not mistaken for one that wrote nothing.
        exited = self.proc.poll() is not None
        if (self.dir / "error.json").exists():
            error = json.loads((self.dir / "error.json").read_text())
            self.proc.wait(10)
            shutil.rmtree(self.dir, ignore_errors=True)  # the error says it all
            return rebuild_error(error)
        if exited:
            return TransferError(
                f"the sender process exited (code {self.proc.returncode}) before the "
                f"session over the code was agreed; see {self.dir / 'host.log'}"
            )
        return None


def _spawn(directory: Path, mode: str, start: Path) -> subprocess.Popen:
    return spawn(
        "spark_dilation.transfer.send.senderhost", [mode, str(start)], directory / "host.log"
    )


def _pid_alive(pid_file: Path) -> bool:
    try:
        return alive(int(pid_file.read_text()))
    except (OSError, ValueError):
        return False


def _connect(spec: TransferSpec, kind: bytes, request: dict) -> LocalLink | None:
    """A link to this machine's host with the request sent, or None if none runs."""
    path = socket_path(spec)
    pid_file = host_dir(spec) / "host.pid"

    def gone() -> BaseException | None:
        return None if _pid_alive(pid_file) else TransferError("no sender host runs here")

    try:
        # Started but not listening yet (it imports the stack first): worth the wait.
        wait_ready(
            None,
            lambda: path.exists() or None,
            gone,
            time.monotonic() + HOST_START_WAIT,
            "this machine's sender host to listen",
        )
        with unix_address(path) as address:
            link = LocalLink.open(address, host_token(spec), kind)
    except TransferError:  # none runs, or it is gone meanwhile (refused, no such file)
        return None
    try:
        link.send_json(request)
    except LinkError:
        link.close()
        return None
    return link


def _reply(link: LocalLink, what: str) -> dict:
    """The host's answer; its error re-raised as the same class, or LaneLostError."""
    try:
        answer = link.recv_json()
    except FrameTooLarge as e:
        raise ProtocolError(f"the sender host's answer is {e.size} bytes") from e
    except (LinkError, ValueError) as e:
        raise LaneLostError(
            f"this machine's sender host went away before it confirmed {what} ({e}); "
            f"its log is {host_dir_log(link.sock)}"
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
    link = _connect(spec, KIND_PARTITION, {"partition": partition, "attempt": attempt})
    if link is None:
        return None
    opts = spec.options
    # The host enforces the real deadlines and explains them; this one only
    # bounds a host that stopped answering.
    link.settimeout(opts.lane_start_timeout + 2 * opts.reconnect_timeout + 30)
    stream = PartitionStream(spec, partition, attempt, link=lambda: host_link(spec, partition))
    with link:
        try:
            for message in stream.messages(batches):
                link.send(message)
            link.send(b"")  # the end marker
        except LinkError as e:
            # The host closed on us: its answer (if it managed one) says why.
            raise _host_error_or(link, f"partition {partition}", e) from e
        answer = _reply(link, f"partition {partition}")
    done = Complete.from_body(answer["complete"])
    stats = answer["stats"]
    stats["paths"] = tuple(stats["paths"])
    return stream.committed(done, done.lane), with_choice(ConnectionStats(**stats), stream.choice)


def host_link(spec: TransferSpec, partition: int) -> codec.Link:
    """The link to ``partition``'s lane as this machine's host sees it (it holds the
    connections and measures); the host answers once that connection is up."""
    link = _connect(spec, KIND_LINK, {"partition": partition})
    if link is None:
        return meter.current_link(spec.transfer_id)
    link.settimeout(spec.options.lane_start_timeout + 30)
    with link:
        answer = _reply(link, "the link query")
    return codec.observed_link(str(answer["path"]), answer["rate"], bool(answer["exact"]))


def _host_error_or(link: LocalLink, what: str, error: LinkError) -> BaseException:
    link.settimeout(1.0)
    try:
        _reply(link, what)
    except (TransferError, ProtocolError) as e:
        return e
    return LaneLostError(f"this machine's sender host stopped taking {what}: {error}")


def deliver_manifest_via_host(
    spec: TransferSpec, partitions: list[CommittedPartition]
) -> ConnectionStats | None:
    """The manifest through the host (its connection stats); None if no host runs."""
    request = {"partitions": [asdict(p) for p in partitions]}
    link = _connect(spec, KIND_MANIFEST, request)
    if link is None:
        return None
    with link:
        link.settimeout(spec.options.lane_start_timeout + 30)
        stats = _reply(link, "the final manifest")["stats"]
    stats["paths"] = tuple(stats["paths"])
    return ConnectionStats(**stats)


def deliver_abort_via_host(spec: TransferSpec, reason: str, timeout: float) -> bool:
    """The abort through the host; False if no host runs here."""
    link = _connect(spec, KIND_ABORT, {"reason": reason, "timeout": timeout})
    if link is None:
        return False
    with link:
        link.settimeout(timeout + 10)
        _reply(link, "the abort")
    return True


def read_request(sock: socket.socket, token: bytes) -> tuple[LocalLink, bytes, dict[str, Any]]:
    """Host side: the link, kind and JSON body of a request; LinkError (or ValueError,
    a body that is not JSON) if it is not one of this transfer's."""
    link, kind = LocalLink.accept(sock, token)
    return link, kind, link.recv_json()


def read_frame(link: LocalLink) -> bytes | bytearray | None:
    """Host side: the next message of a partition, or None at its end marker (an
    empty frame); LinkError if the task went away.

    Each message gets a new buffer: the connection may still hold the last one.
    """
    try:
        message = link.recv()
    except FrameTooLarge as e:
        raise ProtocolError(f"a message of {e.size} bytes from a task") from e
    return message or None


def write_answer(link: LocalLink, answer: dict) -> None:
    link.send_json(answer)
