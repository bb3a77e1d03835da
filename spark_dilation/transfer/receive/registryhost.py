"""The registry host: the lane registry of one loaded dataset, for as long as its application runs.

``DilationDataSource.schema()`` (``load()``, on the driver's machine) starts
it with :func:`start_registry_host` once the code is agreed. It listens on
every interface of the driver's machine (the executors reach the driver, so
they reach this too) and keeps the :class:`~..rules.registry.LaneRegistry`: every
lane host of the transfer, on any executor, claims its lane here and stays
connected. It watches the process that owns the DataFrame (the driver JVM):
when that ends, the host closes every link, and each lane host removes its
staged rows and exits. So a loaded DataFrame stays readable, from any
executor, as long as its application runs and one machine holding each lane
does; and nothing is left behind when the application ends.

Frames (:mod:`..link`, JSON)::

    lane host -> registry: {"claim": L, "host": HostInfo, "complete": bool}   answer {"do": ...}
                           {"done": L} | {"failed": L, "error": record} | {"ping": 1}
                           {"deleted": L} (its staged copy was deleted under it; it leaves)
                           {"cause": L, "own": record|null}   answer {"cause": record|null}
                           (a lane's own failure, declared before it tells the senders;
                           the transfer's cause, if any: :meth:`LaneRegistry.own_failure`)
                           {"spoiled": [[l, e, s, a]]} (doors it found a stranger on)
    registry -> lane host: {"do": ...} (answers, in order; "receive" names the lane's
                           epoch) | {"senders": [ids]} | {"ping": 1}
                           {"spoiled": [...]} (doors the senders found a stranger on)
                           {"abort": {"reason", "cancelled"}} (the writing end's abort,
                           heard on the directory link; also to a lane host that
                           claims after it)

It is also the reading end of the transfer's directory
(:class:`~..meet.rendezvous.ReadingEnd`): it publishes each lane's epoch (which
rises each time a new host receives the lane) to the writing end, and passes
every sender id the writing end issues on to the lane hosts, which open a
door for each (:mod:`..rules.directory`). The writing end's abort on that link is
answered ``end`` at once (ahead of the data queued on the connections) and
passed to every lane host, each of which ends its lane at once.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from ...errors import TransferError
from ..link import (
    PING,
    SILENCE,
    BoxLink,
    advertised_addresses,
    keep_alive,
    link_key,
    listen,
    serve_connections,
)
from ..machine import (
    alive,
    atomic_write,
    owner_pid,
    read_private,
    spawn,
    wait_ready,
    write_private,
)
from ..rules.directory import Door, spoiled_doors, spoiled_message
from ..rules.errors import LinkError
from ..rules.protocol import Abort
from ..rules.registry import HostInfo, LaneRegistry
from ..rules.spec import TransferSpec

log = logging.getLogger(__name__)

START_WAIT = 30.0
# Seconds after the first lane's claim before the registry receives the
# unclaimed lanes itself (no free task slot for them: show(), busy slots,
# more lanes than slots).
LANE_GRACE = 5.0
# The registry's log line with what the lanes received from the senders (the
# connections they accepted: the same the writer's report counts opened).
RECEIVE_REPORT_PREFIX = "spark-dilation receive report: "


def registry_key(spec: TransferSpec) -> bytes:
    return link_key(spec.secret, "lane registry")


class RegistryHost:
    def __init__(self, spec: TransferSpec, owner: int) -> None:
        self.spec = spec
        self.owner = owner
        self.registry = LaneRegistry(spec.lanes)
        self.lock = threading.Lock()
        self.links: set[BoxLink] = set()
        self.stopping = threading.Event()
        self.server = listen()
        self.received: dict[int, dict[str, Any]] = {}
        self.reported = False
        self.reading: Any = None  # the directory's reading end, from run()
        self.aborted: dict[str, Any] | None = None  # the writing end's abort, once heard
        self.published_ended: dict[int, tuple[int, str]] = {}

    def run(self, ready_path: Path) -> int:
        port = self.server.getsockname()[1]
        ready = {"addresses": advertised_addresses(), "port": port, "pid": os.getpid()}
        atomic_write(ready_path, json.dumps(ready))
        log.info("lane registry of %s on %s", self.spec.transfer_id, ready)
        from ..meet.rendezvous import ReadingEnd

        self.reading = ReadingEnd(
            self.spec, self._introduce, on_abort=self._writer_aborted, on_spoiled=self._spoiled
        )
        serve_connections(self.server, self._serve)
        hosted = self.spec.with_registry(tuple(ready["addresses"]), port)
        while alive(self.owner):
            time.sleep(0.5)
            with self.lock:
                lanes = self.registry.unclaimed(time.monotonic(), LANE_GRACE)
            for lane in lanes:
                self._host_lane(hosted, lane)
        log.info("the application (pid %d) ended: closing every lane host's link", self.owner)
        self.stopping.set()
        with self.lock:
            links = list(self.links)
        for link in links:
            link.close()
        self.server.close()
        self.reading.close()
        return 0

    def _introduce(self, _: set[int]) -> None:
        """New senders: every lane host hears the whole list (its receiver opens doors)."""
        message = {"senders": sorted(self.reading.senders)}
        with self.lock:
            links = list(self.links)
        for link in links:
            with contextlib.suppress(LinkError):
                link.send_json(message)

    def _spoiled(self, _: set[Door]) -> None:
        """Senders found strangers on doors: every lane host hears the whole list (a lane
        waiting on one of them, which never saw the stranger, moves on)."""
        message = spoiled_message(self.reading.spoiled)
        with self.lock:
            links = list(self.links)
        for link in links:
            with contextlib.suppress(LinkError):
                link.send_json(message)

    def _writer_aborted(self, abort: Abort) -> None:
        """The writing end ended the transfer (directory link): every lane host hears it."""
        message = {"abort": {"reason": abort.reason, "cancelled": abort.cancelled}}
        with self.lock:
            self.aborted = message["abort"]
            links = list(self.links)
        for link in links:
            with contextlib.suppress(LinkError):
                link.send_json(message)

    def _publish_ended(self) -> None:
        """Lanes newly failed for good: the writing end hears it (under ``lock``), so that
        their senders fail with the lane's error, not "never hosted"."""
        ended = self.registry.ended()
        if ended != self.published_ended and self.reading is not None:
            self.published_ended = ended
            log.info("lanes ended for good: %s", ended)
            self.reading.publish(self.registry.epochs(), ended)

    def _received(self, message: dict[str, Any]) -> None:
        """Log the receive report once every lane has reported what it received."""
        if "connections" not in message:
            return  # a copy, not the lane's receiver
        self.received[int(message["done"])] = message
        if len(self.received) != self.spec.lanes or self.reported:
            return
        self.reported = True
        from ..rules.report import combine_paths

        lanes = self.received.values()
        report = {
            "transfer": self.spec.transfer_id,
            "lanes": self.spec.lanes,
            "connections": sum(int(m["connections"]) for m in lanes),
            "reconnects": sum(int(m["reconnects"]) for m in lanes),
            "path": combine_paths(p for m in lanes for p in m["paths"]),
        }
        log.info("%s%s", RECEIVE_REPORT_PREFIX, json.dumps(report))

    def _host_lane(self, spec: TransferSpec, lane: int) -> None:
        """Receive a lane that no read task could start, here on the driver's machine."""
        from .laneread import ensure_host
        from .staging import LaneStaging

        log.info("lane %d: no read task claimed it in %g s; receiving it here", lane, LANE_GRACE)
        with self.lock:
            self.registry.hosting(lane, time.monotonic())
        try:
            ensure_host(spec, lane, LaneStaging(spec.options.staging_root, spec.transfer_id, lane))
        except Exception as e:  # tried again later; a read task may claim it meanwhile
            log.warning("lane %d: could not start it here: %s", lane, e)
            with self.lock:
                self.registry.hosting_failed(lane, str(e), time.monotonic())
                self._publish_ended()

    def _serve(self, sock: socket.socket) -> None:
        link = BoxLink(sock, registry_key(self.spec))
        with self.lock:
            self.links.add(link)
        host: HostInfo | None = None
        stop_ping = threading.Event()
        keep_alive(link, PING, stop_ping)
        try:
            while True:
                message = link.recv_json(SILENCE)
                if "ping" in message:
                    continue
                with self.lock:
                    if "claim" in message:
                        host = HostInfo.from_json(message["host"])
                        answer = self.registry.claim(
                            int(message["claim"]),
                            host,
                            bool(message["complete"]),
                            now=time.monotonic(),
                        )
                        link.send_json(answer)
                        if answer["do"] == "receive":
                            self.reading.publish(self.registry.epochs())
                            senders = sorted(self.reading.senders)
                            if senders:
                                link.send_json({"senders": senders})
                            if spoiled := self.reading.spoiled:
                                link.send_json(spoiled_message(spoiled))
                            if self.aborted is not None:
                                link.send_json({"abort": self.aborted})
                    elif "done" in message and host is not None:
                        self.registry.done(int(message["done"]), host)
                        self._received(message)
                    elif "failed" in message and host is not None:
                        self.registry.failed(int(message["failed"]), host, message["error"])
                    elif "spoiled" in message:  # a lane found a stranger on a door
                        self.reading.report_spoiled(spoiled_doors(message))
                    elif "deleted" in message and host is not None:
                        self.registry.deleted(int(message["deleted"]), host)
                    elif "cause" in message and host is not None:
                        if message.get("own") is not None:
                            self.registry.own_failure(int(message["cause"]), host, message["own"])
                        link.send_json({"cause": self.registry.cause})
                    log.info("%s: %s", message, self.registry.snapshot())
                    self._publish_ended()
        except (LinkError, ValueError, KeyError) as e:
            if not self.stopping.is_set():
                log.info("lane host %s left: %s", host.machine if host else "?", e)
        finally:
            stop_ping.set()
            link.close()
            with self.lock:
                self.links.discard(link)
                if host is not None and not self.stopping.is_set():
                    self.registry.gone(host.host_id, time.monotonic())
                    log.info("after %s left: %s", host.machine, self.registry.snapshot())
                    self._publish_ended()


def start_registry_host(spec: TransferSpec, owner: int | None = None) -> TransferSpec:
    """Start the registry for ``spec``; the spec with its address, for every lane host.

    Runs where ``load()`` ran (the driver's machine), in a process of its own
    that outlives the planner worker.
    """
    from ..machine import private_dir

    directory = private_dir(
        Path(spec.options.staging_root) / f"registry-{spec.transfer_id}-{uuid.uuid4().hex[:6]}"
    )
    start = write_private(directory, spec)
    ready = directory / "ready.json"
    owner = (owner_pid() or os.getpid()) if owner is None else owner
    proc = spawn(
        "spark_dilation.transfer.receive.registryhost",
        [str(directory), str(start), str(owner)],
        directory / "host.log",
    )

    def failed() -> BaseException | None:
        if proc.poll() is None:
            return None
        return TransferError(
            f"the lane registry process did not start (see {directory / 'host.log'})"
        )

    info = wait_ready(
        proc,
        lambda: json.loads(ready.read_text()) if ready.exists() else None,
        failed,
        time.monotonic() + START_WAIT,
        "the lane registry process to start",
        log=directory / "host.log",
    )
    return spec.with_registry(tuple(info["addresses"]), int(info["port"]))


def main(argv: list[str] | None = None) -> int:
    directory, start, owner = argv if argv is not None else sys.argv[1:]
    path = Path(directory)
    spec = read_private(start)  # it holds the transfer secret
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s registry %(name)s %(levelname)s %(message)s"
    )
    try:
        return RegistryHost(spec, int(owner)).run(path / "ready.json")
    finally:
        import shutil

        shutil.rmtree(path, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
