"""The sender host: one process per transfer and machine that holds the connections.

``writer()`` starts it (``python -m spark_dilation.transfer.send.senderhost
--session FILE``) on the driver's machine. It imports the wormhole and
Dilation stack once, runs the session over the code, holds the writing end
of the transfer's directory (:mod:`..meet.hub`: every sending process of the
writer gets its sender id there), hands the agreed spec
back to ``writer()`` (``spec.pkl`` in its 0700 directory, read and removed at
once; a failed session leaves ``error.json`` instead), pairs with every lane
at once (so the first partition does not wait for it) and serves the Spark
tasks and the commit of this machine over a Unix socket (:mod:`.hostlink`
has the local protocol): each partition still gets its own subchannel on
the host's shared connection to its lane, with the same deadlines and errors
as in-process. ``--spec FILE`` serves an already agreed transfer.

Why: every sending Python process otherwise imports Twisted, autobahn and
the crypto libraries (about 0.4 CPU-s) and pairs with each lane (0.1-0.2 s);
on a busy sending core that is wall time (``docs/transfer.md``).

It exits after it delivered the manifest or the abort (writing that answer
first, without waiting for partition streams still under way), when no task
used it for ``idle_timeout`` seconds, or, on an executor machine, as soon as
the writing end is gone or says the transfer ended; tasks that find no host
send in-process.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pickle
import shutil
import socket
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict

from ...errors import DilationError, TransferError
from ..link import LocalLink
from ..machine import alive, atomic_write, owner_pid, private_dir, read_private, try_lock, watch
from ..meet.hub import HUB_CONNECT
from ..meet.views import sender_view
from ..rules.errors import LinkError, ProtocolError, error_record
from ..rules.protocol import CommittedPartition, lane_of
from ..rules.report import path_of
from ..rules.spec import TransferSpec
from . import meter
from .delivery import deliver_abort, deliver_manifest
from .hostlink import (
    KIND_ABORT,
    KIND_LINK,
    KIND_MANIFEST,
    KIND_PARTITION,
    host_dir,
    host_token,
    read_frame,
    read_request,
    socket_path,
    socket_path_fits,
    unix_address,
    write_answer,
)
from .pool import ConnectionPool, stream_partition

log = logging.getLogger("spark_dilation.transfer.send.senderhost")


class _TaskGone(TransferError):
    """The task closed its socket before the end of its partition (failed or killed)."""


OWNER_ENDED = (
    "the writing application ended (its Spark driver exited) before it committed the "
    "transfer; nothing of it will be emitted. Send the dataset again with a new code"
)


class SenderHost:
    """``abort_on_exit``: the driver machine's host (it ran the session) aborts the
    transfer when its application ends uncommitted; an executor machine's host only
    leaves (Spark runs that executor's tasks elsewhere)."""

    def __init__(
        self, spec: TransferSpec, owner: int | None = None, abort_on_exit: bool = True
    ) -> None:
        self.spec = spec
        self.owner = owner
        self.abort_on_exit = abort_on_exit
        self.pool = ConnectionPool()
        self.token = host_token(spec)
        self.idle = spec.options.idle_timeout
        self._lock = threading.Lock()
        self._active = 0
        self._last = time.monotonic()
        # The commit's or abort()'s request under way: its caller awaits the answer, so
        # the host writes it before it exits. Partition streams are not waited for: once
        # the manifest or the abort went out, a task still streaming has nothing to win.
        self._owed = 0
        self._done = threading.Event()
        self._orphaned = False
        """The application ended: its tasks' connections are not worth waiting for."""

    # --- lifecycle ---------------------------------------------------------------

    def run(self) -> int:
        path = socket_path(self.spec)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        with contextlib.suppress(FileNotFoundError):
            path.unlink()  # a stale socket of a host that was killed
        old_umask = os.umask(0o177)  # the socket is ours alone
        try:
            with unix_address(path) as address:  # a long path: by its directory's fd
                listener.bind(address)
        finally:
            os.umask(old_umask)
        listener.listen(64)
        listener.settimeout(0.5)
        log.info("sender host of transfer %s listening", self.spec.transfer_id)
        if self.abort_on_exit:
            # The driver machine's host pairs with every lane now (it will
            # carry the manifest to all of them); an executor's pairs on demand.
            for lane in range(self.spec.lanes):
                threading.Thread(target=self._warm, args=(lane,), daemon=True).start()
        watch(self.owner, self._owner_ended, self._done)
        if not self.abort_on_exit:
            threading.Thread(target=self._watch_writing_end, daemon=True).start()
        try:
            while not self._done.is_set() and not self._idle_expired():
                try:
                    conn, _ = listener.accept()
                except TimeoutError:
                    continue
                conn.settimeout(None)
                with self._lock:
                    self._active += 1
                threading.Thread(target=self._serve, args=(conn,), daemon=True).start()
        finally:
            listener.close()
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        if not self._orphaned:
            self._wait_for_answers(30.0)  # the commit or abort() awaits its answer
        self.pool.close_transfer(self.spec.transfer_id)
        if self._done.is_set():
            shutil.rmtree(host_dir(self.spec), ignore_errors=True)
        log.info("sender host done (%s)", "delivered" if self._done.is_set() else "idle")
        return 0

    def _watch_writing_end(self) -> None:
        """An executor machine's host: the transfer is over when the writing end (the
        driver machine's host, whose hub introduced us) is gone or says it ended; then
        leave, instead of idling for idle_timeout (a task that started this host after
        the driver's host ended would otherwise leave it behind)."""
        try:
            view = sender_view(self.spec, time.monotonic() + HUB_CONNECT)
        except (TransferError, DilationError) as e:
            log.info("the writing end of the transfer is not there (%s): leaving", e)
            self._done.set()
            return
        while not self._done.is_set():
            ended = view.wait_ended(time.monotonic() + 1.0)
            if ended:
                log.info("the transfer ended (%s): leaving", ended)
                self._done.set()

    def _owner_ended(self) -> None:
        """The writing application is gone without a commit or an abort: tell every lane."""
        self._orphaned = True
        if not self.abort_on_exit:
            log.info("this executor (pid %s) ended: leaving", self.owner)
            self._done.set()
            return
        log.warning("the writing application (pid %s) ended: aborting the transfer", self.owner)
        try:
            deliver_abort(self.spec, OWNER_ENDED, connections=self.pool)
        except Exception as e:  # the lanes' own deadlines still end them
            log.warning("could not deliver the abort: %s", e)
        finally:
            self._done.set()

    @property
    def delivered(self) -> bool:
        """The manifest or the abort went out through this host."""
        return self._done.is_set()

    def _idle_expired(self) -> bool:
        with self._lock:
            return self._active == 0 and time.monotonic() - self._last > self.idle

    def _wait_for_answers(self, limit: float) -> None:
        end = time.monotonic() + limit
        while time.monotonic() < end:
            with self._lock:
                if self._owed == 0:
                    return
            time.sleep(0.05)

    def _warm(self, lane: int) -> None:
        # Pair with the lane now, not when the first partition comes.
        deadline = time.monotonic() + self.spec.options.lane_start_timeout
        try:
            self.pool.get(self.spec, lane, deadline)
        except (DilationError, TimeoutError) as e:
            log.info("lane %d not reached yet: %s", lane, e)

    # --- one task's connection ----------------------------------------------------

    def _serve(self, conn: socket.socket) -> None:
        owed = 0
        try:
            with conn:
                try:
                    link, kind, request = read_request(conn, self.token)
                except (LinkError, ValueError) as e:
                    log.warning("dropped a local connection: %s", e)
                    return
                owed = int(kind in (KIND_MANIFEST, KIND_ABORT))
                with self._lock:
                    self._owed += owed
                try:
                    answer = self._handle(kind, request, link)
                except _TaskGone as e:
                    log.info("%s", e)
                    return
                except (DilationError, TimeoutError, ProtocolError) as e:
                    answer = {"error": error_record(e)}
                except Exception as e:  # a bug: tell the task, keep serving the others
                    log.exception("serving a task")
                    answer = {"error": error_record(e)}
                with contextlib.suppress(LinkError):
                    write_answer(link, answer)
        finally:
            with self._lock:
                self._active -= 1
                self._owed -= owed
                self._last = time.monotonic()

    def _handle(self, kind: bytes, request: dict, link: LocalLink) -> dict:
        spec = self.spec
        if kind == KIND_PARTITION:
            partition = int(request["partition"])
            log.info("partition %d: a task is sending it", partition)
            started = time.monotonic()
            done = stream_partition(
                spec, partition, self._messages(link, partition), connections=self.pool
            )
            log.info(
                "partition %d: confirmed by its lane after %.1f s", partition,
                time.monotonic() - started,
            )  # fmt: skip
            stats = asdict(self.pool.stats(spec.transfer_id))
            return {"complete": asdict(done), "stats": stats}
        if kind == KIND_MANIFEST:
            committed = [CommittedPartition(**p) for p in request["partitions"]]
            try:
                _, opened = deliver_manifest(spec, committed, connections=self.pool)
            finally:
                self._done.set()
            # Every connection this host opened (its own and the manifest's).
            return {"opened": opened, "stats": asdict(self.pool.stats(spec.transfer_id))}
        if kind == KIND_LINK:
            # The path of the partition's lane connection: the partition waits
            # for that connection anyway (within lane_start_timeout), so this costs
            # nothing; if it fails, the partition's own stream says why.
            lane = lane_of(int(request["partition"]), spec.lanes)
            path = "unknown"
            with contextlib.suppress(DilationError, TransferError, TimeoutError):
                wait = spec.options.lane_start_timeout
                conn = self.pool.get(spec, lane, time.monotonic() + wait)
                conn.wait_dilated(timeout=wait)
                path = path_of(conn.status().connection)
            known, rate, exact = meter.link_state(spec.transfer_id)
            return {"path": path if path != "unknown" else known, "rate": rate, "exact": exact}
        if kind == KIND_ABORT:
            try:
                deliver_abort(
                    spec, str(request["reason"]), float(request["timeout"]), connections=self.pool
                )
            finally:
                self._done.set()
            return {"ok": True}
        raise ProtocolError(f"unknown request kind {kind!r}")

    def _messages(self, link: LocalLink, partition: int) -> Iterator[bytes | bytearray]:
        """The partition's messages as the task sends them, up to its end marker."""
        first = True
        while True:
            try:
                message = read_frame(link)
            except LinkError as e:
                raise _TaskGone(
                    f"the task sending partition {partition} went away mid-partition "
                    "(its lane drops this attempt)"
                ) from e
            if message is None:
                return
            if first:
                log.info("partition %d: first message from the task", partition)
                first = False
            yield message


def main(argv: list[str] | None = None) -> int:
    """``--spec FILE``: serve an agreed transfer; ``--session FILE``: agree on the code first."""
    mode, start_path = argv if argv is not None else sys.argv[1:]
    owner = owner_pid()  # now, while the planner worker that started us still runs
    start = read_private(start_path)  # it holds the transfer secret (or the code)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s sender-host %(name)s %(levelname)s %(message)s"
    )
    logging.getLogger("twisted").setLevel(logging.WARNING)
    if mode == "--spec":
        # A task on an executor machine started us: one host per machine (the lock).
        spec = start
        if not _lock_host_dir(spec):
            return 0
        atomic_write(host_dir(spec) / "host.pid", str(os.getpid()))
        return SenderHost(spec, owner, abort_on_exit=False).run()
    launch_dir = os.path.dirname(start_path)
    spec = _agree(start, launch_dir)
    if spec is None:
        return 1
    from ..meet.hub import SenderHub

    # The writing end of the transfer's directory: every sending process of the
    # writer (this one is sender 0) is introduced to the lanes through it.
    hub = SenderHub(spec, serve=True)
    try:
        return _serve_agreed(hub.spec_with_hub(), owner, launch_dir)
    finally:
        hub.close()


def _serve_agreed(spec: TransferSpec, owner: int | None, launch_dir: str) -> int:
    serving = socket_path_fits(spec)
    if serving:
        # Before the spec is handed over: a task that finds this pid waits for the socket.
        directory = private_dir(host_dir(spec))
        _lock_host_dir(spec)
        atomic_write(directory / "host.pid", str(os.getpid()))
        with contextlib.suppress(OSError):
            (directory / "host.log").symlink_to(os.path.join(launch_dir, "host.log"))
    atomic_write(os.path.join(launch_dir, "spec.pkl"), pickle.dumps(spec), mode=0o600)
    if not serving:
        # No socket for the tasks (they send in-process); the hub still
        # introduces them, as long as the writing application runs.
        while owner is None or alive(owner):
            time.sleep(0.5)
        return 0
    host = SenderHost(spec, owner)
    code = host.run()
    if host.delivered:
        shutil.rmtree(launch_dir, ignore_errors=True)  # else its host.log stays
    return code


_host_lock: list[int] = []  # held for the life of this process


def _lock_host_dir(spec: TransferSpec) -> bool:
    """This machine's host lock for the transfer; False if another host holds it."""
    fd = try_lock(private_dir(host_dir(spec)) / ".lock")
    if fd is None:
        return False
    _host_lock.append(fd)
    return True


def _agree(start: dict, launch_dir: str) -> TransferSpec | None:
    """The session over the code, as ``writer()`` used to run it; errors go to error.json."""
    from ..meet.session import SenderSession

    try:
        session = SenderSession.open(
            start["schema"], start["options"], code=start["code"], source="spark"
        )
        spec = session.wait()
    except Exception as e:
        log.info("the session over the code failed: %s", e)
        body = json.dumps(error_record(e))
        atomic_write(os.path.join(launch_dir, "error.json"), body, mode=0o600)
        return None
    log.info("dataset transfer %s agreed: %d lanes", spec.transfer_id, spec.lanes)
    return spec


if __name__ == "__main__":
    sys.exit(main())
