"""The session over the human code: one process per side agrees on a transfer.

The sender offers (schema, transfer id, compression), the receiver answers
with its lane count, and both derive the transfer secret; then the code is
used up and the session wormhole closes. Everything else is derived from the
secret (:class:`~..rules.spec.TransferSpec`).

The session uses the ``wormhole`` CLI's appid, so a receiver opens the code
without knowing what is coming: a dataset sender (its ``app_versions`` name
our protocol) or a plain file sent with ``wormhole send``, which
:func:`receive_session` then receives as a file.
"""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
from twisted.internet import defer

from ...errors import DilationError, PeerRejectedError, TransferError
from ...transit import offers
from ...wormhole.blocking import call_soon, ensure_reactor, run_and_wait
from ..machine import space_refusal
from ..rules import pqformat
from ..rules.errors import ProtocolError, SessionTimeout
from ..rules.options import TransferOptions
from ..rules.pairing import RECEIVER, SENDER, PairingRecord
from ..rules.protocol import (
    PROTOCOL,
    SESSION_RECEIVER,
    SESSION_SENDER,
    Accept,
    Offer,
    decode_session_message,
    error_message,
    schema_bytes,
    session_role,
    session_versions,
    transfer_secret,
)
from ..rules.spec import TransferSpec
from .record import save_record

log = logging.getLogger(__name__)

SESSION_APPID = offers.APPID
RECEIVER_FORMATS = (pqformat.FORMAT,)


# What a plain wormhole client (no spark-dilation entry in its app_versions)
# is told, as the standard {"error": ...} message: `wormhole receive` prints it.
PLAIN_RECEIVER_TOLD = (
    "this code carries a spark-dilation dataset, which `wormhole receive` cannot take. "
    "Ask the sender for a new code and receive it with `pip install spark-dilation` and "
    "`spark-dilation receive CODE` (or in Spark: "
    'spark.read.format("dilation").option("code", CODE).load())'
)


def _reactor() -> Any:
    from twisted.internet import reactor

    return reactor


def _wait(fn: Callable[[], Any], timeout: float, what: str) -> Any:
    return run_and_wait(
        fn,
        timeout=timeout,
        on_timeout=lambda: SessionTimeout(f"{what} did not finish within {timeout:g} s"),
    )


async def within(d: defer.Deferred, seconds: float, error: Callable[[], BaseException]) -> Any:
    """Await ``d`` (on the reactor) for at most ``seconds``; then raise ``error()``."""
    d.addTimeout(seconds, _reactor())
    try:
        return await d
    except defer.TimeoutError:
        raise error() from None


class SenderSession:
    """The sender's session: :meth:`open` returns at once with :attr:`code`; :meth:`wait` agrees.

    ::

        session = SenderSession.open(schema, options, code=None)
        print(session.code)          # tell the receiver
        spec = session.wait()        # blocks until the receiver answered
    """

    def __init__(self, w: Any, code: str, offer: Offer, options: TransferOptions) -> None:
        self._w = w
        self.code = code
        self.offer = offer
        self.options = options

    @classmethod
    def open(
        cls,
        schema: pa.Schema,
        options: TransferOptions,
        *,
        code: str | None = None,
        source: str = "python",
        code_length: int = 2,
        rows: int | None = None,
        nbytes: int | None = None,
    ) -> SenderSession:
        """``rows``/``nbytes``: the dataset's totals if known (the offer's ``rows``/``bytes``)."""
        from ...wormhole.client import Wormhole

        ensure_reactor()
        offer = Offer(uuid.uuid4().hex, schema, options.compression, source, rows, nbytes)

        def start() -> defer.Deferred:
            w = Wormhole(
                SESSION_APPID,
                options.mailbox_url,
                _reactor(),
                app_versions=session_versions(SESSION_SENDER),
                timeout=options.peer_timeout,
                timeout_option=options.spelled("peer_timeout"),
            )
            if code is None:
                w.allocate_code(code_length)
            else:
                w.set_code(code)

            def got(c: str) -> tuple[Any, str]:
                return w, c

            def failed(f: Any) -> Any:
                w.close().addErrback(lambda _: None)
                return f

            return w.get_code().addCallbacks(got, failed)

        w, got_code = _wait(start, 60, "getting a code")
        return cls(w, got_code, offer, options)

    def wait(self) -> TransferSpec:
        """Wait for the receiver (``peer_timeout``), exchange offer and answer, close."""
        w = self._w
        offer = self.offer

        async def run() -> TransferSpec:
            try:
                await w.get_verifier()
                versions = await w.get_versions()
                if PROTOCOL not in versions:
                    # A plain wormhole client (`wormhole receive`) waits for a
                    # file offer it will never get: the standard error message
                    # makes it print ours and exit instead of hanging.
                    w.send_message(error_message(PLAIN_RECEIVER_TOLD))
                    raise TransferError(
                        f"the receiver of the code {self.code} is a plain wormhole client (such "
                        "as `wormhole receive`), which cannot take a dataset; it was told how to "
                        "receive one. Send again with a new code (or send a file with "
                        "`spark-dilation send --classic FILE`)"
                    )
                if session_role(versions) == SESSION_SENDER:
                    raise TransferError(
                        f"the other side of the code {self.code} is another sender, not a "
                        "receiver: two senders used the same code. Send again with a new code."
                    )
                w.send_message(offer.encode())
                answer = await within(
                    w.get_message(),
                    self.options.peer_timeout,
                    lambda: TransferError(
                        f"the receiver of the code {self.code} did not answer the dataset offer "
                        f"within {self.options.peer_timeout:g} seconds; it may have ended. "
                        f"Raise {self.options.spelled('peer_timeout')} to wait longer."
                    ),
                )
                kind, body = decode_session_message(answer)
                if kind == "error":
                    raise PeerRejectedError(body)
                if kind != "accept":
                    raise ProtocolError(f"expected the receiver's answer, got {kind}")
                secret = transfer_secret(w.derive_key)
            except BaseException:
                with contextlib.suppress(DilationError):
                    await w.close()
                raise
            await w.close()
            return _spec(offer, secret, body.lanes, self.options, body.formats, body.private_doors)

        return _wait(
            lambda: defer.ensureDeferred(run()),
            self.options.peer_timeout + 60,
            "the session with the receiver",
        )

    def cancel(self) -> None:
        """Close the wormhole: a receiver not yet met will not be met; a :meth:`wait`
        under way (in any thread) fails with the wormhole's error (``LonelyError``)."""
        call_soon(self._w.close)


def _spec(
    offer: Offer,
    secret: bytes,
    lanes: int,
    options: TransferOptions,
    formats: tuple[str, ...] = (),
    private_doors: bool = False,
) -> TransferSpec:
    return TransferSpec(
        offer.transfer_id,
        secret,
        lanes,
        schema_bytes(offer.schema),
        offer.compression,
        options,
        total_rows=offer.rows,
        formats=formats,
        private_doors=private_doors,
    )


@dataclass(frozen=True)
class ReceivedFileResult:
    """The code carried a plain file (``wormhole send``), now on local disk."""

    received: Any  # transit.filetransfer.ReceivedFile


async def accept_offer(
    w: Any,
    options: TransferOptions,
    check: Callable[[pa.Schema], str | None] | None = None,
    room: Sequence[Path] = (),
) -> TransferSpec:
    """The receiver's half of the session, on the reactor, once the key is confirmed.

    Takes the dataset offer from ``w`` (whose peer named our protocol in its
    versions), answers with our lane count and derives the transfer secret;
    the caller closes ``w``. ``check`` may refuse the offered schema: the
    reason it returns goes to the sender and is raised as a
    :class:`TransferError`. ``room``: folders that will hold the data (the
    staging root, the output); an offer whose ``bytes`` clearly do not fit
    there is refused the same way.
    """
    if session_role(await w.get_versions()) == SESSION_RECEIVER:
        raise TransferError(
            "the other side of this code is another receiver, not the sender: two "
            "receivers used the same code (a reader ran twice, or one mistyped its code "
            "and the sender's code is spent). Ask the sender for a new code."
        )
    message = await within(
        w.get_message(),
        options.peer_timeout,
        lambda: TransferError(
            f"the other side used the code but sent no dataset offer within "
            f"{options.peer_timeout:g} seconds; it may have ended. "
            f"Raise {options.spelled('peer_timeout')} to wait longer."
        ),
    )
    try:
        kind, offer = decode_session_message(message)
        if kind == "error":
            raise PeerRejectedError(offer)
        if kind != "offer":
            raise ProtocolError(f"expected the sender's dataset offer, got {kind}")
    except ProtocolError as e:
        w.send_message(error_message(str(e)))
        raise
    reason = check(offer.schema) if check is not None else None
    if reason is None and room:
        reason = space_refusal(offer.bytes, list(room))
    if reason is not None:
        w.send_message(error_message(reason))
        raise TransferError(reason)
    # Our lanes decode every partition format (transfer/lane.py).
    private = offer.private_doors  # the sender offered it; we take it
    w.send_message(Accept(options.lanes, RECEIVER_FORMATS, private).encode())
    secret = transfer_secret(w.derive_key)
    return _spec(offer, secret, options.lanes, options, RECEIVER_FORMATS, private)


def receive_session(
    code: str,
    options: TransferOptions,
    *,
    file_dest: Path | None = None,
    accept_file: bool = True,
    room: Sequence[Path] = (),
    stream_record: Path | None = None,
) -> TransferSpec | ReceivedFileResult | PairingRecord:
    """Open ``code`` and agree on a dataset transfer, or receive the file it carries,
    or pair as the receiver of the stream it carries.

    ``file_dest``: where a plain file goes (required to accept one); ``room``:
    see :func:`accept_offer`; ``stream_record``: where a stream's pairing record
    goes (required to accept a stream).
    """
    from ...transit.connector import TransitConnector
    from ...transit.filetransfer import ReceivedFile, receive
    from ...wormhole.client import Wormhole
    from .resume import STREAM_PROTOCOL, record_from_session, stream_versions

    ensure_reactor()

    async def run() -> TransferSpec | ReceivedFileResult | PairingRecord:
        reactor = _reactor()
        w = Wormhole(
            SESSION_APPID,
            options.mailbox_url,
            reactor,
            app_versions={**session_versions(SESSION_RECEIVER), **stream_versions(RECEIVER)},
            timeout=options.peer_timeout,
            timeout_option=options.spelled("peer_timeout"),
        )
        try:
            w.set_code(code)
            await w.get_verifier()
            versions = await w.get_versions()
            peer_stream = versions.get(STREAM_PROTOCOL)
            if isinstance(peer_stream, dict) and peer_stream.get("role") == SENDER:
                if stream_record is None:
                    told = (
                        "this code carries a spark-dilation stream: read it with "
                        'spark.readStream.format("dilation").option("code", CODE).load()'
                    )
                    w.send_message(error_message(told))
                    raise TransferError(told)
                record = record_from_session(
                    w.shared_key, RECEIVER, options.mailbox_url, code, versions
                )
                save_record(stream_record, record)
                await w.close()
                return record
            if PROTOCOL not in versions:
                if not accept_file or file_dest is None:
                    raise TransferError("the sender offers a file, not a dataset")
                connector = TransitConnector(
                    reactor,
                    is_sender=False,
                    relay_url=options.relay_url,
                    no_listen=options.no_listen,
                )
                got = await receive(w, file_dest, connector)
                if not isinstance(got, ReceivedFile):
                    raise TransferError(
                        f"the sender offered a text message, not data: {got.message[:80]!r}"
                    )
                await w.close()
                return ReceivedFileResult(got)
            spec = await accept_offer(w, options, room=room)
        except BaseException:
            with contextlib.suppress(DilationError):
                await w.close()
            raise
        await w.close()
        return spec

    return _wait(
        lambda: defer.ensureDeferred(run()),
        options.peer_timeout + 24 * 3600,
        "the session with the sender",
    )
