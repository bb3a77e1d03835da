"""Dataset transfer over Dilation: the protocol (pure) and the Python API.

No Spark in here: :mod:`spark_dilation.spark` builds the data source and
sink on top. See ``docs/transfer.md`` for the protocol. The layout is by role:

- ``rules/``: pure (no I/O, no Twisted): the protocol's messages, codecs and
  formats, options, the spec, the report, the registry's and the directory's
  rules, the errors, and the state tables of the lane, the sender task and
  the registry.
- ``meet/``: the session over the human code and the directory link that
  introduces the worker processes (both sides use it).
- ``send/``: the writer's side: its verbs (the Spark layer's door), the
  partition stream, the connection pool and deliveries, the sender host.
- ``receive/``: the reader's side (the Spark layer's other door): lanes,
  staging, the read task's side, the lane host, the registry host, copies
  between machines.
- ``api/``: the Python API for one-process peers (CLI, notebooks, services).
- ``link.py``: the framed, authenticated link between our own processes;
  ``machine.py``: spawning helpers, owner watches, locks, private folders and
  the free-space check.

``send/`` and ``receive/`` never import each other. A file named
``*host.py`` is a helper process (``python -m ...``), and nothing else is.

The names below load lazily: Spark's worker processes import the submodules
they need, and every module they skip (``pyarrow.dataset`` pulls in pandas)
is CPU time saved in each of those short-lived processes.
"""

from __future__ import annotations

from ..lazy import exports

_EXPORTS = {
    "DatasetSender": ".api",
    "Progress": ".rules.report",
    "ReceivedDataset": ".api",
    "receive_agreed": ".api",
    "receive_dataset": ".api",
    "receive_table": ".api",
    "send_dataset": ".api",
    "send_in_background": ".api",
    "TransferOptionError": ".rules.options",
    "TransferOptions": ".rules.options",
    "TransferReport": ".rules.report",
}

__all__ = sorted(_EXPORTS)
__getattr__ = exports(__name__, _EXPORTS)
