"""File-transfer v1 over classic Transit: what ``wormhole send`` speaks.

Sender: ``{"transit": hints}``, ``{"offer": {"file"|"directory": ...}}``; the
receiver answers with its own ``transit`` message and
``{"answer": {"file_ack": "ok"}}``; the bytes then flow as Transit records and
the receiver ends with one record ``{"ack": "ok", "sha256": HEX}``.
Directories travel as one zip file (``mode: "zipfile/deflated"``).

The transit key is ``derive_key("lothar.com/wormhole/text-or-file-xfer/transit-key")``
whatever the app id (the reference's bug #339, now part of the protocol).

A receiver writes into a hidden temporary file next to the destination and
renames it only after every byte arrived and the hash matched: a failed
transfer leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from twisted.internet import defer

from ..errors import DilationError, TransferError
from ..wormhole import Wormhole
from . import offers
from .connector import TransitConnector
from .protocol import TRANSIT_KEY_LENGTH, TransitError

log = logging.getLogger(__name__)

TRANSIT_KEY_PURPOSE = offers.APPID + "/transit-key"


@dataclass(frozen=True)
class ReceivedFile:
    path: Path  # the received file, or the unpacked directory for a directory offer
    kind: str  # "file" or "directory"
    size: int  # bytes received on the wire
    sha256: str  # hex digest of what was received on the wire


@dataclass(frozen=True)
class ReceivedText:
    message: str


@dataclass(frozen=True)
class Offer:
    """What the sender proposes, for the receiver's accept() callback."""

    kind: str  # "file" or "directory"
    name: str
    size: int  # bytes on the wire (the zip size for a directory)
    numfiles: int = 1
    numbytes: int = 0


# --- sender ---------------------------------------------------------------------


@dataclass
class _Payload:
    offer: dict[str, Any]
    path: Path
    cleanup: Path | None = None


def _build_payload(path: Path) -> _Payload:
    path = Path(path)
    if not path.exists():
        raise TransferError(f"cannot send {str(path)!r}: no such file or directory")
    name = path.resolve().name
    if path.is_file():
        return _Payload({"file": {"filename": name, "filesize": path.stat().st_size}}, path)
    if not path.is_dir():
        raise TransferError(f"cannot send {str(path)!r}: not a regular file or directory")
    fd, zip_name = tempfile.mkstemp(prefix="spark-dilation-", suffix=".zip")
    os.close(fd)
    numfiles = numbytes = 0
    try:
        with zipfile.ZipFile(zip_name, "w", zipfile.ZIP_DEFLATED, allowZip64=True) as zf:
            for root, dirs, files in os.walk(path, followlinks=True):
                dirs.sort()
                rel_root = Path(root).relative_to(path)
                if not files and not dirs and rel_root != Path("."):
                    zf.writestr(str(rel_root) + "/", b"")  # keep empty directories
                for filename in sorted(files):
                    full = Path(root) / filename
                    zf.write(full, str(rel_root / filename))
                    numfiles += 1
                    numbytes += full.stat().st_size
    except OSError as e:
        os.unlink(zip_name)
        raise TransferError(f"cannot send {str(path)!r}: {e}") from e
    zipsize = Path(zip_name).stat().st_size
    offer = {
        "directory": {
            "mode": "zipfile/deflated",
            "dirname": name,
            "zipsize": zipsize,
            "numbytes": numbytes,
            "numfiles": numfiles,
        }
    }
    return _Payload(offer, Path(zip_name), cleanup=Path(zip_name))


async def _exchange_hints(w: Wormhole, connector: TransitConnector) -> None:
    hints = await connector.get_connection_hints()
    transit = {"abilities-v1": connector.get_connection_abilities(), "hints-v1": hints}
    w.send_message(offers.encode({"transit": transit}))
    connector.set_transit_key(w.derive_key(TRANSIT_KEY_PURPOSE, TRANSIT_KEY_LENGTH))


async def send_path(
    w: Wormhole,
    path: Path,
    connector: TransitConnector,
    *,
    on_status: Callable[[str], None] = lambda s: None,
    progress: Callable[[int], None] | None = None,
) -> str:
    """Offer ``path`` (file or directory) and send it; returns the sha256 hex.

    Call after the code is set; waits for key confirmation itself.
    """
    payload = _build_payload(path)
    try:
        await w.get_verifier()
        await _exchange_hints(w, connector)
        w.send_message(offers.encode({"offer": payload.offer}))
        while True:
            reply = offers.parse(await w.get_message())
            if isinstance(reply, offers.TransitHints):
                connector.add_connection_hints(reply.transit.get("hints-v1", []))
            elif isinstance(reply, offers.Answer):
                if reply.fields.get("file_ack") != "ok":
                    raise TransferError(f"the other side declined the transfer: {reply.fields}")
                break
            else:
                log.info("ignoring %r while waiting for the answer", reply)
        conn = await connector.connect()
        on_status(f"sending ({conn.describe()})")
        hasher = hashlib.sha256()
        with open(payload.path, "rb") as f:
            await conn.send_file(f, hasher, progress)
        try:
            ack = json.loads(await conn.receive_record())
        except TransitError as e:
            raise TransferError(
                "the connection closed before the receiver confirmed the file"
            ) from e
        finally:
            conn.close()
        if not isinstance(ack, dict) or ack.get("ack") != "ok":
            raise TransferError(f"the receiver reported a failure: {ack!r}")
        if "sha256" in ack and ack["sha256"] != hasher.hexdigest():
            raise TransferError("the receiver got different bytes than we sent (hash mismatch)")
        return hasher.hexdigest()
    finally:
        connector.stop()
        if payload.cleanup is not None:
            payload.cleanup.unlink(missing_ok=True)


# --- receiver -------------------------------------------------------------------


def _safe_name(name: Any, kind: str) -> str:
    base = os.path.basename(str(name)) if isinstance(name, str) else ""
    if base in ("", ".", ".."):
        raise TransferError(f"the sender offered a {kind} with an unusable name: {name!r}")
    return base


def _parse_offer(fields: dict[str, Any]) -> Offer:
    try:
        if "file" in fields:
            f = fields["file"]
            size = int(f["filesize"])
            return Offer("file", _safe_name(f["filename"], "file"), size, 1, size)
        if "directory" in fields:
            d = fields["directory"]
            if not str(d.get("mode", "")).startswith("zipfile"):
                raise TransferError(f"unknown directory-transfer mode {d.get('mode')!r}")
            return Offer(
                "directory",
                _safe_name(d["dirname"], "directory"),
                int(d["zipsize"]),
                int(d.get("numfiles", 0)),
                int(d.get("numbytes", 0)),
            )
    except (KeyError, TypeError, ValueError) as e:
        raise TransferError(f"the sender's offer is malformed: {e}") from e
    raise TransferError(f"unknown offer type {sorted(fields)}")


async def receive(
    w: Wormhole,
    dest_dir: Path,
    connector: TransitConnector,
    *,
    accept: Callable[[Offer], bool] = lambda offer: True,
    output_name: str | None = None,
    overwrite: bool = False,
    on_status: Callable[[str], None] = lambda s: None,
    progress: Callable[[int], None] | None = None,
) -> ReceivedFile | ReceivedText:
    """Receive whatever the sender offers: a text, a file or a directory.

    Call after the code is set. A file lands in ``dest_dir / (output_name or
    the offered name)``; nothing is written unless every byte arrived intact.
    """
    try:
        return await _receive(
            w, Path(dest_dir), connector, accept, output_name, overwrite, on_status, progress
        )
    finally:
        connector.stop()


async def _receive(
    w: Wormhole,
    dest_dir: Path,
    connector: TransitConnector,
    accept: Callable[[Offer], bool],
    output_name: str | None,
    overwrite: bool,
    on_status: Callable[[str], None],
    progress: Callable[[int], None] | None,
) -> ReceivedFile | ReceivedText:
    await w.get_verifier()
    sent_hints = False
    while True:
        message = offers.parse(await w.get_message())
        if isinstance(message, offers.TransitHints):
            connector.add_connection_hints(message.transit.get("hints-v1", []))
            if not sent_hints:
                sent_hints = True
                await _exchange_hints(w, connector)
        elif isinstance(message, offers.TextOffer):
            w.send_message(offers.text_ack())
            return ReceivedText(message.message)
        elif isinstance(message, offers.UnsupportedOffer):
            try:
                offer = _parse_offer(message.details)
            except TransferError as e:
                w.send_message(offers.error_message(str(e)))
                raise
            break
        else:
            log.info("ignoring %r while waiting for the offer", message)

    target = dest_dir / (output_name or offer.name)
    if target.exists() and not overwrite:
        reason = f"refusing to overwrite existing {str(target)!r}"
        w.send_message(offers.error_message("transfer rejected: file exists"))
        raise TransferError(reason + "; remove it or choose another output name")
    if not accept(offer):
        w.send_message(offers.error_message("transfer rejected"))
        raise TransferError("you declined the transfer")
    if not sent_hints:
        await _exchange_hints(w, connector)
    w.send_message(offers.encode({"answer": {"file_ack": "ok"}}))

    conn = await connector.connect()
    on_status(f"receiving ({conn.describe()})")
    dest_dir.mkdir(parents=True, exist_ok=True)
    fd, partial_name = tempfile.mkstemp(prefix=f".{offer.name}.", suffix=".partial", dir=dest_dir)
    partial = Path(partial_name)
    try:
        with os.fdopen(fd, "wb") as out:
            digest = await _receive_bytes(conn, out, offer.size, progress)
        conn.send_record(json.dumps({"ack": "ok", "sha256": digest}).encode())
        await conn.close()
        if offer.kind == "file":
            if target.exists() and overwrite:
                target.unlink()
            os.replace(partial, target)
        else:
            _unpack(partial, target, overwrite)
        return ReceivedFile(target, offer.kind, offer.size, digest)
    except BaseException:
        conn.abort()
        raise
    finally:
        partial.unlink(missing_ok=True)


async def _receive_bytes(conn: Any, out: Any, size: int, progress: Any) -> str:
    """Write exactly ``size`` bytes of records to ``out``; return their sha256."""
    hasher = hashlib.sha256()
    done: defer.Deferred = defer.Deferred()
    state = {"got": 0}

    def on_record(record: bytes) -> None:
        if done.called:
            return
        state["got"] += len(record)
        if state["got"] > size:
            done.errback(TransferError(f"the sender sent more than the {size} bytes it offered"))
            return
        hasher.update(record)
        out.write(record)
        if progress is not None:
            progress(len(record))
        if state["got"] == size:
            done.callback(None)

    def on_close(_: Any) -> None:
        if not done.called:
            reason = conn._error
            detail = f" ({reason})" if reason and "closed" not in str(reason) else ""
            done.errback(
                TransferError(
                    f"the connection dropped before the whole file arrived: got {state['got']} "
                    f"of {size} bytes{detail}. Nothing was saved; try again."
                )
            )

    if size == 0:
        return hasher.hexdigest()
    conn.set_record_handler(on_record)
    conn.when_closed().addCallback(on_close)
    await done
    return hasher.hexdigest()


def _unpack(zip_path: Path, target: Path, overwrite: bool) -> None:
    """Extract into a temporary sibling, then move into place (never half a tree)."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        with zipfile.ZipFile(zip_path) as zf:
            root = tmp.resolve()
            for info in zf.infolist():
                dest = (tmp / info.filename).resolve()
                if root != dest and root not in dest.parents:
                    raise TransferError(f"the zip holds an unsafe path {info.filename!r}")
                zf.extract(info, tmp)
                mode = info.external_attr >> 16
                if mode and not info.is_dir():
                    os.chmod(dest, mode & 0o777 or 0o644)
        if target.exists() and overwrite:
            shutil.rmtree(target) if target.is_dir() else target.unlink()
        os.replace(tmp, target)
    except zipfile.BadZipFile as e:
        raise TransferError(f"the received directory is not a valid zip file: {e}") from e
    finally:
        with contextlib.suppress(FileNotFoundError):
            shutil.rmtree(tmp)


# --- blocking helpers -------------------------------------------------------------


def receive_file_blocking(
    code: str,
    dest_dir: Path,
    *,
    mailbox_url: str,
    relay_url: str | None = None,
    appid: str = offers.APPID,
    timeout: float | None = None,
    no_listen: bool = False,
    output_name: str | None = None,
    timeout_option: str = "timeout=",
) -> ReceivedFile:
    """Receive one offered file or directory into ``dest_dir`` (any non-reactor thread).

    Raises a :class:`~spark_dilation.errors.DilationError` with a user-facing
    message on failure, leaving no partial file behind.
    """
    from ..wormhole.blocking import run_and_wait

    def run() -> defer.Deferred:
        from twisted.internet import reactor

        async def go() -> ReceivedFile | ReceivedText:
            w = Wormhole(
                appid, mailbox_url, reactor, timeout=timeout, timeout_option=timeout_option
            )
            connector = TransitConnector(
                reactor, is_sender=False, relay_url=relay_url, no_listen=no_listen
            )
            try:
                w.set_code(code)
                result = await receive(w, dest_dir, connector, output_name=output_name)
            except BaseException:
                with contextlib.suppress(DilationError):
                    await w.close()
                raise
            await w.close()
            return result

        return defer.ensureDeferred(go())

    limit = timeout + 60 if timeout else 24 * 3600  # the wormhole's own timeout comes first
    result = run_and_wait(
        run,
        timeout=limit,
        on_timeout=lambda: TransferError(f"receiving the file did not end within {limit:g} s"),
    )
    if isinstance(result, ReceivedText):
        raise TransferError(
            f"the sender offered a text message, not a file: {result.message[:80]!r}"
        )
    return result
