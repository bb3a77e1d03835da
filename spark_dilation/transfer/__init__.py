"""Dataset transfer over Dilation: the protocol (pure) and the Python API.

No Spark in here: :mod:`spark_dilation.spark` builds the data source and
sink on top. See ``docs/transfer.md`` for the protocol.

The names below load lazily: Spark's worker processes import the submodules
they need, and every module they skip (``pyarrow.dataset`` pulls in pandas)
is CPU time saved in each of those short-lived processes.
"""

from __future__ import annotations

from typing import Any

_EXPORTS = {
    "DatasetSender": ".api",
    "Progress": ".report",
    "ReceivedDataset": ".api",
    "receive_agreed": ".api",
    "receive_dataset": ".api",
    "receive_table": ".api",
    "send_dataset": ".api",
    "send_in_background": ".api",
    "TransferOptionError": ".options",
    "TransferOptions": ".options",
    "TransferReport": ".report",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module, __name__), name)
