"""The writing end of a transfer's directory: sender ids, the directory link, the hub.

One process per transfer holds it: the Spark driver machine's sender host, or
the sending process of the CLI and the Python API. It

* issues every sending process its sender id (:class:`~..rules.directory.SenderIds`;
  its own is 0) and sends the whole list to the reading end over the
  directory link (:class:`~.rendezvous.DirectoryLink`);
* hears each lane's epoch from the reading end and passes it on to every
  sending process, which then claims the lane's door (:mod:`..rules.directory`).

Other sending processes of a Spark writer (executor machines' sender hosts,
tasks that send in-process, the commit) reach the hub over the writing
cluster's own network, at the address in the spec (``TransferSpec.hub``), as
lane hosts reach the registry: frames are :mod:`..link` frames under a key
derived from the transfer secret::

    process -> hub: {"hello": 1}, then {"ping": 1} every 2 s, {"spoiled": [[l, e, s, a]]}
    hub -> process: {"sender": S, "lanes": {...}}, then {"lanes": {...}} | {"end": why}
                    | {"spoiled": [...]} whenever they change, {"ping": 1}

``spoiled`` names doors a side found a stranger on (:mod:`..rules.meeting`): a
sending process's go to the reading end in our half, the lanes' come back to
every sending process, so the side that never saw the stranger moves on too.

A process keeps its link (and id) for as long as it sends for the transfer; a
new process gets a new id, never one given before.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from ...errors import TransferError
from ..link import (
    PING,
    SILENCE,
    BoxLink,
    advertised_addresses,
    connect,
    keep_alive,
    link_key,
    listen,
    serve_connections,
)
from ..rules.directory import (
    END,
    LANES,
    LANES_ENDED,
    SPOILED,
    DirectoryState,
    Door,
    SenderIds,
    abort_message,
    lanes_message,
    senders_message,
    spoiled_doors,
    spoiled_message,
)
from ..rules.errors import LinkError
from ..rules.protocol import Abort
from ..rules.spec import TransferSpec
from .rendezvous import ROLE_WRITER, DirectoryLink, heard_abort
from .views import SenderView, forget, register_view

log = logging.getLogger(__name__)

HUB_CONNECT = 10.0  # seconds a sending process tries to reach the hub


def hub_key(spec: TransferSpec) -> bytes:
    return link_key(spec.secret, "sender hub")


class SenderHub:
    """The writing end (see the module docstring). ``serve``: listen for the other
    sending processes of the transfer (a Spark writer); the address is :attr:`address`."""

    def __init__(
        self,
        spec: TransferSpec,
        serve: bool = False,
        on_abort: Callable[[Abort], None] | None = None,
    ) -> None:
        self.spec = spec
        # The reading end's abort through the directory: this end answers ``end``, then
        # ``on_abort`` ends the sending here. Without it, the in-band abort decides.
        self._on_abort = on_abort
        self.answered = threading.Event()  # we answered the reading end's abort with "end"
        self._lock = threading.Lock()
        self._ids = SenderIds()
        self._state = DirectoryState()  # the reading end's half, as last heard
        self._clients: set[BoxLink] = set()
        self._closed = threading.Event()
        self._abort: dict[str, Any] = {}  # our abort or end, once told: part of our half
        self._spoiled: set[Door] = set()  # doors our senders found a stranger on
        self.view = SenderView(spec.transfer_id, self._ids.issue())
        self.view.tell_abort = self.tell_abort
        self.view.tell_spoiled = self.add_spoiled
        register_view(self.view)
        self.link = DirectoryLink(spec, ROLE_WRITER, self._from_reader, self._link_ended)
        self.view.link_lost_state = self.link.lost_state
        self.link.send(self._half())
        self.link.start()
        self.server: socket.socket | None = None
        self.address: tuple[tuple[str, ...], int] | None = None
        if serve:
            self.server = listen()
            self.address = (tuple(advertised_addresses()), self.server.getsockname()[1])
            serve_connections(self.server, self._serve)

    def spec_with_hub(self) -> TransferSpec:
        """The spec every other sending process gets: with this hub's address."""
        if self.address is None:
            return self.spec
        return self.spec.with_hub(*self.address)

    def _half(self) -> dict[str, Any]:
        """Our half of the directory, whole (under the lock, or before the link starts)."""
        half = {**senders_message(self._ids.issued), **self._abort}
        if self._spoiled:
            half.update(spoiled_message(self._spoiled))
        return half

    def add_spoiled(self, doors: set[Door]) -> None:
        """A sending process found a stranger on ``doors``: tell the reading end (its lane,
        who may never have seen the stranger, moves on to the next door too)."""
        with self._lock:
            if doors <= self._spoiled:
                return
            self._spoiled |= doors
            half = self._half()
        self.link.send(half)

    def tell_abort(self, abort: Abort) -> None:
        """Tell the reading end the transfer is over, through the mailbox: ahead of the
        data queued on the connections. It answers ``end`` as it ends its lanes."""
        with self._lock:
            self._abort.update(abort_message(abort.reason, abort.cancelled))
            half = self._half()
        self.link.send(half)

    def _news(self) -> dict[str, Any]:
        message = lanes_message(self._state.epochs, self._state.lanes_ended)
        if self._state.ended:
            message[END] = self._state.ended
        if self._state.spoiled:
            message.update(spoiled_message(self._state.spoiled))
        return message

    def _from_reader(self, message: dict[str, Any]) -> None:
        with self._lock:
            told = self._state.abort
            spoiled = spoiled_doors(message) - self._state.spoiled
            _, risen = self._state.merge(message)
            news = self._news()
            clients = list(self._clients)
            heard = told is None and self._state.abort is not None
        self.view.update(message)
        if risen or spoiled or message.get(END) or message.get(LANES_ENDED):
            for client in clients:
                with contextlib.suppress(LinkError):
                    client.send_json(news)
        if heard and self._on_abort is not None:
            heard_abort(self.spec, self._state.abort or {}, "receiver", self._on_abort, self._end)

    def _end(self, part: dict[str, Any]) -> None:
        """Answer the reading end's abort with our ``end``."""
        with self._lock:
            self._abort.update(part)
            half = self._half()
        self.link.send(half)
        self.answered.set()

    def _link_ended(self, why: str) -> None:
        # Normal at the end: the reading end closes its side once it has the data.
        # Connections made meanwhile live on; only new introductions stop.
        if not self._closed.is_set():
            log.info("transfer %s: %s", self.spec.transfer_id, why)

    def _serve(self, sock: socket.socket) -> None:
        link = BoxLink(sock, hub_key(self.spec))
        stop = threading.Event()
        sender = -1
        try:
            link.recv_json(SILENCE)  # hello
            with self._lock:
                sender = self._ids.issue()
                half = self._half()
                first = {"sender": sender, **self._news()}
                self._clients.add(link)
            self.link.send(half)
            link.send_json(first)
            log.info("transfer %s: sender %d joined", self.spec.transfer_id, sender)
            keep_alive(link, PING, stop)
            while not self._closed.is_set():
                message = link.recv_json(SILENCE)  # pings; silent or closed: a process gone
                if SPOILED in message:
                    self.add_spoiled(spoiled_doors(message))
        except (LinkError, ValueError) as e:
            if not self._closed.is_set():
                log.info("transfer %s: sender %d left: %s", self.spec.transfer_id, sender, e)
        finally:
            stop.set()
            with self._lock:
                self._clients.discard(link)
            link.close()

    def close(self) -> None:
        """Close the directory link and the hub; idempotent."""
        self._closed.set()
        if self.server is not None:
            with contextlib.suppress(OSError):
                self.server.close()
        with self._lock:
            clients = list(self._clients)
        for client in clients:
            client.close()
        self.link.close()
        forget(self.spec.transfer_id)


class HubClient:
    """A sending process's link to its transfer's hub: its sender id and the lanes' epochs."""

    def __init__(self, spec: TransferSpec, link: BoxLink, first: dict[str, Any]) -> None:
        self.spec = spec
        self._link = link
        self.view = SenderView(spec.transfer_id, int(first["sender"]))
        self.view.update(first)
        self.view.tell_spoiled = self._tell_spoiled
        self._stop = threading.Event()
        keep_alive(link, PING, self._stop)
        threading.Thread(target=self._read, name="hub-link", daemon=True).start()

    @classmethod
    def connect(cls, spec: TransferSpec, deadline: float) -> HubClient:
        if spec.hub is None:
            raise TransferError(
                f"transfer {spec.transfer_id}: no writing end to introduce this process to "
                "the lanes (the spec names no sender hub)"
            )
        addresses, port = spec.hub
        wait = max(1.0, min(HUB_CONNECT, deadline - time.monotonic()))
        try:
            link = connect(addresses, port, hub_key(spec), wait)
            link.send_json({"hello": 1})
            first = link.recv_json(wait)
        except (LinkError, ValueError) as e:
            raise TransferError(
                "this sending process could not reach the writing application's sender "
                f"host on its driver's machine ({', '.join(addresses)} port {port}): {e}. "
                "If the writing application has ended, so has the transfer"
            ) from e
        return cls(spec, link, first)

    def _read(self) -> None:
        try:
            while not self._stop.is_set():
                message = self._link.recv_json(SILENCE)
                if LANES in message or END in message or SPOILED in message:
                    self.view.update(message)
        except (LinkError, ValueError) as e:
            if not self._stop.is_set():
                self.view.update({END: f"the writing application's sender host went away ({e})"})

    def _tell_spoiled(self, doors: set[Door]) -> None:
        with contextlib.suppress(LinkError):
            self._link.send_json(spoiled_message(doors))

    def close(self) -> None:
        self._stop.set()
        self._link.close()


__all__ = ["HubClient", "SenderHub", "hub_key"]
