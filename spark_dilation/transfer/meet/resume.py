"""A stream's runs: the first pairs over the human code; each run then meets the
peer's latest run with no code, and dilates.

:func:`pair_over_code` is the first run's session: both sides keep the record
they derive from the confirmed key. :class:`StreamLink` is a run (the first one
too), the reactor's glue for :mod:`..rules.pairing`: the run's record is written
(:mod:`.record`) before anything is posted; its hello is kept on the standing
mailbox (:mod:`...wormhole.standingclient`); every message goes to the
:class:`~..rules.pairing.Meeting`, and for each pair it names, a
:class:`PairChannel` gives Dilation what Dilation needs of a wormhole. The
pair's Dilation then reconnects by itself as any does; a later run of the
peer replaces it.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from twisted.internet import defer

from ...dilation.api import DilatedWormhole
from ...dilation.l1 import dilation_versions_message
from ...dilation.manager import DilationManager
from ...wormhole.core import InOrder
from ...wormhole.standing import GotPosted
from ...wormhole.standingclient import StandingClient
from ..rules.pairing import (
    REVOKED_PHASE,
    ROLES,
    SENDER,
    STREAM_APPID,
    Meeting,
    Pair,
    PairingError,
    PairingRecord,
    hello,
    new_record,
    open_bytes,
    revocation,
    seal_bytes,
)
from ..rules.protocol import error_message
from .record import load_record, save_record

log = logging.getLogger(__name__)

_DILATE = re.compile(r"dilate-(\d+)")
STREAM_PROTOCOL = "spark-dilation/stream"  # our entry in the first session's app_versions


def stream_versions(role: str, schema: str | None = None) -> dict[str, Any]:
    """Our ``app_versions`` entry for a stream's first session, as ``role``."""
    mine: dict[str, Any] = {"version": 1, "role": role}
    if role == SENDER and schema is not None:
        mine["schema"] = schema
    return {STREAM_PROTOCOL: mine}


def record_from_session(
    key: bytes,
    role: str,
    mailbox_url: str,
    code: str,
    versions: dict[str, Any],
    schema: str | None = None,
) -> PairingRecord:
    """The record a side keeps after the first session, from the peer's versions;
    PairingError if the peer is not the other role of a stream."""
    peer = versions.get(STREAM_PROTOCOL)
    if not isinstance(peer, dict) or peer.get("role") not in ROLES:
        raise PairingError(
            f"the other side of the code {code} is not a spark-dilation stream "
            f"{'receiver' if role == SENDER else 'sender'}"
        )
    if peer["role"] == role:
        raise PairingError(
            f"the other side of the code {code} is another stream {role}: two {role}s used "
            "one code. Start the stream again with a new code"
        )
    return new_record(key, role, mailbox_url, schema if role == SENDER else peer.get("schema"))


async def pair_over_code(
    reactor: Any,
    role: str,
    mailbox_url: str,
    record_path: str | Path,
    *,
    code: str | None = None,
    schema: str | None = None,
    on_code: Callable[[str], None] | None = None,
    timeout: float = 300.0,
    timeout_option: str = "peer_timeout",
) -> PairingRecord:
    """A stream's first run: meet the peer over the human code (allocated when ``code``
    is None, then told to ``on_code``) and write the record both sides derive.

    The session uses the ``wormhole`` CLI's appid, as a dataset's does, so a
    Spark source opens a code without knowing whether a stream or a dataset
    comes (``receive_session`` pairs a stream too). The sender names the
    stream's schema (base64 Arrow IPC) in its version message, so the
    receiver's record holds it. Waits at most ``timeout`` for the peer.
    """
    from ...wormhole.client import Wormhole
    from .session import SESSION_APPID

    if role not in ROLES:
        raise ValueError(f"role is one of {ROLES}, not {role!r}")
    existing = load_record(record_path)
    if existing is not None:
        raise PairingError(
            f"{record_path} already pairs this side of stream {existing.stream}: resume it "
            "with no code, or revoke it and remove the file to pair again"
        )
    w = Wormhole(
        SESSION_APPID,
        mailbox_url,
        reactor,
        app_versions=stream_versions(role, schema),
        timeout=timeout,
        timeout_option=timeout_option,
    )
    if code is None:
        w.allocate_code(2)
    else:
        w.set_code(code)
    try:
        code = await w.get_code()
        if on_code is not None:
            on_code(code)
        await w.get_verifier()
        versions = await w.get_versions()
        try:
            record = record_from_session(w.shared_key, role, mailbox_url, code, versions, schema)
        except PairingError as e:
            w.send_message(error_message(str(e)))
            raise
        save_record(record_path, record)
    except BaseException:
        with contextlib.suppress(Exception):
            await w.close()
        raise
    with contextlib.suppress(Exception):  # paired: a close the server does not confirm is nothing
        await w.close()
    return record


async def revoke_pairing(
    reactor: Any, record_path: str | Path, reason: str = "", timeout: float = 30.0
) -> tuple[PairingRecord, bool]:
    """Revoke a stream's pairing from this side's record: marked here first (no run of
    this side resumes), then told to the peer's runs through the standing mailbox.

    Returns the record and whether the mailbox server confirmed the message within
    ``timeout`` (if not, the peer learns it when both reach the server; its runs
    cannot pair with this side meanwhile anyway).
    """
    record = load_record(record_path)
    if record is None:
        raise PairingError(f"no pairing record at {record_path}")
    first = record.revoked is None
    revoked = replace(record, revoked=reason or record.revoked or "revoked")
    if first:
        save_record(record_path, revoked)
    told: defer.Deferred = defer.Deferred()

    def posted(msg: GotPosted) -> None:
        if msg.side == record.side and msg.phase == REVOKED_PHASE and not told.called:
            told.callback(True)

    client = StandingClient(
        STREAM_APPID, record.mailbox, reactor, record.side, record.nameplate, posted
    )
    client.post(*revocation(record, revoked.revoked or ""))
    timer = reactor.callLater(timeout, lambda: told.called or told.callback(False))
    confirmed = await told
    if timer.active():
        timer.cancel()
    if confirmed:
        await client.close()
    else:
        await client.stop()
    return revoked, confirmed


def goodbye(conversation: Any, reactor: Any, limit: float = 2.0) -> defer.Deferred:
    """Close a pair's stream subchannel (its protocol has a ``closed`` Deferred) and wait,
    at most ``limit``, until the peer saw it: the other side learns that this run
    ended, not only that the connection went quiet."""
    if conversation is None or conversation.transport is None:
        return defer.succeed(None)
    conversation.transport.loseConnection()
    return conversation.closed.addTimeout(limit, reactor).addErrback(lambda _: None)


class PairChannel:
    """What :class:`~...dilation.manager.DilationManager` uses of a wormhole, for one pair.

    Its L1 records travel as the pair's ``dilate-N`` phases, sealed with the pair's
    key, in order; both runs are spark-dilation, so the peer's versions are ours.
    """

    def __init__(self, client: StandingClient, record: PairingRecord, pair: Pair) -> None:
        self._client, self._side, self.pair = client, record.side, pair
        self.shared_key = pair.key(record.secret)
        self._sent = 0
        self._in = InOrder()
        self._handler: Callable[[bytes], None] | None = None
        self._queued: list[bytes] = []

    @property
    def mailbox_connected(self) -> bool:
        return self._client.is_connected

    def get_peer_versions(self) -> defer.Deferred:
        return defer.succeed(dilation_versions_message())

    def _set_dilate_handler(self, handler: Callable[[bytes], None]) -> None:
        self._handler = handler
        queued, self._queued = self._queued, []
        for record in queued:
            handler(record)

    def send_dilate(self, plaintext: bytes) -> None:
        phase = self.pair.phase(f"dilate-{self._sent}")
        self._sent += 1
        self._client.post(phase, seal_bytes(self.shared_key, self._side, phase, plaintext))

    def received(self, name: str, side: str, body: bytes) -> None:
        m = _DILATE.fullmatch(name)
        if m is None or side == self._side:
            return  # our own, echoed
        plaintext = open_bytes(self.shared_key, side, self.pair.phase(name), body)
        if plaintext is None:  # not sealed with this pair's key: nobody's we know
            log.warning("ignoring a message of pair %s that does not open", self.pair)
            return
        for record in self._in.add(int(m[1]), plaintext):
            if self._handler is None:
                self._queued.append(record)
            else:
                self._handler(record)


class StreamLink:
    """One run of one side, from its pairing record (see the module docstring).

    ``on_pair(pair, dilated)`` is called for each pair (the first, and one for each
    later run of the peer); ``on_ended(error)`` when this run can no longer pair
    (the pairing was revoked, or a later run of this side started).
    ``dilation``: :func:`~...dilation.dilate` options (relay, timeouts).
    """

    def __init__(
        self,
        record_path: str | Path,
        reactor: Any,
        on_pair: Callable[[Pair, DilatedWormhole], None],
        on_ended: Callable[[PairingError], None],
        **dilation: Any,
    ) -> None:
        self.path = Path(record_path)
        record = load_record(self.path)
        if record is None:
            raise PairingError(
                f"no pairing record at {self.path}: a stream's first run pairs with its code"
            )
        self.record = record.next_run()
        save_record(self.path, self.record)  # before anything is posted: no run reuses it
        self._reactor, self._dilation = reactor, dilation
        self._on_pair, self._on_ended = on_pair, on_ended
        self.meeting = Meeting(self.record)
        self._channel: PairChannel | None = None
        self.dilated: DilatedWormhole | None = None
        self._ahead: list[GotPosted] = []
        self.client = StandingClient(
            STREAM_APPID,
            record.mailbox,
            reactor,
            record.side,
            record.nameplate,
            self._posted,
            on_failed=self._failed,
        )
        self.client.keep(*hello(self.record))

    @property
    def pair(self) -> Pair | None:
        return self.meeting.pair

    def stop(self) -> defer.Deferred:
        """End this run; the pairing stays for the next."""
        self._end_pair()
        return self.client.stop()

    def revoke(self, reason: str) -> defer.Deferred:
        """End the pairing for both sides: the peer's runs hear it, this record is marked."""
        self._end_pair()
        self.client.post(*revocation(self.record, reason))
        save_record(self.path, replace(self.record, revoked=reason or "revoked"))
        return self.client.close()

    def _failed(self, error: Exception) -> None:
        """The mailbox server refused this run (an error it sent): it cannot pair."""
        self._end_pair()
        self._on_ended(PairingError(f"the mailbox server {self.record.mailbox} refused: {error}"))

    def _posted(self, msg: GotPosted) -> None:
        name = self.meeting.accepts(msg.phase)
        if name is not None and self._channel is not None:
            self._channel.received(name, msg.side, msg.body)
            return
        if self.meeting.ahead(msg.phase):
            self._ahead.append(msg)  # its pair's hello is still on the way
            return
        heard = self.meeting.heard(msg.side, msg.phase, msg.body)
        if heard.ended is not None:
            self._end_pair()
            self._on_ended(heard.ended)
        elif heard.pair is not None:
            self._start_pair(heard.pair)

    def _start_pair(self, pair: Pair) -> None:
        self._end_pair()
        log.info("stream %s: run %d pairs as %s", self.record.stream, self.record.incarnation, pair)
        self._channel = PairChannel(self.client, self.record, pair)
        manager = DilationManager(self._channel, self._reactor, **self._dilation)
        self.dilated = DilatedWormhole(manager)
        manager.start()
        ahead, self._ahead = self._ahead, []
        for msg in ahead:
            self._posted(msg)
        self._on_pair(pair, self.dilated)

    def _end_pair(self) -> None:
        if self.dilated is not None:
            self.dilated.stop()
        self.dilated = self._channel = None
