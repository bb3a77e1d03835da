"""Fault points: a test stops a Spark application dead at one step of a stream.

``SPARK_DILATION_FAULTS`` lists ``point@n=marker`` items, ``;``-separated. When
the code reaches ``point`` with a number at or past ``n`` and ``marker`` does
not exist yet, the marker is made and the whole process group named by
``SPARK_DILATION_FAULT_GROUP`` (the application: its driver, JVM and Python
workers) is killed with SIGKILL: a kill at a known step of Spark's batch
phases, not at a moment chosen by a timer. The marker makes it happen once, so
the application started again with the same environment runs on. Unset (every
user's case), :func:`reached` returns at once.
"""

from __future__ import annotations

import os
import signal

FAULTS_ENV = "SPARK_DILATION_FAULTS"
GROUP_ENV = "SPARK_DILATION_FAULT_GROUP"

# The points (each named where it is reached):
SOURCE_PLANNED = "source-planned"  # partitions(start, end): after the offset log entry
SOURCE_COMMIT = "source-commit"  # commit(end): after the commit log entry, before freeing
SINK_STAGED = "sink-staged"  # the sink's commit(B) after have: before the commit log


def reached(point: str, n: int) -> None:
    spec = os.environ.get(FAULTS_ENV)
    if not spec:
        return
    for item in spec.split(";"):
        name, _, rest = item.partition("@")
        at, _, marker = rest.partition("=")
        if name != point or not at or n < int(at) or not marker:
            continue
        try:
            os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        except FileExistsError:
            continue
        group = int(os.environ.get(GROUP_ENV) or os.getpgrp())
        os.killpg(group, signal.SIGKILL)
