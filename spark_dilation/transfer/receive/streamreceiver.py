"""A stream's receiving run: the pairing's link, and the stage the Spark source reads.

The Spark source (``spark/stream.py``) calls it from its long-lived driver
worker: :meth:`StreamReceiver.latest`, :meth:`files` and :meth:`commit` are
the source's offsets; everything the sender says arrives on the reactor
(:class:`_Conversation`, one per pair) and goes to the :class:`StreamStage`.
One lock keeps the two threads off the stage at the same time.
"""

from __future__ import annotations

import errno
import logging
import threading
import time
from pathlib import Path
from typing import Any, BinaryIO

from twisted.internet import defer, protocol

from ...wormhole.blocking import ensure_reactor, run_and_wait
from ..meet.resume import StreamLink, goodbye
from ..rules import streamwire as wire
from ..rules.errors import ProtocolError, SessionTimeout
from ..rules.ledger import Key
from ..rules.pairing import Pair, PairingError
from ..rules.states import MeetingState
from .streamstage import StreamStage

log = logging.getLogger(__name__)


class StreamReceiver:
    """One receiving run of the stream whose record and stage are in ``state_dir``.

    ``dilation``: :func:`~...dilation.dilate` options (relay, timeouts).
    """

    def __init__(self, record_path: str | Path, state_dir: str | Path, **dilation: Any) -> None:
        self.record_path, self.dilation = Path(record_path), dilation
        self.stage = StreamStage(state_dir)
        self.lock = threading.Lock()
        self.link: StreamLink | None = None
        self.ended: PairingError | None = None
        # Whether the query reads what is staged before it ends: yes after a revoke or a
        # refusal; no when a later run of this side took the stage over.
        self.drain = True
        self.pairs: list[Pair] = []
        self._conversation: _Conversation | None = None
        self._since = time.monotonic()  # when the last pair ended (or this run started)

    def start(self, timeout: float = 30.0) -> None:
        """Start the run (its record's next incarnation) on the reactor thread. A revoked
        pairing starts no run: what it staged before stays readable (:meth:`finished`)."""
        from ..meet.record import load_record

        record = load_record(self.record_path)
        if record is not None and record.revoked:
            self.ended = PairingError(f"this stream's pairing was revoked ({record.revoked})")
            return
        ensure_reactor()

        def begin() -> None:
            from twisted.internet import reactor

            self.link = StreamLink(
                self.record_path, reactor, self._paired, self._ended, **self.dilation
            )

        run_and_wait(
            begin,
            timeout=timeout,
            on_timeout=lambda: SessionTimeout(f"the stream's run did not start in {timeout:g} s"),
        )

    def stop(self) -> None:
        """End this run; the pairing stays for the next."""
        link = self.link
        if link is not None:
            self.link = None

            def end() -> defer.Deferred:
                from twisted.internet import reactor

                d = goodbye(self._conversation, reactor)
                return d.addBoth(lambda _: link.stop())

            run_and_wait(end, timeout=10, on_timeout=lambda: SessionTimeout("stop"))

    # --- the source's calls (its thread) ---------------------------------------------------

    def finished(self, position: int) -> None:
        """Raise why this run ended (revoked, refused, or a later run of this query
        started) once the receiving query has read to ``position`` everything staged
        before: a batch the sending side was told "have" for is never abandoned."""
        if self.ended is None:
            return
        if not self.drain:
            raise PairingError(str(self.ended))
        with self.lock:
            latest = self.stage.latest
        if position >= latest:
            raise PairingError(
                f"{self.ended}; the receiving query read every micro-batch staged before "
                f"({latest} in this stream)"
            )

    def latest(self) -> int:
        with self.lock:
            return self.stage.latest

    def waiting_for_sender(self) -> float | None:
        """Seconds since this run last had a sending run to talk to, or None if it has one."""
        return None if self._conversation is not None else time.monotonic() - self._since

    def commit(self, end: int) -> None:
        with self.lock:
            self.stage.commit(end)
        conversation = self._conversation
        if conversation is not None:
            from twisted.internet import reactor

            reactor.callFromThread(conversation.say, wire.message(wire.CONSUMED, below=end))

    # --- the reactor's ---------------------------------------------------------------------

    def _paired(self, pair: Pair, dilated: Any) -> None:
        self.pairs.append(pair)
        log.info(
            "stream %s: the sending run %d joined",
            self.link and self.link.record.stream,
            pair.sender,
        )
        factory = protocol.Factory.forProtocol(lambda: _Conversation(self, pair))
        dilated.listener_for(wire.SUBPROTOCOL).listen(factory)

    def _ended(self, error: PairingError) -> None:
        log.warning("stream run ended: %s", error)
        link = self.link
        self.drain = link is None or link.meeting.state is not MeetingState.SUPERSEDED
        self.ended = error


class _Conversation(protocol.Protocol):
    """The sending run's subchannel of one pair: partitions and manifests in, answers out."""

    def __init__(self, receiver: StreamReceiver, pair: Pair) -> None:
        self.receiver, self.pair = receiver, pair
        self.incoming = wire.Incoming()
        self.closed: defer.Deferred = defer.Deferred()  # fires when the subchannel is gone
        self._file: BinaryIO | None = None
        self._key: Key | None = None
        self._skip = False

    def connectionMade(self) -> None:
        old = self.receiver._conversation
        if old is not None and old is not self:
            old.transport.loseConnection()
        self.receiver._conversation = self

    def connectionLost(self, reason: Any = None) -> None:
        if not self.closed.called:
            self.closed.callback(None)
        if self._file is not None and self._key is not None:
            with self.receiver.lock:
                self.receiver.stage.discard_part(self._key, self._file)
            self._file = None
        if self.receiver._conversation is self:
            self.receiver._conversation = None
            self.receiver._since = time.monotonic()
            if self.receiver.link is not None:
                log.warning("the sending run ended; the stream waits for its next run")

    def say(self, frame: bytes) -> None:
        if self.transport is not None:
            self.transport.write(frame)

    def dataReceived(self, data: bytes) -> None:
        try:
            events = self.incoming.feed(data)
            for event in events:
                if isinstance(event, wire.Chunk):
                    self._chunk(event)
                else:
                    self._message(event.body)
        except (ProtocolError, ValueError, KeyError, TypeError) as e:
            log.warning("the sending run of %s broke the stream protocol: %s", self.pair, e)
            self.transport.loseConnection()

    def _chunk(self, chunk: wire.Chunk) -> None:
        if self.receiver.ended is not None:
            return  # this run refused the stream already: nothing more is staged
        try:
            self._stage_chunk(chunk)
        except OSError as e:
            if self._file is not None and self._key is not None:
                with self.receiver.lock:
                    self.receiver.stage.discard_part(self._key, self._file)
            self._file = None
            self._skip = True  # the rest of this partition is dropped
            self._refuse(int(chunk.header["batch"]), e)

    def _stage_chunk(self, chunk: wire.Chunk) -> None:
        stage, h = self.receiver.stage, chunk.header
        key: Key = (int(h["batch"]), int(h["partition"]), str(h["attempt"]))
        with self.receiver.lock:
            if self._key != key:  # the first chunk of this partition
                self._key, self._skip = key, not stage.accepting(key[0])
                self._file = None if self._skip else stage.open_part(key)
            if self._file is not None:
                self._file.write(chunk.data)
                if chunk.last:
                    stage.close_part(key, self._file)
        if chunk.last:
            self._key, self._file = None, None

    def _message(self, body: dict[str, Any]) -> None:
        if body["t"] != wire.MANIFEST:
            return  # nothing else is the sender's to say; later versions may say more
        batch = int(body["batch"])
        attempts = {int(p): str(a) for p, a in body["attempts"].items()}
        checkpoint = body.get("checkpoint")
        try:
            with self.receiver.lock:
                answer = self.receiver.stage.manifest(
                    str(body["query"]),
                    batch,
                    attempts,
                    int(body["rows"]),
                    int(body["nbytes"]),
                    checkpoint=str(checkpoint) if checkpoint else None,
                )
        except (PairingError, OSError) as e:
            self._refuse(batch, e)
            return
        if answer.have:
            self.say(wire.message(wire.HAVE, batch=batch, seq=answer.seq))
        else:
            self.say(wire.message(wire.MISSING, batch=batch, partitions=list(answer.missing)))

    def _refuse(self, batch: int, error: Exception) -> None:
        """The sending query is told why its batch cannot be taken, and the receiving
        query ends with the same cause: neither waits for the other."""
        text = _cause(error, self.receiver.stage.dir)
        log.error("micro-batch %d refused: %s", batch, text)
        self.say(wire.message(wire.REFUSED, batch=batch, error=text))
        self.receiver._ended(PairingError(text))


def _cause(error: Exception, where: Path) -> str:
    """One line for a refused batch: a full or failing stage says so, with its folder."""
    if isinstance(error, OSError):
        if error.errno == errno.ENOSPC:
            return (
                f"the receiving side's stage at {where} is full (no space left on device): "
                "free space there, or name a larger folder with state_dir, then restart both "
                "queries"
            )
        return f"the receiving side could not stage into {where}: {error}"
    return str(error)
