"""Does this Spark application run its tasks on this machine? (for early lanes)
On which cluster does its driver run? (for a stream's state, :func:`cluster_master`)

A data source's planner worker (where ``schema()`` runs) cannot ask Spark for
its master. Its ancestor is the driver JVM, whose command line carries the
master as PySpark and ``spark-submit`` pass it (``--conf spark.master=...``
or ``--master ...``). ``local`` and ``local-cluster`` run every task on this
machine; anything else, or no answer, is "not known to be local".
"""

from __future__ import annotations

import os
from pathlib import Path

from ..transfer.machine import driver_jvm_pid
from .checkpoint import spark_default


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def master_from_cmdline(args: list[str]) -> str | None:
    """The Spark master a JVM command line names, if any."""
    for i, arg in enumerate(args):
        if arg.startswith("spark.master="):
            return arg.split("=", 1)[1]
        if arg == "--master" and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith("--master="):
            return arg.split("=", 1)[1]
    return None


def is_local_master(master: str | None) -> bool:
    return master is not None and (
        master == "local" or master.startswith(("local[", "local-cluster["))
    )


def driver_master(pid: int | None = None) -> str | None:
    """The master of the nearest ancestor JVM of ``pid`` (default: this process)."""
    jvm = driver_jvm_pid(pid)
    return None if jvm is None else master_from_cmdline(_cmdline(jvm))


def tasks_run_here() -> bool:
    """True when the JVM above this process is a local or local-cluster Spark driver."""
    return is_local_master(driver_master())


def cluster_master() -> str | None:
    """The cluster this driver runs on, as a driver's Python worker can learn it, or None
    (a local master, or nothing says): Databricks by its runtime's environment; else the
    driver JVM's master (:func:`driver_master`); else ``spark.master`` in
    ``spark-defaults.conf``."""
    if os.environ.get("DATABRICKS_RUNTIME_VERSION"):
        return "Databricks"
    master = driver_master() or spark_default("spark.master")
    return None if master is None or is_local_master(master) else master
