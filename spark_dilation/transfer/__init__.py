"""Dataset transfer over Dilation: the protocol (pure) and the Python API.

No Spark in here: :mod:`spark_dilation.spark` builds the data source and
sink on top. See ``docs/transfer.md`` for the protocol.
"""

from .api import (
    DatasetSender,
    ReceivedDataset,
    receive_dataset,
    receive_table,
    send_dataset,
    send_in_background,
)
from .options import TransferOptionError, TransferOptions
from .report import TransferReport

__all__ = [
    "DatasetSender",
    "ReceivedDataset",
    "TransferOptionError",
    "TransferOptions",
    "TransferReport",
    "receive_dataset",
    "receive_table",
    "send_dataset",
    "send_in_background",
]
