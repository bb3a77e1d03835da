"""Options of a dataset transfer, shared by the Spark source/sink and the Python API.

Every deadline says what it waits for; the error raised when it passes names
the option to change. Spark passes options as strings with lower-cased keys;
:meth:`TransferOptions.from_strings` validates them.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from ...errors import DilationError

# Arrow IPC body compressions (the protocol module checks offers against these).
# Defined here, not in protocol.py, so that Spark's data source lookup, which
# imports this module, does not load the wormhole stack (Twisted) with it.
COMPRESSIONS = ("none", "lz4", "zstd")
# What option compression takes: a codec, or "auto" (chosen per partition from
# this machine's compression speed and the link's rate; see transfer/codec.py).
# "parquet": the partition format of transfer/pqformat.py, where the receiver
# decodes it (else zstd).
COMPRESSION_OPTIONS = ("auto", *COMPRESSIONS, "parquet")
RECEIVE_FORMATS = ("parquet", "arrow", "csv")
"""What a received dataset can be written as (the CLI checks it before the code is used)."""
EARLY_LANES = ("auto", "true", "false")
SURFACES = ("python", "spark", "cli")
# The CLI's flags for the options it exposes under another name.
CLI_FLAGS = {"peer_timeout": "--timeout", "relay": "--relay", "no_listen": "--no-listen"}

MAILBOX_ENV = "SPARK_DILATION_MAILBOX"
RELAY_ENV = "SPARK_DILATION_RELAY"
# The public transit relay, the default of the `wormhole` CLI too: two peers
# behind NAT have no direct route and meet only there.
DEFAULT_RELAY_URL = "tcp:transit.magic-wormhole.io:4001"
NO_RELAY = "none"


def resolve_relay(relay: str | None) -> str | None:
    """The relay to use: ``relay``, else ``$SPARK_DILATION_RELAY``, else the public one.

    ``none`` (in either) turns relaying off: direct connections only.
    """
    chosen = (relay or "").strip() or os.environ.get(RELAY_ENV, "").strip() or DEFAULT_RELAY_URL
    return None if chosen.lower() == NO_RELAY else chosen


class TransferOptionError(DilationError, ValueError):
    """A transfer option is unknown or has a value we cannot use."""


@dataclass(frozen=True)
class TransferOptions:
    """Typed options of one transfer (the README's options table documents each).

    * ``lanes``: receiver-side parallelism. A Spark reader's lane registry
      receives the lanes no task slot runs (within 5 s of the first lane) on
      the driver's machine; the Python API runs every lane at once.
    * ``peer_timeout``: seconds to wait for the other side to use the code.
    * ``lane_start_timeout``: seconds a sender waits for a lane to show up
      (lanes start when the reader runs an action).
    * ``reconnect_timeout``: seconds a Dilation connection may stay broken
      (it retries meanwhile) before the partitions on it fail with the
      Dilation give-up error (``DilationReconnectFailed``).
    * ``no_path_timeout``: a Dilation connection never up whose every hint
      failed (refused, timed out) gives up this many seconds after its first
      round of attempts failed, with one error naming the relay and each hint.
    * ``idle_timeout``: seconds a lane waits without any sender activity.
    * ``compression``: ``auto`` (per partition: ``none`` on fast links,
      ``lz4``, ``zstd`` or ``parquet`` where the link is slower than
      compressing; :mod:`.codec`), ``none``, ``lz4`` or ``zstd`` (Arrow IPC
      body compression), or ``parquet`` (:mod:`.pqformat`; zstd to a
      receiver that does not list it).
    * ``early_lanes``: start the receiving lanes as soon as the code is agreed
      (during ``load()``), not when the first action's tasks run, so the
      sender streams while the reader plans. ``auto``: when the reader's tasks
      run on the driver's machine (Spark master ``local`` or
      ``local-cluster``); ``true``/``false`` force it. Lanes stage on the
      machine that ran ``load()``, so ``true`` on a multi-machine cluster
      needs a ``staging_dir`` every executor can read.
    * ``sender_host``: Spark writer only: the Spark tasks of each sending
      machine hand their partitions to one sender process there, which holds
      the Dilation connections to the lanes; ``false``: every Python worker
      keeps connections of its own. Either way the driver machine's sender
      process runs the session, the directory (``transfer/hub.py``) and the
      commit.
    """

    mailbox: str | None = None
    relay: str | None = None
    lanes: int = 2
    peer_timeout: float = 300.0
    lane_start_timeout: float = 300.0
    reconnect_timeout: float = 120.0
    no_path_timeout: float = 15.0
    idle_timeout: float = 600.0
    compression: str = "auto"
    staging_dir: str | None = None
    no_listen: bool = False
    early_lanes: str = "auto"
    sender_host: bool = True
    # Test-only fault injection ("" = none); see docs/transfer.md.
    test_fail: str = ""
    # Not an option: the API the options came from ("python", "spark", "cli"),
    # so that an error names the option the way that API spells it (spelled()).
    surface: str = field(default="python", repr=False, compare=False, metadata={"internal": True})

    def __post_init__(self) -> None:
        if self.lanes < 1 or self.lanes > 4096:
            raise TransferOptionError(f"option lanes={self.lanes} must be between 1 and 4096")
        for name in (
            "peer_timeout",
            "lane_start_timeout",
            "reconnect_timeout",
            "no_path_timeout",
            "idle_timeout",
        ):
            if not getattr(self, name) > 0:
                raise TransferOptionError(
                    f"option {name}={getattr(self, name)!r} must be a positive number of seconds"
                )
        if self.early_lanes not in EARLY_LANES:
            raise TransferOptionError(
                f"option early_lanes={self.early_lanes!r} is not one of {', '.join(EARLY_LANES)}"
            )
        if self.surface not in SURFACES:
            raise TransferOptionError(f"surface={self.surface!r} is not one of {SURFACES}")
        if self.compression not in COMPRESSION_OPTIONS:
            raise TransferOptionError(
                f"option compression={self.compression!r} is not one of "
                f"{', '.join(COMPRESSION_OPTIONS)}"
            )

    @property
    def mailbox_url(self) -> str:
        if self.mailbox:
            return self.mailbox
        if os.environ.get(MAILBOX_ENV):
            return os.environ[MAILBOX_ENV]
        from ...wormhole import DEFAULT_MAILBOX_URL

        return DEFAULT_MAILBOX_URL

    @property
    def relay_url(self) -> str | None:
        return resolve_relay(self.relay)

    @property
    def staging_root(self) -> Path:
        if self.staging_dir:
            return Path(self.staging_dir)
        return Path(tempfile.gettempdir()) / "spark-dilation"

    def spelled(self, name: str) -> str:
        """Option ``name`` as the user gave it to this API, for "raise ..." advice."""
        if self.surface == "cli":
            return CLI_FLAGS.get(name, name)
        if self.surface == "spark":
            return f'option("{name}", ...)'
        return f"{name}="

    def with_(self, **changes: Any) -> TransferOptions:
        return replace(self, **changes)

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls) if not f.metadata.get("internal"))

    @classmethod
    def from_strings(
        cls, options: Mapping[str, str], ignore: tuple[str, ...] = ()
    ) -> TransferOptions:
        """From Spark's string options; unknown keys (not in ``ignore``) are an error."""
        known = {f.name: f for f in fields(cls) if not f.metadata.get("internal")}
        values: dict[str, Any] = {}
        for key, raw in options.items():
            name = key.lower()
            if name in ignore:
                continue
            if name not in known:
                raise TransferOptionError(
                    f'unknown option {key!r} for format("dilation"); known options are '
                    f"{', '.join(sorted((*known, *ignore)))}"
                )
            values[name] = _parse(name, raw, known[name].type)
        return cls(**values, surface="spark")


def merge_options(options: TransferOptions | None, overrides: Mapping[str, Any]) -> TransferOptions:
    """``options`` (default: every default) with ``overrides`` (fields by name) applied."""
    base = options or TransferOptions()
    return base.with_(**overrides) if overrides else base


def _parse(name: str, raw: Any, kind: Any) -> Any:
    text = str(raw).strip()
    kind = str(kind)
    if kind.startswith("int"):
        try:
            return int(text)
        except ValueError:
            raise TransferOptionError(f"option {name}={raw!r} must be a whole number") from None
    if kind.startswith("float"):
        try:
            return float(text)
        except ValueError:
            raise TransferOptionError(
                f"option {name}={raw!r} must be a number of seconds"
            ) from None
    if kind.startswith("bool"):
        if text.lower() in ("true", "1", "yes"):
            return True
        if text.lower() in ("false", "0", "no"):
            return False
        raise TransferOptionError(f"option {name}={raw!r} must be true or false")
    if kind == "str":
        return text.lower() if name == "compression" else text
    return text or None
