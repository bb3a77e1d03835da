"""Python API for single-process peers: a laptop, a notebook kernel, a service.

::

    from spark_dilation.transfer import send_dataset, receive_table

    # one side: a pyarrow.Table, a pyarrow.dataset, or Parquet/CSV/JSON/Arrow files
    report = send_dataset(table, code="7-guitarist-revenge")

    # the other side (or spark.read.format("dilation") on a cluster)
    table = receive_table("7-guitarist-revenge")

Both sides speak the same protocol as the Spark source and sink, so any pair
works: Spark to Python, Python to Spark, Python to Python. The sender sends
its partitions in parallel over one Dilation connection per lane; a
partition whose lane vanished before confirming it is sent again.

The modules, one job each: :mod:`.sources` (what can be sent, as partitions),
:mod:`.send` (the sender), :mod:`.receive` (the receiver), :mod:`.output`
(the received dataset as files) and :mod:`.progress` (the meters).
"""

from __future__ import annotations

from ..rules.options import RECEIVE_FORMATS, merge_options
from ..rules.report import Progress
from .output import dest_problem, format_refusal
from .progress import PROGRESS_INTERVAL, ProgressCallback, confirmed_rows
from .receive import ReceivedDataset, receive_agreed, receive_dataset, receive_table
from .send import DatasetSender, send_dataset, send_in_background
from .sources import Source, total_rows
from .streams import revoke_stream

__all__ = [
    "PROGRESS_INTERVAL",
    "RECEIVE_FORMATS",
    "DatasetSender",
    "Progress",
    "ProgressCallback",
    "ReceivedDataset",
    "Source",
    "confirmed_rows",
    "dest_problem",
    "format_refusal",
    "merge_options",
    "receive_agreed",
    "receive_dataset",
    "receive_table",
    "revoke_stream",
    "send_dataset",
    "send_in_background",
    "total_rows",
]
