"""The lane host: one lane of a loaded dataset on one machine, in a process of its own.

``read_lane`` starts it (``python -m spark_dilation.transfer.receive.lanehost SPEC
LANE LAUNCHER_PID``) so that receiving does not depend on the Spark Python
worker that asked for the lane: Spark ends a worker when ``show()`` has its
rows and kills idle ones. The host holds the lane's lock on this machine.

With a lane registry (``spec.registry``, every Spark read), the host claims
its lane there and does what the registry says (:mod:`..rules.registry`): receive
it from the sender, copy it from a machine that holds it, or report the
lane's error. Then it serves its complete copy to the other executors and
lives as long as the reading application: when the registry's link ends,
it removes the lane's staging and exits. The registry's process is also the
reading end of the transfer's directory, so a host is never started without
one (the Python API receives its lanes in-process).
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import threading
import time
from typing import Any

from ...errors import TransferError
from ..machine import atomic_write, read_private
from ..rules.protocol import Abort
from ..rules.spec import TransferSpec
from .lane import LaneReceiver
from .staging import LaneStaging, take_lane_lock, write_host_error

log = logging.getLogger(__name__)

WAIT_POLL = 0.5  # how often a host asks again when no copy it was told of answered
COPY_RETRY = 15.0  # how long a host tries the copies it was told of (the registry drops dead ones)
ORPHAN_LINGER = 30.0  # a host that never reached its registry keeps its error at most this long
END_NOTICE = 3.0  # how long a host that loses its application tells the senders why
END_FLUSH = 0.5  # s it then waits after A went out, when the senders' answer is slow
STAGING_CHECK = 1.0  # how often a complete host checks that its staged copy still exists


def main(argv: list[str] | None = None) -> int:
    spec_path, lane_text, launcher_text = argv if argv is not None else sys.argv[1:]
    lane = int(lane_text)
    # The process that started this host, named by itself: by the time this runs,
    # a launcher that has died already (a read task killed with its executor) is
    # no longer our parent, and getppid() would name init instead.
    launcher = int(launcher_text)
    spec = read_private(spec_path)  # it holds the transfer secret
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s lane-{lane} %(name)s %(levelname)s %(message)s"
    )
    logging.getLogger("twisted").setLevel(logging.WARNING)
    staging = LaneStaging(spec.options.staging_root, spec.transfer_id, lane)
    if spec.registry is None:
        # Senders meet a lane through the reading end of the directory, which the
        # registry's process holds: without one, no sender could ever reach it.
        write_host_error(
            staging, TransferError("a lane host needs the reading application's lane registry")
        )
        return 1
    return RegisteredLane(spec, lane, staging, launcher).run()


class RegisteredLane:
    """One lane on this machine under the application's registry (see the module docstring)."""

    def __init__(self, spec: TransferSpec, lane: int, staging: LaneStaging, launcher: int) -> None:
        self.spec, self.lane, self.staging = spec, lane, staging
        self.receiver: LaneReceiver | None = None
        self.ended = threading.Event()
        # Set before this host removes its own staging: the copy watch must not take
        # that removal for a deletion under it and exit the process half-way through.
        self.removing = threading.Event()
        self.launcher = launcher  # the read task's Python worker (or registry) that started it
        # The writing end's abort, passed on by the registry; it may come before the
        # lane's receiver exists (right after the claim's answer), which then takes it.
        self._lock = threading.Lock()
        self.aborted: Abort | None = None

    def run(self) -> int:
        from .laneshare import LaneServer
        from .registrylink import RegistryLink

        fd = take_lane_lock(self.staging)
        if fd is None:
            return 0  # another host holds the lane on this machine
        atomic_write(self.staging.dir / "host.pid", str(os.getpid()))
        try:
            registry = RegistryLink(self.spec, self._application_ended)
            registry.on_abort = self._writer_aborted
        except TransferError as e:
            write_host_error(self.staging, e)
            self._linger_for_launcher()
            self._remove_staging()
            return 1
        server = LaneServer(self.spec, self.lane, self.staging)
        try:
            error = self._obtain(registry, server, fd)
        except Exception as e:  # a bug or the registry lost: say so to the read task
            log.exception("lane %d: failed", self.lane)
            error = e if isinstance(e, TransferError) else TransferError(f"lane {self.lane}: {e}")
        if error is not None:
            from ..rules.errors import error_record

            try:
                write_host_error(self.staging, error)
            except OSError as e:  # a full disk, often the error itself: the registry hears it
                log.warning("lane %d: could not keep its error: %s", self.lane, e)
            registry.report({"failed": self.lane, "error": error_record(error)})
        else:
            done: dict[str, Any] = {"done": self.lane}
            if self.receiver is not None:
                # What this lane received from the senders, for the receive report.
                made, reconnects, paths, _, _ = self.receiver.live_stats()
                done.update(connections=made, reconnects=reconnects, paths=paths)
            registry.report(done)
        log.info("lane %d: %s; serving until the application ends", self.lane, error or "complete")
        while not self.ended.wait(STAGING_CHECK):
            if error is None and self.copy_deleted():
                # Deleted under us (a temp cleaner, a user). Leave: the registry then
                # drops this copy, and with the last one gone the next action fails
                # "cannot heal" at once. Remove nothing: the directory may be a new
                # host's now.
                log.warning(
                    "lane %d: its staged copy in %s is gone; this host leaves",
                    self.lane, self.staging.dir,
                )  # fmt: skip
                registry.report({"deleted": self.lane})  # the cause, for the lane's error
                os._exit(0)
        server.close()
        return 0

    def _obtain(self, registry: Any, server: Any, fd: int) -> BaseException | None:
        """Get the complete lane as the registry says; the lane's error, if any."""
        from ..rules.errors import LinkError, rebuild_error
        from ..rules.registry import HostInfo
        from .laneshare import fetch_lane

        copy_deadline: float | None = None
        while True:
            complete = self.staging.manifest() is not None
            answer = registry.claim(self.lane, server.host, complete)
            action = answer["do"]
            if action == "serve":
                return None
            if action == "error":
                return rebuild_error(answer["error"])
            if action == "receive":
                epoch = int(answer.get("epoch", 0))
                # A copy of the lock's descriptor: the receiver closes its own when the
                # lane ends, and this host keeps the lock for as long as it lives. A lane
                # that failed at once (a full disk) and let go would look, to the read
                # task waiting for its host, like a host that never started.
                receiver = LaneReceiver(
                    self.spec, self.lane, self.staging, os.dup(fd), epoch=epoch, causes=registry
                )
                with self._lock:
                    self.receiver, aborted = receiver, self.aborted
                receiver.start()
                if aborted is not None:
                    receiver.sender_ended(aborted, linger=0)
                error = receiver.wait_finished()
                receiver.stop(linger=2.0)
                return error
            assert action == "fetch"
            copy_deadline = copy_deadline or time.monotonic() + COPY_RETRY
            for source in answer["sources"]:
                try:
                    fetch_lane(self.spec, self.lane, self.staging, HostInfo.from_json(source))
                    return None
                except TransferError as e:
                    if not isinstance(e, LinkError):
                        return e  # the lane's own error (aborted, cannot heal)
                    log.warning("lane %d: copy from %s failed: %s", self.lane, source["machine"], e)
                except Exception as e:  # that copy is gone or broken: the next one
                    log.warning("lane %d: copy from %s failed: %s", self.lane, source["machine"], e)
            if time.monotonic() > copy_deadline:
                return TransferError(
                    f"lane {self.lane}: no machine that holds a copy of it answered within "
                    f"{COPY_RETRY:g} s; the executors that staged it may be lost"
                )
            time.sleep(WAIT_POLL)

    def _linger_for_launcher(self) -> None:
        """Keep the error for the read task that started this host (removing the staging
        with it would let that task start another host, never seeing why), but only
        while that task's worker lives: when the application itself has ended, Spark
        kills its workers within seconds and nothing may stay behind for long."""
        from ..machine import alive

        deadline = time.monotonic() + ORPHAN_LINGER
        while time.monotonic() < deadline and alive(self.launcher):
            time.sleep(0.2)

    def _writer_aborted(self, body: dict[str, Any]) -> None:
        """The writing end ended the transfer (heard by the registry on the directory
        link, ahead of the data queued on our connections): end the lane now."""
        abort = Abort.from_body(body)
        log.info("lane %d: %s (directory link)", self.lane, abort.text("sender"))
        with self._lock:
            self.aborted, receiver = abort, self.receiver
        if receiver is not None:
            receiver.sender_ended(abort, linger=0)

    def copy_deleted(self) -> bool:
        """Whether the complete staged copy went under this host (a temp cleaner, a user),
        not by this host's own removal (the application ended). The manifest first, then
        the flag: the removal sets the flag before it deletes anything, so however the
        two interleave, a read that misses the manifest then sees the flag."""
        return self.staging.manifest() is None and not self.removing.is_set()

    def _application_ended(self, why: str) -> None:
        log.info("lane %d: the registry's link ended (%s): removing the staging", self.lane, why)
        self.removing.set()
        receiver = self.receiver
        if receiver is not None and not receiver.finished:
            # Still receiving: tell the senders the true cause (else they wait out
            # reconnect_timeout), but never let a slow link or mailbox hold this
            # process: the staging must go within seconds of the application.
            reason = f"lane {self.lane}: the reading application ended ({why})"
            teller = threading.Thread(
                target=receiver.end_transfer,
                args=(Abort(reason), TransferError(reason), END_NOTICE),
                kwargs={"flush": END_FLUSH},
                daemon=True,
            )
            teller.start()
            teller.join(END_NOTICE + 1.0)
        if receiver is not None:
            receiver.seal()  # no partition lands in the folder removed next
        self._remove_staging()
        self.ended.set()
        os._exit(0)

    def _remove_staging(self) -> None:
        shutil.rmtree(self.staging.dir, ignore_errors=True)
        try:
            self.staging.dir.parent.rmdir()  # the transfer's directory, once its last lane left
        except OSError:
            pass


if __name__ == "__main__":
    sys.exit(main())
