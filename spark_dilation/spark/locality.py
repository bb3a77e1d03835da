"""Does this Spark application run its tasks on this machine? (for early lanes)

A data source's planner worker (where ``schema()`` runs) cannot ask Spark for
its master. Its ancestor is the driver JVM, whose command line carries the
master as PySpark and ``spark-submit`` pass it (``--conf spark.master=...``
or ``--master ...``). ``local`` and ``local-cluster`` run every task on this
machine; anything else, or no answer, is "not known to be local".
"""

from __future__ import annotations

from pathlib import Path

from ..transfer.machine import driver_jvm_pid


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
