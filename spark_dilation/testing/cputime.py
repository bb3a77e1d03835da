"""A pytest plugin: each test's CPU seconds, self plus children, in the JUnit report.

Wall time on a 2-core machine running the suite on several workers says little
about what a test costs; CPU seconds do. Each test gets a ``cpu_s`` property
(``<property name="cpu_s">`` in ``--junitxml``; ``.ci/modules.py`` sums it per
module): the CPU the test process and its process tree used from the test's
setup to its teardown. The tree is this process (``RUSAGE_SELF``), the children
it reaped (``RUSAGE_CHILDREN``) and its live descendants (``/proc``, with what
they reaped): a Spark JVM, a server or a helper started by the test counts; a
session fixture's start-up counts to the first test that asks for it. It counts
low where a descendant outlives its parent: a Spark application run as a child
Python process whose JVM is still exiting when that Python exits is re-parented
to init, and the JVM's CPU leaves the tree (cgroups would keep it; they are not
used here).
"""

from __future__ import annotations

import os
import resource
from collections.abc import Iterator
from pathlib import Path

import pytest

PROPERTY = "cpu_s"
_TICK = os.sysconf("SC_CLK_TCK")
_START = pytest.StashKey[float]()


def _stat(pid: str) -> list[str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text.rsplit(")", 1)[1].split()  # fields from "state" on (ppid is [1])


def tree_cpu(root: int | None = None) -> float:
    """CPU seconds used so far by ``root`` (this process) and its process tree."""
    root = os.getpid() if root is None else root
    own = resource.getrusage(resource.RUSAGE_SELF)
    reaped = resource.getrusage(resource.RUSAGE_CHILDREN)
    total = own.ru_utime + own.ru_stime + reaped.ru_utime + reaped.ru_stime
    stats: dict[int, list[str]] = {}
    children: dict[int, list[int]] = {}
    try:
        entries = [e for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        return total
    for entry in entries:
        fields = _stat(entry)
        if fields is None:
            continue
        pid, ppid = int(entry), int(fields[1])
        stats[pid] = fields
        children.setdefault(ppid, []).append(pid)
    ticks = 0
    todo = list(children.get(root, []))
    while todo:
        pid = todo.pop()
        fields = stats[pid]
        # utime, stime, cutime, cstime: fields 14-17 of stat, [11:15] from "state"
        ticks += sum(int(v) for v in fields[11:15])
        todo += children.get(pid, [])
    return total + ticks / _TICK


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    item.stash[_START] = tree_cpu()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    # The teardown report carries the properties the JUnit writer reads.
    if call.when == "teardown" and _START in item.stash:
        item.user_properties.append((PROPERTY, f"{tree_cpu() - item.stash[_START]:.2f}"))
    yield
