"""Receiving a file sent with ``wormhole send`` into a staging directory.

:func:`receive_file` blocks the calling process until the file is on local
disk. Users call it directly (in a notebook or on the driver) when they want
Spark's own readers; the data source calls it from ``schema()``, in a planner
worker.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from ..transfer.rules.options import resolve_relay
from .options import default_mailbox_url, default_staging_root

if TYPE_CHECKING:
    from ..transit.filetransfer import ReceivedFile

__all__ = ["new_staging_dir", "receive_file"]


def new_staging_dir(staging_root: str | os.PathLike[str] | None = None) -> Path:
    """A fresh, empty, uniquely named directory under ``staging_root``.

    One directory per transfer, so concurrent loads never collide and a
    received file's name can be kept as sent (its extension tells the format).
    """
    root = Path(staging_root) if staging_root else default_staging_root()
    root.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix="receive-", dir=root))


def receive_file(
    code: str,
    dest_dir: str | os.PathLike[str] | None = None,
    *,
    mailbox: str | None = None,
    relay: str | None = None,
    timeout: float | None = None,
    no_listen: bool = False,
    staging_dir: str | os.PathLike[str] | None = None,
    timeout_option: str = "timeout=",
) -> ReceivedFile:
    """Receive a file or directory sent with ``wormhole send`` (blocking; runs right here).

    Use it to hand the file to Spark's own readers, or to read it later with
    ``option("staged_path", ...)``::

        received = receive_file("7-guitarist-revenge")
        df = spark.read.parquet(str(received.path))

    ``dest_dir`` defaults to a new directory under ``staging_dir`` (default
    ``<tempdir>/spark-dilation``); nothing is left there if the transfer fails.
    ``mailbox`` defaults to ``$SPARK_DILATION_MAILBOX`` or the public server,
    ``relay`` (a transit relay, ``tcp:HOST:PORT``; ``none`` for none) to
    ``$SPARK_DILATION_RELAY`` or the public relay. Raises
    :class:`~spark_dilation.errors.DilationError` subclasses whose message
    says what went wrong; ``timeout_option`` is how the timeout error names
    ``timeout`` (the data source passes its option's spelling).
    """
    # Imported here so that importing spark_dilation.spark (which Spark does
    # in every session to discover data sources) does not load Twisted.
    from ..transit.filetransfer import receive_file_blocking

    created = dest_dir is None
    dest = new_staging_dir(staging_dir) if dest_dir is None else Path(dest_dir)
    dest.mkdir(parents=True, exist_ok=True)
    try:
        return receive_file_blocking(
            code,
            dest,
            mailbox_url=mailbox or default_mailbox_url(),
            relay_url=resolve_relay(relay),
            timeout=timeout,
            no_listen=no_listen,
            timeout_option=timeout_option,
        )
    except BaseException:
        if created:
            shutil.rmtree(dest, ignore_errors=True)
        raise
