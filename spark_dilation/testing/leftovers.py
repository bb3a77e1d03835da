"""A pytest plugin that fails the run if the suite left anything behind.

Enable it with ``pytest_plugins = ["spark_dilation.testing.leftovers"]`` (or
``-p spark_dilation.testing.leftovers``). It sees only the run's own things, so
another job on the machine (a second suite, a notebook, a build) never fails
it, while anything the suite leaves still does:

- **processes** carrying this run's mark: the plugin puts ``RUN_MARK=<id>`` in
  the environment before anything starts, so every process the suite starts
  (xdist workers, Spark JVMs, servers, CLI runs, daemons that re-parented to
  init) inherits it; those still alive after ``PROCESS_GRACE`` seconds are
  reported and then killed, so a failing run does not leave them either;
- **files** in the run's private temp folder: ``TMPDIR`` (Python, our helpers
  and servers), ``SPARK_LOCAL_DIRS`` (Spark's ``spark-*`` and ``blockmgr-*``
  folders) and the JVM's ``java.io.tmpdir`` (``SPARK_SUBMIT_OPTS``) all point
  at a folder inside pytest's base temp, empty when the run starts; any file
  in it at the end is left behind (empty folders hold nothing);
- **network namespaces**, their **mounts** and the namespace machines' run
  folders in ``/tmp`` named with the run's prefix (``RUN_PREFIX_ENV``, which
  ``netcluster`` puts first in every name it makes).

With pytest-xdist the check runs in the controller only, after every worker has
exited. It only reports; it removes nothing but the marked processes.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import pytest

RUN_MARK = "SPARK_DILATION_TEST_RUN"
# The run's prefix for namespaces, links and their /tmp run folders: "sd" and three
# hex digits of the mark (netcluster adds one of its own, for an interface
# name's 15 characters).
RUN_PREFIX_ENV = "SPARK_DILATION_TEST_PREFIX"
PROCESS_GRACE = 15.0  # s for the run's processes to finish exiting before they count
SYSTEM_TMP = Path("/tmp")
NETNS_MOUNTS = "/run/netns/"
NETCLUSTER_RUN_DIR = "sdnc-"  # netcluster.RUN_DIR_PREFIX, in /tmp (short socket paths)
IGNORED_NAMES = ("hsperfdata_",)  # the JVM's perf data, which every JVM shares


@dataclass(frozen=True)
class Scope:
    """The run's own things: its private temp folder and its name prefix."""

    private_tmp: Path
    prefix: str

    def files(self) -> list[str]:
        """Files under the private temp folder (and what cannot be read there)."""
        found: list[str] = []

        def unreadable(error: OSError) -> None:
            found.append(f"{error.filename} (unreadable: {error.strerror})")

        for root, dirs, names in os.walk(self.private_tmp, onerror=unreadable):
            dirs[:] = [d for d in dirs if not d.startswith(IGNORED_NAMES)]
            found += [os.path.join(root, n) for n in names if not n.startswith(IGNORED_NAMES)]
        run_dirs = SYSTEM_TMP.glob(f"{NETCLUSTER_RUN_DIR}{self.prefix[2:]}*")
        return sorted(found) + sorted(str(p) for p in run_dirs)

    def namespaces(self) -> list[str]:
        return sorted(n for n in namespaces() if n.startswith(self.prefix))

    def mounts(self) -> list[str]:
        own = (NETNS_MOUNTS + self.prefix, str(self.private_tmp) + os.sep)
        return sorted(m for m in mounts() if m.startswith(own))


@dataclass
class Leftovers:
    processes: dict[int, str] = field(default_factory=dict)  # pid -> command line
    namespaces: list[str] = field(default_factory=list)
    mounts: list[str] = field(default_factory=list)
    files: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        out: list[str] = []
        for kind, items in (
            ("process", [f"{pid} {cmd}" for pid, cmd in sorted(self.processes.items())]),
            ("network namespace", self.namespaces),
            ("mount", self.mounts),
            ("file", self.files),
        ):
            out += [f"left behind: {kind} {item}" for item in items]
        return out


def namespaces() -> frozenset[str]:
    try:
        out = subprocess.run(
            ["ip", "netns", "list"], capture_output=True, text=True, timeout=30, check=False
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return frozenset()
    return frozenset(line.split()[0] for line in out.splitlines() if line.strip())


def mounts() -> frozenset[str]:
    try:
        text = Path("/proc/self/mountinfo").read_text()
    except OSError:
        return frozenset()
    # Field 5 is the mount point (``man proc``, /proc/pid/mountinfo).
    return frozenset(line.split()[4] for line in text.splitlines() if len(line.split()) > 4)


def marked_processes(mark: str) -> dict[int, str]:
    """Live processes whose environment carries ``RUN_MARK=mark``: pid -> command line."""
    needle = f"{RUN_MARK}={mark}".encode()
    found: dict[int, str] = {}
    me = os.getpid()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            if needle not in (entry / "environ").read_bytes().split(b"\0"):
                continue
            status = (entry / "stat").read_text()
            if status.rsplit(")", 1)[1].split()[0] == "Z":
                continue  # exited, waiting for its parent to reap it
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        found[int(entry.name)] = cmd.strip()[:200]
    return found


def helper_processes(marker: str) -> list[int]:
    """Our helper processes (lane, reader and sender hosts: ``python -m
    spark_dilation.transfer.*``) whose command line names ``marker`` (a folder)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "spark_dilation.transfer." in cmd and marker in cmd:
            found.append(int(entry.name))
    return found


def find(scope: Scope, mark: str, grace: float = PROCESS_GRACE) -> Leftovers:
    """The run's things still there; waits up to ``grace`` s for its processes to exit."""
    deadline = time.monotonic() + grace
    procs = marked_processes(mark)
    while procs and time.monotonic() < deadline:
        time.sleep(0.2)
        procs = marked_processes(mark)
    return Leftovers(
        processes=procs,
        namespaces=scope.namespaces(),
        mounts=scope.mounts(),
        files=scope.files(),
    )


def own_temp(folder: Path) -> dict[str, str]:
    """The environment for a process a test may kill (``SIGKILL`` skips every clean-up):
    its temp files (Python's, Spark's local folders, the JVM's) go to ``folder``, the
    test's own (pytest keeps it), not the run's private temp folder this check reads."""
    opts = os.environ.get("SPARK_SUBMIT_OPTS", "").split()
    opts = [o for o in opts if not o.startswith("-Djava.io.tmpdir=")]
    return {
        "TMPDIR": str(folder),
        "SPARK_LOCAL_DIRS": str(folder),
        "SPARK_SUBMIT_OPTS": " ".join([*opts, f"-Djava.io.tmpdir={folder}"]),
    }


def kill(pids: dict[int, str]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def _is_worker(config: pytest.Config) -> bool:
    return hasattr(config, "workerinput")


@pytest.hookimpl(trylast=True)  # after tmpdir's, which makes the base temp
def pytest_configure(config: pytest.Config) -> None:
    if _is_worker(config):
        return  # the controller set everything up; its environment is inherited
    mark = uuid.uuid4().hex[:12]
    os.environ[RUN_MARK] = mark
    prefix = os.environ.setdefault(RUN_PREFIX_ENV, "sd" + mark[:3])
    scratch = config._tmp_path_factory.getbasetemp() / "tmp"  # type: ignore[attr-defined]
    shutil.rmtree(scratch, ignore_errors=True)  # a --basetemp given again: start empty
    scratch.mkdir()
    os.environ["TMPDIR"] = str(scratch)
    os.environ["SPARK_LOCAL_DIRS"] = str(scratch)
    opts = os.environ.get("SPARK_SUBMIT_OPTS", "")
    os.environ["SPARK_SUBMIT_OPTS"] = f"{opts} -Djava.io.tmpdir={scratch}".strip()
    tempfile.tempdir = None  # forget the cached /tmp
    config.stash[_SCOPE] = Scope(scratch, prefix)


_SCOPE = pytest.StashKey[Scope]()


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    config = session.config
    if _is_worker(config) or _SCOPE not in config.stash:
        return
    found = find(config.stash[_SCOPE], os.environ[RUN_MARK])
    lines = found.lines()
    if not lines:
        return
    kill(found.processes)
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.ensure_newline()
    for line in lines:
        if reporter is not None:
            reporter.write_line(line, red=True, bold=True)
        else:
            print(line)
    if reporter is not None:
        reporter.write_line(
            f"the run left {len(lines)} thing(s) behind (spark_dilation.testing.leftovers); "
            "the processes were killed, the rest is still there",
            red=True,
        )
    session.exitstatus = pytest.ExitCode.TESTS_FAILED
