"""Staged lanes shared by copy between the reading cluster's machines.

A lane host claims its lane at the registry (:mod:`.registrylink`). Once its
lane is complete it serves it (:class:`LaneServer`) to lane
hosts on other executors, which copy it (:func:`fetch_lane`) into their own
staging and serve it in turn. Frames are :mod:`..link` frames::

    fetcher -> server: {"fetch": L, "have": [partitions it holds already]}
    server -> fetcher: per staged partition: {"file": P, "size": N}, chunks of at most
                       1 MiB, an empty frame; {"ping": 1} while waiting for more;
                       finally {"manifest": MANIFEST_JSON}, or {"error": error record}

A server follows its own staging: a receiver still receiving serves each
partition once it is staged, so a host on another machine can emit the
first rows of a ``show()`` before the lane is complete.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import time
import uuid
from typing import Any

from ..link import (
    CHUNK,
    PING,
    SILENCE,
    BoxLink,
    advertised_addresses,
    connect,
    link_key,
    listen,
    serve_connections,
)
from ..machine import machine_name
from ..rules.errors import LinkError
from ..rules.protocol import Manifest
from ..rules.registry import HostInfo
from ..rules.spec import TransferSpec
from .staging import ERROR_FILE, LaneStaging

log = logging.getLogger(__name__)

SERVER_CONNECT = 10.0  # seconds to reach another machine's lane server
FOLLOW_POLL = 0.05  # how often a served copy looks for newly staged partitions


def share_key(spec: TransferSpec) -> bytes:
    return link_key(spec.secret, "staged lane copy")


class LaneServer:
    """Serves this machine's complete copy of a lane to lane hosts on other executors."""

    def __init__(self, spec: TransferSpec, lane: int, staging: LaneStaging) -> None:
        self.spec, self.lane, self.staging = spec, lane, staging
        self.sock = listen()
        self.port = self.sock.getsockname()[1]
        self.host = HostInfo(
            uuid.uuid4().hex[:12], machine_name(), tuple(advertised_addresses()), self.port
        )
        serve_connections(self.sock, self._serve)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()

    def _serve(self, sock: socket.socket) -> None:
        link = BoxLink(sock, share_key(self.spec))
        sent: set[int] = set()
        try:
            request = link.recv_json(SILENCE)
            if request.get("fetch") != self.lane:
                link.send_json({"error": f"this host serves lane {self.lane}"})
                return
            sent.update(int(p) for p in request.get("have", []))
            last_ping = time.monotonic()
            while True:
                # The manifest is read before the files: once it is there, every
                # partition it lists is already staged.
                manifest = self.staging.manifest()
                error = self.staging.dir / ERROR_FILE
                if manifest is None and error.exists():
                    link.send_json({"error": json.loads(error.read_text())})
                    return
                for partition, path in sorted(self.staging.complete().items()):
                    if partition not in sent:
                        self._send_file(link, partition, path)
                        sent.add(partition)
                if manifest is not None:
                    link.send_json({"manifest": manifest.to_json()})
                    log.info("lane %d: served a copy (%d files)", self.lane, len(sent))
                    return
                if time.monotonic() - last_ping > PING:
                    link.send_json({"ping": 1})
                    last_ping = time.monotonic()
                time.sleep(FOLLOW_POLL)
        except (LinkError, OSError, ValueError) as e:
            log.info("lane %d: a copy was not served in full: %s", self.lane, e)
        finally:
            link.close()

    def _send_file(self, link: BoxLink, partition: int, path: Any) -> None:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            link.send_json({"file": partition, "size": size})
            while chunk := f.read(CHUNK):
                link.send(chunk)
        link.send(b"")


def fetch_lane(spec: TransferSpec, lane: int, staging: LaneStaging, source: HostInfo) -> Manifest:
    """Copy the lane from ``source`` into ``staging``: partitions as the source stages them
    (a receiver is followed), the manifest last. Raises the lane's own error if it fails
    there (rebuilt from its record), LinkError if the source goes away."""
    from ..rules.errors import rebuild_error

    link = connect(source.addresses, source.port, share_key(spec), SERVER_CONNECT)
    started, total, files = time.monotonic(), 0, 0
    try:
        link.send_json({"fetch": lane, "have": sorted(staging.complete())})
        while True:
            head = json.loads(link.recv(SILENCE))
            if "ping" in head:
                continue
            if "error" in head:
                error = head["error"]
                if isinstance(error, dict):
                    raise rebuild_error(error)  # the lane's own error, where it was received
                raise LinkError(f"{source.machine} cannot serve lane {lane}: {error}")
            if "manifest" in head:
                manifest = Manifest.from_json(head["manifest"])
                staging.write_manifest(manifest)
                break
            partition, size = int(head["file"]), int(head["size"])
            partial = staging.partial_path(partition, -1)
            try:
                with open(partial, "wb") as out:
                    got = 0
                    while chunk := link.recv(SILENCE):
                        out.write(chunk)
                        got += len(chunk)
                if got != size:
                    raise LinkError(f"partition {partition}: {got} of {size} bytes")
                os.replace(partial, staging.complete_path(partition))
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(partial)
            total, files = total + size, files + 1
    finally:
        link.close()
    log.info(
        "lane %d: copied %d partitions (%d bytes) from %s in %.2f s",
        lane,
        files,
        total,
        source.machine,
        time.monotonic() - started,
    )
    return manifest
