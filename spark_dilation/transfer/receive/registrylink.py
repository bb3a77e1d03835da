"""A lane host's link to the reading application's lane registry (:mod:`.registryhost`).

The host claims its lane there before anything else and stays linked: the
registry answers what to do (receive, fetch, serve, error; rules in
:mod:`..rules.registry`), notes the lane's end and its cause, and passes on
the writing end's abort. When the link ends, the application ended: the
host removes its staged rows and exits.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from ..link import (
    PING,
    SILENCE,
    connect,
    keep_alive,
)
from ..rules.directory import spoiled_doors, spoiled_message
from ..rules.errors import LinkError
from ..rules.registry import HostInfo
from ..rules.spec import TransferSpec
from .registryhost import registry_key

log = logging.getLogger(__name__)


REGISTRY_CONNECT = 10.0  # seconds to reach the registry on the driver's machine


CAUSE_WAIT = 5.0  # seconds a failing lane waits for the registry to note its cause


class RegistryLink:
    """This lane host's link to the registry: claims, reports, and the end of the application."""

    def __init__(self, spec: TransferSpec, on_lost: Callable[[str], None]) -> None:
        assert spec.registry is not None
        addresses, port = spec.registry
        try:
            self.link = connect(addresses, port, registry_key(spec), REGISTRY_CONNECT)
        except LinkError as e:
            from ...errors import TransferError

            raise TransferError(
                "this lane could not reach the lane registry of the application that loaded "
                f"the DataFrame (on its driver's machine): {e}. If that application has "
                "ended, the DataFrame is gone with it: load the dataset again"
            ) from e
        self._answers: queue.Queue[dict[str, Any]] = queue.Queue()
        self._asking = threading.Lock()  # one request and its answer at a time
        self._on_lost = on_lost
        from ..meet.views import sender_set

        self.senders = sender_set(spec.transfer_id)
        # Our lanes' spoiled doors go to the registry host, the reading end.
        self.senders.tell_spoiled = lambda doors: self.report(spoiled_message(doors))
        self.lost = threading.Event()
        # The writing end's abort, passed on by the registry: set by the lane host.
        self.on_abort: Callable[[dict[str, Any]], None] = lambda _: None
        threading.Thread(target=self._read, daemon=True).start()
        keep_alive(self.link, PING, self.lost)

    def claim(self, lane: int, host: HostInfo, complete: bool) -> dict[str, Any]:
        return self._request({"claim": lane, "host": host.to_json(), "complete": complete}, "do")

    def cause(self, lane: int, own: BaseException | None = None) -> BaseException | None:
        """The transfer's true cause (a lane's own failure), declaring ``own`` first if given:
        the registry knows it before this lane tells the senders (registry.own_failure)."""
        from ..rules.errors import error_record, rebuild_error

        record = error_record(own) if own is not None else None
        found = self._request({"cause": lane, "own": record}, "cause", CAUSE_WAIT)["cause"]
        return rebuild_error(found) if found is not None else None

    def _request(
        self, message: dict[str, Any], key: str, timeout: float | None = None
    ) -> dict[str, Any]:
        """Send ``message``; the registry's answer, the one holding ``key`` (one request at
        a time; an answer that came after its request gave up is dropped)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._asking:
            self.link.send_json(message)
            while True:
                try:
                    answer = self._answers.get(timeout=0.5)
                except queue.Empty:
                    if self.lost.is_set():
                        raise LinkError("the lane registry went away") from None
                    if deadline is not None and time.monotonic() > deadline:
                        raise LinkError(
                            f"the lane registry did not answer in {timeout:g} s"
                        ) from None
                    continue
                if key in answer:
                    return answer

    def report(self, message: dict[str, Any]) -> None:
        with contextlib.suppress(LinkError):
            self.link.send_json(message)

    def _read(self) -> None:
        try:
            while True:
                message = self.link.recv_json(SILENCE)
                if "senders" in message:  # the directory's introductions, for the doors
                    self.senders.add([int(s) for s in message["senders"]])
                elif "spoiled" in message:  # doors the senders found a stranger on
                    self.senders.spoil(spoiled_doors(message))
                elif "abort" in message:
                    # Not on this thread: ending the lane asks the registry for the cause,
                    # whose answer only this thread reads.
                    threading.Thread(
                        target=self.on_abort, args=(message["abort"],), daemon=True
                    ).start()
                elif "ping" not in message:
                    self._answers.put(message)
        except (LinkError, ValueError, TypeError) as e:
            self.lost.set()
            self._on_lost(str(e))
