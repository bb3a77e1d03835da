"""A pytest plugin: each test's CPU seconds and the JVMs it started, in the JUnit report.

Wall time on a 2-core machine running the suite on several workers says little
about what a test costs; CPU seconds do, and so does the number of Spark JVMs it
starts (each costs seconds of both cores). Each test gets two properties
(``<property>`` in ``--junitxml``; ``.ci/modules.py`` sums them per module):

- ``cpu_s``: the CPU the test process and everything it started used, from the
  test's setup to its teardown. Where it can (root, a cgroup ``cpuacct``
  hierarchy or cgroup v2), each test process moves itself into a cgroup of its
  own at start (:class:`CgroupMeter`): every process it starts stays in it, even
  one re-parented to init (a Spark JVM still exiting when its Python parent
  exits), so nothing is missed. Elsewhere it counts the process tree
  (:func:`tree_cpu`), which misses such orphans. A session fixture's start-up
  counts to the first test that asks for it.
- ``jvms``: the JVMs the test started, by main class (``SparkSubmit:2
  CoarseGrainedExecutorBackend:4``: an application or Spark Connect server, an
  executor; ``Master``, ``Worker``: standalone daemons). A thread looks at the
  test process's cgroup (or process tree) every ``SAMPLE_S`` seconds and names
  each new ``java`` by its main class; a JVM lives seconds, Spark's launcher
  (``launcher.Main``, under a second) is not counted. (Spark's own hook,
  ``spark-env.sh``, would need a ``SPARK_CONF_DIR``, which Spark puts on the class
  path, where a non-empty folder turns the JVM archive off.)
"""

from __future__ import annotations

import contextlib
import os
import re
import resource
import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

PROPERTY = "cpu_s"
JVMS = "jvms"
SAMPLE_S = 0.5
_TICK = os.sysconf("SC_CLK_TCK")
_START = pytest.StashKey[tuple[float, Counter[str]]]()


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
    try:
        tree = _descendants(root)
    except OSError:
        return total
    ticks = 0
    for pid in tree:
        fields = _stat(str(pid))
        if fields is not None:  # utime, stime, cutime, cstime: stat 14-17, [11:15] here
            ticks += sum(int(v) for v in fields[11:15])
    return total + ticks / _TICK


class CgroupMeter:
    """A cgroup of this process's own: the CPU of everything started in it since.

    ``root`` is a cgroup v1 ``cpuacct`` mount (``cpuacct.usage``, ns) or a
    cgroup v2 one (``cpu.stat``'s ``usage_usec``). :meth:`close` moves this
    process and whatever is still in the group back where this process came
    from, and removes the group.
    """

    def __init__(self, root: Path, name: str) -> None:
        self.v2 = not (root / "cpuacct.usage").exists()
        own = _own_cgroup(v2=self.v2)
        self.home = root / own.lstrip("/")
        self.path = self.home / name  # nested: a run inside a test counts to that test too
        self.path.mkdir()
        try:
            (self.path / "cgroup.procs").write_text(str(os.getpid()))
        except OSError:
            self.path.rmdir()
            raise

    def cpu(self) -> float:
        if self.v2:
            for line in (self.path / "cpu.stat").read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "usage_usec":
                    return int(value) / 1e6
            raise OSError(f"no usage_usec in {self.path / 'cpu.stat'}")
        return int((self.path / "cpuacct.usage").read_text()) / 1e9

    def close(self) -> None:
        for pid in (self.path / "cgroup.procs").read_text().split():
            try:  # this process, and any process the run left (the leftover check's)
                (self.home / "cgroup.procs").write_text(pid)
            except OSError:
                pass  # exited meanwhile
        try:
            self.path.rmdir()
        except OSError:
            pass  # a process forked into it while it emptied; the kernel keeps it


def _own_cgroup(v2: bool) -> str:
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if (v2 and controllers == "") or (not v2 and "cpuacct" in controllers.split(",")):
            return path
    raise OSError("this process is in no such cgroup")


def open_meter(name: str) -> CgroupMeter | None:
    """A :class:`CgroupMeter` where this machine lets us make one, else None."""
    for root in (Path("/sys/fs/cgroup/cpuacct"), Path("/sys/fs/cgroup/unified")):
        if not (root / "cgroup.procs").exists() or not os.access(root, os.W_OK):
            continue
        try:
            return CgroupMeter(root, name)
        except OSError:
            continue
    return None


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (fields := _stat(entry)) is not None:
            children.setdefault(int(fields[1]), []).append(int(entry))
    found, todo = [], list(children.get(root, []))
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo += children.get(pid, [])
    return found


def main_class(argv: list[str]) -> str | None:
    """The main class's short name of a ``java`` command line, else None."""
    if not argv or not argv[0].endswith("java"):
        return None
    args = iter(argv[1:])
    for arg in args:
        if arg in ("-cp", "-classpath", "--class-path", "--module-path", "-p"):
            next(args, None)
        elif arg == "-jar":
            return Path(next(args, "?")).name
        elif not arg.startswith("-"):
            return arg.rsplit(".", 1)[-1] if re.fullmatch(r"[\w.$]+", arg) else None
    return None


class JvmWatch:
    """The JVMs started in this process's cgroup (else its process tree), by main class."""

    def __init__(self, meter: CgroupMeter | None) -> None:
        self.meter = meter
        self.started: Counter[str] = Counter()
        self._seen: set[int] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="jvm-watch", daemon=True)
        self._thread.start()

    def _pids(self) -> list[int]:
        if self.meter is not None:
            with contextlib.suppress(OSError):
                return [int(p) for p in (self.meter.path / "cgroup.procs").read_text().split()]
        return _descendants(os.getpid())

    def sample(self) -> Counter[str]:
        """Look once more; the JVMs started so far, by main class."""
        with self._lock:
            for pid in self._pids():
                if pid in self._seen:
                    continue
                try:
                    raw = Path(f"/proc/{pid}/cmdline").read_bytes()
                    fields = _stat(str(pid))
                    parent = Path(f"/proc/{fields[1]}/cmdline").read_bytes() if fields else b""
                except OSError:
                    continue
                if raw == parent:
                    continue  # a JVM's child between fork and exec shows the JVM's command
                argv = raw.split(b"\0")
                # Not marked seen until it is a java: `ip netns exec`, spark-class's
                # bash and the like exec the JVM in the same pid.
                cls = main_class([a.decode(errors="replace") for a in argv if a])
                if cls is None:
                    continue
                self._seen.add(pid)
                if not (cls == "Main" and any(b"launcher" in a for a in argv)):
                    self.started[cls] += 1  # Spark's launcher JVM, under a second, is not
            return Counter(self.started)

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            self.sample()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


_METER = pytest.StashKey["CgroupMeter | None"]()
_WATCH = pytest.StashKey[JvmWatch]()


def _cpu(config: pytest.Config) -> float:
    meter = config.stash.get(_METER, None)
    return meter.cpu() if meter is not None else tree_cpu()


def pytest_configure(config: pytest.Config) -> None:
    meter = open_meter(f"spark-dilation-tests-{os.getpid()}")
    config.stash[_METER] = meter
    config.stash[_WATCH] = JvmWatch(meter)


def pytest_unconfigure(config: pytest.Config) -> None:
    if _WATCH in config.stash:
        config.stash[_WATCH].close()
    meter = config.stash.get(_METER, None)
    if meter is not None:
        meter.close()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    item.stash[_START] = (_cpu(item.config), item.config.stash[_WATCH].sample())


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    # The teardown report carries the properties the JUnit writer reads.
    if call.when == "teardown" and _START in item.stash:
        cpu, before = item.stash[_START]
        item.user_properties.append((PROPERTY, f"{_cpu(item.config) - cpu:.2f}"))
        new = item.config.stash[_WATCH].sample() - before
        if new:
            item.user_properties.append(
                (JVMS, " ".join(f"{c}:{n}" for c, n in sorted(new.items())))
            )
    yield
