"""The data source's options: parsed, validated and defaulted in one place.

Spark hands a Python data source its options as strings with lower-cased
keys. :meth:`ReadSettings.from_options` turns them into typed settings or
raises :class:`OptionError` naming the option and what to write instead. It
runs wherever the data source does (a planner worker), so environment
defaults are those of the Spark process, not of the notebook that called
``load()``; :func:`~spark_dilation.spark.read_wormhole_file` fills them in
from the caller's environment for that reason.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ..errors import DilationError
from ..transfer.rules.options import TransferOptions
from .staged import CsvOptions, UnsupportedFormatError, normalize_format

__all__ = [
    "ACCEPT_VALUES",
    "KNOWN_OPTIONS",
    "MAILBOX_ENV",
    "RELAY_ENV",
    "OptionError",
    "ReadSettings",
    "default_mailbox_url",
    "default_staging_root",
]

MAILBOX_ENV = "SPARK_DILATION_MAILBOX"
RELAY_ENV = "SPARK_DILATION_RELAY"
# "file": only a file sent with `wormhole send`; "dataset": only a dataset
# sender; unset: whatever the code carries.
ACCEPT_VALUES: tuple[str, ...] = ("file", "dataset")
STAGING_DIR_NAME = "spark-dilation"

# Options that only the file path reads; the dataset path ignores them.
# "path" is what .load(PATH) sets; it is an alias of staged_path.
FILE_ONLY_OPTIONS: tuple[str, ...] = (
    "code",
    "accept",
    "timeout",
    "format",
    "staged_path",
    "path",
    "header",
    "delimiter",
)
# Every option the reader understands: those and the dataset transfer's.
# sender_host is the Spark writer's alone.
# A stream's source (spark/stream.py): its folder, and admission control.
STREAM_READ_OPTIONS: tuple[str, ...] = (
    "state_dir",
    "pairing_dir",
    "maxrecordspertrigger",
    "maxbytespertrigger",
)
KNOWN_OPTIONS: tuple[str, ...] = (
    *FILE_ONLY_OPTIONS,
    *STREAM_READ_OPTIONS,
    *(n for n in TransferOptions.names() if n != "sender_host"),
)


class OptionError(DilationError, ValueError):
    """A data source option is missing, unknown or has a value we cannot use."""


def default_mailbox_url() -> str:
    """``$SPARK_DILATION_MAILBOX``, else the public mailbox server."""
    env = os.environ.get(MAILBOX_ENV)
    if env:
        return env
    # Imported here: the wormhole package pulls in Twisted, which the Spark
    # data source lookup (it imports this module in every new session) and
    # pure file reads do not need.
    from ..wormhole import DEFAULT_MAILBOX_URL

    return DEFAULT_MAILBOX_URL


def default_staging_root() -> Path:
    """``<tempdir>/spark-dilation``: where received files are staged unless told otherwise."""
    return Path(tempfile.gettempdir()) / STAGING_DIR_NAME


def _parse_bool(name: str, value: str) -> bool:
    lowered = value.strip().lower()
    if lowered in ("true", "1", "yes"):
        return True
    if lowered in ("false", "0", "no"):
        return False
    raise OptionError(f"option {name}={value!r} must be true or false")


def _parse_delimiter(value: str) -> str:
    # Spark accepts the two-character text \t for a tab; so do we.
    escapes = {"\\t": "\t"}
    delimiter = escapes.get(value, value)
    if len(delimiter) != 1:
        raise OptionError(
            f"option delimiter={value!r} must be a single character (use \\t for a tab)"
        )
    return delimiter


def _parse_timeout(value: str) -> float:
    try:
        timeout = float(value)
    except ValueError:
        timeout = -1.0
    if not timeout > 0:
        raise OptionError(f"option timeout={value!r} must be a positive number of seconds")
    return timeout


@dataclass(frozen=True)
class ReadSettings:
    """Typed, validated reader options (see the options table in the README)."""

    code: str | None
    accept: str
    mailbox: str | None
    relay: str | None
    timeout: float | None
    format: str | None
    staging_dir: str | None
    staged_path: str | None
    csv: CsvOptions

    @classmethod
    def from_options(cls, options: Mapping[str, str]) -> ReadSettings:
        """Validate Spark's string options; raise :class:`OptionError` naming the culprit."""
        opts = {key.lower(): value for key, value in options.items()}
        unknown = sorted(set(opts) - set(KNOWN_OPTIONS))
        if unknown:
            raise OptionError(
                f'unknown option {", ".join(unknown)} for format("dilation"); '
                f"known options are {', '.join(KNOWN_OPTIONS)}"
            )

        staged_path = opts.get("staged_path") or opts.get("path") or None
        code = (opts.get("code") or "").strip() or None
        if staged_path and code:
            raise OptionError(
                "options code and staged_path exclude each other: code receives a new "
                "transfer, staged_path reads one received earlier"
            )
        if not staged_path and not code:
            raise OptionError(
                'option "code" is required: spark.read.format("dilation")'
                '.option("code", "7-guitarist-revenge").load() '
                "(or option staged_path to read a file received earlier with receive_file())"
            )

        accept = (opts.get("accept") or "").strip().lower()
        if staged_path and not accept:
            accept = "file"  # a staged path can only be a file transfer
        if accept and accept not in ACCEPT_VALUES:
            raise OptionError(
                f"option accept={opts['accept']!r} is not one of file, dataset; leave it unset "
                "to take whatever the code carries (a dataset, or a file sent with "
                "`wormhole send`)"
            )

        try:
            fmt = normalize_format(opts["format"]) if opts.get("format") else None
        except UnsupportedFormatError as exc:
            raise OptionError(str(exc)) from exc

        return cls(
            code=code,
            accept=accept,
            mailbox=opts.get("mailbox") or None,
            relay=opts.get("relay") or os.environ.get(RELAY_ENV) or None,
            timeout=_parse_timeout(opts["timeout"]) if opts.get("timeout") else None,
            format=fmt,
            staging_dir=opts.get("staging_dir") or None,
            staged_path=staged_path,
            csv=CsvOptions(
                header=_parse_bool("header", opts["header"]) if "header" in opts else True,
                delimiter=_parse_delimiter(opts["delimiter"]) if "delimiter" in opts else ",",
            ),
        )

    @property
    def mailbox_url(self) -> str:
        """The mailbox option, else ``$SPARK_DILATION_MAILBOX``, else the public server."""
        return self.mailbox or default_mailbox_url()

    @property
    def staging_root(self) -> Path:
        """The staging_dir option, else ``<tempdir>/spark-dilation``."""
        return Path(self.staging_dir) if self.staging_dir else default_staging_root()
