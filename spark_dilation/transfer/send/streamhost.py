"""A stream's sending run: a helper process on the sending query's driver machine.

The Spark sink's ``commit(batch)`` runs in a Python worker that may live for
one micro-batch only, so the stream's run lives here instead, for as long as
the sending application does (its driver JVM, :func:`~..machine.watch`):

* the first run pairs over the human code (:func:`~..meet.resume.pair_over_code`)
  and writes the pairing record; every run then resumes from the record
  (:class:`~..meet.resume.StreamLink`), so the receiving side's restarts and
  this side's reconnect with no code;
* each commit hands its micro-batch over a Unix socket (:mod:`.streamclient`):
  the partitions, then the manifest; the answer comes when the receiving side
  has the batch staged durably (``have``), or names why not;
* a new pair (either side restarted) is sent every partition and manifest not
  yet answered (:class:`~..rules.ledger.SinkLedger`), so nothing is lost.

Its folder (``host.sock``, ``host.pid``, ``token``, ``host.log``) is
:func:`stream_host_dir`; it is removed on exit. A run that cannot go on leaves
its cause in the pairing folder (``HOST_ERROR``) for the next commit to raise.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

from twisted.internet import defer, protocol

from ...wormhole.blocking import ensure_reactor
from ..link import LocalLink, serve_connections
from ..machine import atomic_write, owner_pid, read_private, try_lock, watch
from ..meet.record import load_record
from ..meet.resume import StreamLink, goodbye, pair_over_code
from ..rules import streamwire as wire
from ..rules.errors import LinkError, error_record
from ..rules.ledger import SinkLedger
from ..rules.pairing import RECORD_NAME, SENDER, Pair, PairingError
from .hostlink import unix_address
from .streamclient import HOST_ERROR, stream_host_dir

log = logging.getLogger(__name__)

WAITING_EVERY = 10.0  # a commit that waits is told why this often (its log says so)


class StreamHost:
    def __init__(self, start: dict[str, Any], owner: int | None) -> None:
        self.pairing_dir = Path(start["pairing_dir"])
        self.record_path = self.pairing_dir / RECORD_NAME
        self.start, self.owner = start, owner
        self.dir = stream_host_dir(self.pairing_dir)
        self.token: bytes = start["token"]
        self.timeout: float = start["peer_timeout"]
        self.ledger: SinkLedger | None = None
        self.waiting: dict[int, defer.Deferred] = {}
        self.totals: dict[int, tuple[int, int]] = {}  # batch -> its manifest's rows and bytes
        self.checkpoint: str | None = None  # the sending query's, as its sink names it
        self.link: StreamLink | None = None
        self.conversation: _Conversation | None = None
        self.ended: BaseException | None = None
        self.since = time.monotonic()  # when the last receiving run went away
        self.done = threading.Event()

    # --- the process -----------------------------------------------------------------------

    def run(self) -> int:
        from twisted.internet import reactor

        ensure_reactor()
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        with unix_address(self.dir / "host.sock") as address:
            server.bind(address)
        server.listen(16)
        serve_connections(server, self._serve)
        reactor.callFromThread(lambda: defer.ensureDeferred(self._begin()))
        watch(self.owner, self._owner_ended, self.done)
        self.done.wait()
        server.close()
        link = self.link
        if link is not None:
            ended = threading.Event()

            def end() -> None:
                d = goodbye(self.conversation, reactor)
                d.addBoth(lambda _: link.stop()).addBoth(lambda _: ended.set())

            reactor.callFromThread(end)
            ended.wait(5)
        return 0

    def _owner_ended(self) -> None:
        log.info("the sending application ended: this stream's run ends")
        self.done.set()

    async def _begin(self) -> None:
        from twisted.internet import reactor

        try:
            if load_record(self.record_path) is None:
                log.info("pairing over the code (waits up to %g s for the receiver)", self.timeout)
                await pair_over_code(
                    reactor,
                    SENDER,
                    self.start["mailbox_url"],
                    self.record_path,
                    code=self.start["code"],
                    schema=self.start["schema"],
                    timeout=self.timeout,
                    timeout_option=self.start["timeout_option"],
                )
            self.link = StreamLink(
                self.record_path, reactor, self._paired, self._end, **self.start["dilation"]
            )
            log.info(
                "stream %s: run %d started", self.link.record.stream, self.link.record.incarnation
            )
        except Exception as e:
            self._end(e)

    # --- the reactor's ---------------------------------------------------------------------

    def _end(self, error: BaseException) -> None:
        log.warning("this stream's run cannot go on: %s", error)
        self.ended = error
        body = json.dumps(error_record(error))
        atomic_write(self.pairing_dir / HOST_ERROR, body, mode=0o600)
        for d in list(self.waiting.values()):
            d.errback(error)
        self.waiting.clear()
        from twisted.internet import reactor

        # This process ends: the next commit starts a host that reads HOST_ERROR's
        # cause, or (after the user mended it) pairs again. The waiting commits are told first.
        reactor.callLater(1.0, self.done.set)

    def _paired(self, pair: Pair, dilated: Any) -> None:
        log.info("the receiving run %d joined (pair %s)", pair.receiver, pair)
        factory = protocol.Factory.forProtocol(lambda: _Conversation(self))
        d = dilated.connector_for(wire.SUBPROTOCOL).connect(factory)
        d.addErrback(lambda f: log.warning("the pair's subchannel did not open: %s", f.value))

    def deliver(self, request: dict[str, Any], parts: list[bytes]) -> defer.Deferred:
        """A committed micro-batch: fires with its sequence number once the receiver has it."""
        if self.ended is not None:
            return defer.fail(self.ended)
        query, batch = request["query"], int(request["batch"])
        if self.ledger is None or self.ledger.query != query:
            self.ledger = SinkLedger(query)
        attempts: dict[int, str] = {}
        for meta, data in zip(request["parts"], parts, strict=True):
            key = (batch, int(meta["partition"]), str(meta["attempt"]))
            self.ledger.wrote(key, data)
            attempts[key[1]] = key[2]
        for key in self.ledger.committed(batch, attempts):
            log.info("dropped the losing write attempt %s", key)
        self.waiting[batch] = d = defer.Deferred()
        self.totals[batch] = (int(request["rows"]), int(request["nbytes"]))
        self.checkpoint = request.get("checkpoint")  # named in a reset's message
        if self.conversation is not None:
            self.conversation.send_batch(batch)
        return d

    def abort(self, batch: int) -> None:
        if self.ledger is not None:
            self.ledger.aborted(batch)
        d = self.waiting.pop(batch, None)
        if d is not None:
            d.errback(PairingError(f"micro-batch {batch} was aborted"))

    def answered(self, body: dict[str, Any]) -> None:
        t, batch = body["t"], int(body.get("batch", -1))
        if t == wire.HAVE and self.ledger is not None:
            self.ledger.have(batch)
            self.totals.pop(batch, None)
            d = self.waiting.pop(batch, None)
            if d is not None:
                d.callback(int(body["seq"]))
        elif t == wire.MISSING and self.conversation is not None:
            self.conversation.send_batch(batch, only=set(body["partitions"]))
        elif t == wire.REFUSED:
            d = self.waiting.pop(batch, None)
            if d is not None:
                d.errback(
                    PairingError(f"the receiving side refused micro-batch {batch}: {body['error']}")
                )

    def status(self) -> str:
        if self.ended is not None:
            return str(self.ended)
        if self.link is None:
            return "pairing over the code: no receiving query has opened it yet"
        if self.conversation is None:
            return (
                f"no receiving query is connected (for {time.monotonic() - self.since:.0f} "
                "s); it resumes when the receiving query runs"
            )
        return "the receiving side has not confirmed it yet"

    # --- the commits' connections (threads) ------------------------------------------------

    def _serve(self, sock: socket.socket) -> None:
        import crochet

        try:
            link, _ = LocalLink.accept(sock, self.token)
            request = link.recv_json()
            if "abort" in request:
                crochet.run_in_reactor(self.abort)(int(request["abort"])).wait(10)
                link.send_json({"ok": True})
                return
            parts = [_read_part(link) for _ in request["parts"]]
            result = crochet.run_in_reactor(self.deliver)(request, parts)
            deadline = time.monotonic() + self.timeout
            while True:
                try:
                    seq = result.wait(min(WAITING_EVERY, max(deadline - time.monotonic(), 0.01)))
                except crochet.TimeoutError:
                    if time.monotonic() < deadline:
                        link.send_json({"waiting": self.status()})
                        continue
                    raise PairingError(
                        f"micro-batch {request['batch']} was not staged by the receiving side "
                        f"within {self.timeout:g} s ({self.start['timeout_option']}): "
                        f"{self.status()}"
                    ) from None
                link.send_json({"ok": {"seq": seq}})
                return
        except LinkError as e:
            log.info("a commit's connection ended: %s", e)
        except Exception as e:
            with contextlib.suppress(LinkError, OSError):
                link.send_json({"error": error_record(e)})
        finally:
            sock.close()


def _read_part(link: LocalLink) -> bytes:
    chunks = []
    while chunk := link.recv():
        chunks.append(bytes(chunk))
    return b"".join(chunks)


class _Conversation(protocol.Protocol):
    """This run's subchannel to the receiving run of one pair."""

    def __init__(self, host: StreamHost) -> None:
        self.host = host
        self.incoming = wire.Incoming()
        self.closed: defer.Deferred = defer.Deferred()  # fires when the subchannel is gone

    def connectionMade(self) -> None:
        old = self.host.conversation
        if old is not None and old.transport is not None:
            old.transport.loseConnection()
        self.host.conversation = self
        ledger = self.host.ledger
        if ledger is not None:
            _, manifests = ledger.to_deliver()
            for batch in manifests:
                self.send_batch(batch)

    def connectionLost(self, reason: Any = None) -> None:
        if not self.closed.called:
            self.closed.callback(None)
        if self.host.conversation is self:
            self.host.conversation = None
            self.host.since = time.monotonic()
            if not self.host.done.is_set():
                log.warning("the receiving run ended; micro-batches wait for its next run")

    def send_batch(self, batch: int, only: set[int] | None = None) -> None:
        ledger = self.host.ledger
        if ledger is None or batch not in ledger.manifests:
            return
        attempts = ledger.manifests[batch]
        for (b, p, a), data in sorted(ledger.written.items()):
            if b == batch and attempts.get(p) == a and (only is None or p in only):
                for frame in wire.part(ledger.query, b, p, a, data):
                    self.transport.write(frame)
        rows, nbytes = self.host.totals.get(batch, (0, 0))
        self.transport.write(
            wire.message(
                wire.MANIFEST,
                query=ledger.query,
                batch=batch,
                attempts={str(p): a for p, a in attempts.items()},
                rows=rows,
                nbytes=nbytes,
                checkpoint=self.host.checkpoint,
            )
        )

    def dataReceived(self, data: bytes) -> None:
        try:
            for event in self.incoming.feed(data):
                if isinstance(event, wire.Message):
                    self.host.answered(event.body)
        except Exception as e:
            log.warning("the receiving run broke the stream protocol: %s", e)
            self.transport.loseConnection()


def main(argv: list[str] | None = None) -> int:
    (start_path,) = argv if argv is not None else sys.argv[1:]
    owner = owner_pid()  # now, while the Spark worker that started us still runs
    start = read_private(start_path)  # it holds the code
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s stream-host %(name)s %(levelname)s %(message)s"
    )
    logging.getLogger("twisted").setLevel(logging.WARNING)
    directory = stream_host_dir(Path(start["pairing_dir"]))
    lock = try_lock(directory / "host.lock")
    if lock is None:
        return 0  # another host serves this stream
    atomic_write(directory / "host.pid", str(os.getpid()))
    try:
        return StreamHost(start, owner).run()
    finally:
        for name in ("host.sock", "host.pid", "token", "launch.lock"):
            with contextlib.suppress(OSError):
                (directory / name).unlink()
        shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
