"""Two Spark standalone clusters whose every machine is its own network namespace.

Multi-machine tests need what a single ``local[2]`` session cannot give:
executors on machines with their own address, temp directory and processes,
machines that can be lost, and two clusters that may or may not reach each
other directly. :func:`start_net_clusters` builds that on one Linux host with
iproute2 alone (root, ``ip netns``, veth, bridge; no Docker, no iptables)::

    root namespace (the test process)
      lo: 10.77.0.1/32          "services": mailbox server + transit relay
      sd<id>-bra 10.77.1.254/24 ---- a0 10.77.1.1  Master + the test's driver
                                 |-- a1 10.77.1.2  Worker (1 core, 1g)
                                 `-- a2 10.77.1.3  Worker
      sd<id>-brb 10.77.2.254/24 ---- b0 10.77.2.1, b1 10.77.2.2, b2 10.77.2.3

(The third octets move up by 3 per concurrent run: see :class:`NetClusters`.)
No namespace has a default route, as on a locked-down cluster: each reaches its
own subnet and the services address. :meth:`NetClusters.relay_only` (the
default) keeps cluster A and cluster B apart, so peers must meet through the
relay; :meth:`NetClusters.direct` adds a route to the other cluster's subnet
through the root namespace (``net.ipv4.ip_forward`` is on while the clusters
live). Both can be switched on live clusters.

Every machine has a directory ``/tmp/sdnc-<id>/<machine>/`` with ``tmp/``,
``local/`` and ``work/``, and :attr:`Machine.env` for its processes:
``TMPDIR``, ``SPARK_LOCAL_DIRS``, ``SPARK_WORKER_DIR``, ``SPARK_LOCAL_IP`` and
``SPARK_LOCAL_HOSTNAME`` (the namespaces share one hostname, so Spark must not
resolve it), ``SPARK_DILATION_MACHINE`` (``"a1"``: which machine ran what),
``PYSPARK_PYTHON`` (this interpreter), ``JAVA_TOOL_OPTIONS``: this process's
(the test run's start-up flags) and ``-Djava.io.tmpdir`` (the JVMs' temp files,
executors included, stay on their machine),
``SPARK_DILATION_MAILBOX``/``SPARK_DILATION_RELAY`` (the services).
Executors and their Python workers inherit the Worker's environment, so a
task sees its own machine's values; ``tests/test_netcluster.py`` checks it.

A Spark application's driver runs on the cluster's machine 0 with
:meth:`NetClusters.run_driver`, which sets ``PYSPARK_SUBMIT_ARGS`` to what a
driver there needs (see :meth:`Cluster.spark_conf`), so a plain
``SparkSession.builder.getOrCreate()`` works; ``.config(...)`` overrides it.
The conf: ``spark.master`` (``spark://10.77.1.1:7077``), ``spark.driver.host``
and ``spark.driver.bindAddress`` (the machine's address: the executors connect
back to it), ``spark.driver.memory=512m``, ``spark.executor.cores=1`` and
``spark.executor.memory=512m`` (a Worker offers 1 core and 1g),
``spark.cores.max`` = the number of workers and
``spark.scheduler.minRegisteredResourcesRatio=1.0`` (the first job waits until
every worker has its executor, up to 30 s, instead of running all tasks on the
first one), ``spark.ui.enabled=false``. Two applications at once on one
cluster need a smaller ``spark.cores.max`` each.

A session-scoped fixture (one start, about 20 s, for every test that uses it)::

    @pytest.fixture(scope="session")
    def net_clusters(tmp_path_factory):
        ok, reason = netns_available()
        if not ok:
            pytest.fail(reason)  # fail, not skip: these tests must not vanish
        nc = start_net_clusters(tmp_path_factory.mktemp("netcluster-logs"))
        yield nc
        nc.close()

A test that changes the clusters (``direct()``, a lost worker) should put them
back, or later tests see the change.

Everything is logged under the ``log_dir`` given: ``netcluster.log`` (every
``ip`` command and event), one file per daemon (``a0-master.log``,
``a1-worker.log``), ``servers.log``, whatever :meth:`Machine.popen` is told,
and at :meth:`NetClusters.close` the executors' ``stdout``/``stderr`` from the
work directories (``executors/<machine>/<app>/<executor>/``). ``close()``
(also run at exit) kills every process in the namespaces, deletes the
namespaces, veths, bridges, the services address and the run directory,
restores ``ip_forward``, and raises if anything is left (only the shared lock
file ``/run/lock/spark-dilation-netcluster.lock`` stays, where lock files
belong, so nothing is left in ``/tmp``). Runs killed before
they could clean up are removed by the next :func:`start_net_clusters`, or by
``python -m spark_dilation.testing.netcluster cleanup``.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import json
import os
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import spark_dilation
from spark_dilation.testing._servers import (
    ServerProcess,
    read_ready_line,
    server_command,
    wait_until_accepting,
)
from spark_dilation.transfer.machine import atomic_write

__all__ = [
    "Cluster",
    "Machine",
    "NetClusters",
    "cleanup_stale",
    "netns_available",
    "start_net_clusters",
]

RUN_PARENT = Path("/tmp")
RUN_DIR_PREFIX = "sdnc-"
# Shared by every run on the machine; /run/lock is where lock files live (the
# leftover check of the test suite watches /tmp).
LOCK_PATH = (
    Path("/run/lock/spark-dilation-netcluster.lock")
    if Path("/run/lock").is_dir()
    else RUN_PARENT / "sdnc.lock"
)
MASTER_PORT = 7077
MASTER_UI_PORT = 8080
WORKER_UI_PORT = 8081
INNER_IFACE = "eth0"
DEFAULT_START_TIMEOUT = 180.0
IP_FORWARD = Path("/proc/sys/net/ipv4/ip_forward")
MAX_SLOTS = 80

# Spark and JVM variables of the test process must not leak into the machines
# (conftest.py sets PYSPARK_PYTHON and SPARK_LOCAL_IP for its local session).
# SPARK_DILATION_* go too: a test passes what it wants with env_extra.
_DROPPED_ENV_PREFIXES = ("SPARK_", "PYSPARK_")
_DROPPED_ENV = {"JAVA_TOOL_OPTIONS", "_JAVA_OPTIONS", "JDK_JAVA_OPTIONS", "TMPDIR", "TMP", "TEMP"}


# --------------------------------------------------------------------------- helpers


class _RunLog:
    """Append-only ``netcluster.log``: commands and events with timestamps."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._t0 = time.monotonic()

    def __call__(self, msg: str) -> None:
        line = f"{time.strftime('%H:%M:%S')} +{time.monotonic() - self._t0:7.2f}s {msg}\n"
        with self._lock, self.path.open("a") as f:
            f.write(line)


def _run(argv: Sequence[str], log: _RunLog | None, check: bool = True) -> str:
    """Run a short command (``ip ...``); log it; raise with its stderr if ``check``."""
    proc = subprocess.run(list(argv), capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if log is not None:
        tail = f" -> {proc.returncode} {proc.stderr.strip()}" if proc.returncode else ""
        log("$ " + shlex.join(argv) + tail)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{shlex.join(argv)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc.stdout


def _netns_list() -> list[str]:
    out = _run(["ip", "netns", "list"], None, check=False)
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _links() -> list[str]:
    out = _run(["ip", "-o", "link", "show"], None, check=False)
    names = []
    for line in out.splitlines():
        parts = line.split(":", 2)
        if len(parts) >= 2:
            names.append(parts[1].strip().split("@", 1)[0])
    return names


def _netns_pids(ns: str) -> list[int]:
    out = _run(["ip", "netns", "pids", ns], None, check=False)
    return [int(p) for p in out.split() if p.isdigit()]


def _proc_start_time(pid: int) -> str | None:
    """Field 22 of /proc/PID/stat: tells a pid from a later process that reuses it."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def _owner_alive(info: Mapping[str, Any]) -> bool:
    pid = int(info.get("pid", 0))
    return pid > 0 and _proc_start_time(pid) == info.get("pid_start")


def _descendants(pid: int) -> list[int]:
    """``pid`` and every process below it (by parent pid), parents first."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def _kill_pids(pids: Sequence[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def _kill_namespace_processes(ns: str, timeout: float = 10.0) -> list[int]:
    """SIGKILL everything in ``ns`` until it is empty; returns the pids left."""
    deadline = time.monotonic() + timeout
    while True:
        pids = _netns_pids(ns)
        if not pids or time.monotonic() > deadline:
            return pids
        _kill_pids(pids)
        time.sleep(0.05)


def _http_json(url: str, timeout: float = 2.0) -> Any:
    # No proxy: the machines are only reachable directly.
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(url, timeout=timeout) as resp:
        return json.loads(resp.read())


def _tail(path: Path, lines: int = 30) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return f"(cannot read {path})"
    return "\n".join(text.splitlines()[-lines:])


def _spark_home() -> Path:
    import pyspark

    return Path(pyspark.__file__).resolve().parent


def _source_root() -> str:
    return str(Path(spark_dilation.__file__).resolve().parent.parent)


_AVAILABLE: tuple[bool, str] | None = None


def _run_prefix() -> str:
    """The test run's name prefix (its leftover check looks for it), else ``sd``: every
    namespace, link and run folder starts with it. Names are 6 characters in all."""
    from spark_dilation.testing.leftovers import RUN_PREFIX_ENV

    prefix = os.environ.get(RUN_PREFIX_ENV, "sd")
    return prefix if len(prefix) < 6 else "sd"


def netns_available() -> tuple[bool, str]:
    """Whether this host can run :func:`start_net_clusters`, and why not.

    Tries what the clusters need (root, iproute2, a namespace, a veth, a
    bridge, java, pyspark's ``spark-class``) so a test can fail with the reason
    rather than with a half-built topology. Cached.
    """
    global _AVAILABLE
    if _AVAILABLE is not None:
        return _AVAILABLE
    _AVAILABLE = _probe()
    return _AVAILABLE


def _probe() -> tuple[bool, str]:
    if not sys.platform.startswith("linux"):
        return False, f"network namespaces need Linux (this is {sys.platform})"
    if os.geteuid() != 0:
        return False, "network namespaces need root (euid is not 0)"
    if shutil.which("ip") is None:
        return False, "iproute2's `ip` is not installed"
    if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
        return False, "java is not installed (Spark's daemons need it)"
    try:
        spark_class = _spark_home() / "bin" / "spark-class"
    except ImportError as e:
        return False, f"pyspark is not importable: {e}"
    if not spark_class.exists():
        return False, f"{spark_class} does not exist"
    probe = f"{_run_prefix()}probe{secrets.token_hex(1)}"
    try:
        _run(["ip", "netns", "add", probe], None)
        try:
            _run(["ip", "link", "add", probe, "type", "bridge"], None)
            _run(["ip", "link", "del", probe], None)
            _run(
                ["ip", "link", "add", probe, "type", "veth", "peer", "name", "p", "netns", probe],
                None,
            )
            _run(["ip", "link", "del", probe], None)
            _run(["ip", "netns", "exec", probe, "ip", "link", "set", "lo", "up"], None)
        finally:
            _run(["ip", "link", "del", probe], None, check=False)
            _run(["ip", "netns", "del", probe], None, check=False)
    except (RuntimeError, OSError) as e:
        return False, f"cannot build a namespace with a veth and a bridge: {e}"
    return True, ""


# --------------------------------------------------------------------------- registry


@contextlib.contextmanager
def _registry_lock() -> Iterator[None]:
    """Serialises setup and teardown of concurrent runs (e.g. pytest-xdist)."""
    with LOCK_PATH.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _runs() -> list[tuple[Path, dict[str, Any]]]:
    out = []
    for d in sorted(RUN_PARENT.glob(RUN_DIR_PREFIX + "*")):
        try:
            out.append((d, json.loads((d / "run.json").read_text())))
        except (OSError, ValueError):
            continue
    return out


def _remove_run_resources(info: Mapping[str, Any], log: _RunLog | None) -> None:
    """Kill the processes and delete the namespaces and links named with a run's prefix."""
    prefix = info["prefix"] + "-"
    for ns in _netns_list():
        if ns.startswith(prefix):
            _kill_namespace_processes(ns)
            _run(["ip", "netns", "del", ns], log, check=False)
    for link in _links():
        if link.startswith(prefix):
            _run(["ip", "link", "del", link], log, check=False)
    servers = info.get("servers")
    if servers and _owner_alive(servers):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(int(servers["pid"]), signal.SIGKILL)
    services = info.get("services_ip")
    if services:
        out = _run(["ip", "-4", "-o", "addr", "show", "dev", "lo"], None, check=False)
        if f" {services}/32 " in out:
            _run(["ip", "addr", "del", f"{services}/32", "dev", "lo"], log, check=False)


def _restore_ip_forward(value: str | None, log: _RunLog | None) -> None:
    """Restore ``ip_forward`` if no live run still needs it on."""
    if value is None or any(_owner_alive(info) for _, info in _runs()):
        return
    with contextlib.suppress(OSError):
        IP_FORWARD.write_text(value)
        if log is not None:
            log(f"ip_forward restored to {value}")


def cleanup_stale() -> list[str]:
    """Remove what runs whose process has died left behind; returns their prefixes.

    A run killed with SIGKILL (or a crashed interpreter) cannot clean up; its
    ``/tmp/sdnc-<id>/run.json`` names its resources.
    """
    removed = []
    with _registry_lock():
        dead = [(d, info) for d, info in _runs() if not _owner_alive(info)]
        forward = None
        for d, info in dead:
            _remove_run_resources(info, None)
            forward = forward or info.get("ip_forward_orig")
            shutil.rmtree(d, ignore_errors=True)
            removed.append(str(info["prefix"]))
        if dead:
            _restore_ip_forward(forward, None)
    return removed


# --------------------------------------------------------------------------- machines


@dataclass(eq=False)
class Machine:
    """One machine: a network namespace with an address, a directory and an environment."""

    name: str
    """``"a0"`` (cluster A's driver machine), ``"a1"``, ... (also ``SPARK_DILATION_MACHINE``)."""
    ns: str
    """The namespace, and the name of its veth in the root namespace."""
    ip: str
    dir: Path
    env: dict[str, str]
    """The environment of every process started on this machine."""
    log_dir: Path = field(repr=False)
    _log: _RunLog = field(repr=False)
    _procs: list[subprocess.Popen[bytes]] = field(default_factory=list, repr=False)

    @property
    def tmp(self) -> Path:
        """This machine's ``TMPDIR``."""
        return self.dir / "tmp"

    def popen(
        self,
        argv: Sequence[str],
        log_path: Path | str,
        env_extra: Mapping[str, str] | None = None,
        cwd: Path | str | None = None,
    ) -> subprocess.Popen[bytes]:
        """Start ``argv`` inside the namespace; stdout and stderr appended to ``log_path``.

        A relative ``log_path`` is under the run's log directory. The process
        gets a session of its own (no terminal signals) and is killed by
        :meth:`kill_all` and at close.
        """
        path = Path(log_path)
        if not path.is_absolute():
            path = self.log_dir / path
        env = dict(self.env)
        env.update(env_extra or {})
        with path.open("ab") as out:
            out.write(
                f"--- {time.strftime('%H:%M:%S')} on {self.name}: {shlex.join(argv)}\n".encode()
            )
            out.flush()
            proc = subprocess.Popen(
                ["ip", "netns", "exec", self.ns, *argv],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=str(cwd or self.dir),
                start_new_session=True,
            )
        self._procs.append(proc)
        self._log(f"{self.name}: pid {proc.pid} {shlex.join(argv)} > {path}")
        return proc

    def run(
        self, argv: Sequence[str], timeout: float = 30.0, env_extra: Mapping[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        """Run a short command inside the namespace and capture its output."""
        env = dict(self.env)
        env.update(env_extra or {})
        return subprocess.run(
            ["ip", "netns", "exec", self.ns, *argv],
            capture_output=True,
            text=True,
            env=env,
            cwd=str(self.dir),
            timeout=timeout,
            stdin=subprocess.DEVNULL,
        )

    def can_connect(self, host: str, port: int, timeout: float = 3.0) -> bool:
        """Whether a TCP connection from this machine to ``host:port`` succeeds."""
        code = (
            "import socket,sys\n"
            f"try: socket.create_connection(({host!r}, {port}), timeout={timeout}).close()\n"
            "except OSError as e: print(e); sys.exit(1)\n"
        )
        proc = self.run([sys.executable, "-c", code], timeout=timeout + 20)
        self._log(f"{self.name}: connect {host}:{port} -> {proc.returncode} {proc.stdout.strip()}")
        return proc.returncode == 0

    def pids(self) -> list[int]:
        """Every process in the namespace (``ip netns pids``)."""
        return _netns_pids(self.ns)

    def kill_all(self) -> None:
        """ "Machine lost": SIGKILL every process in the namespace.

        The kernel still closes their sockets (peers see a reset); use
        :meth:`disconnect` first for a machine that vanishes silently.
        """
        left = _kill_namespace_processes(self.ns)
        self._reap()
        self._log(f"{self.name}: killed every process" + (f" (left: {left})" if left else ""))

    def disconnect(self) -> None:
        """Take the machine's link down: packets to and from it are dropped."""
        _run(["ip", "link", "set", self.ns, "down"], self._log)

    def reconnect(self) -> None:
        """Undo :meth:`disconnect`."""
        _run(["ip", "link", "set", self.ns, "up"], self._log)

    def _reap(self, timeout: float = 5.0) -> None:
        for proc in self._procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout)
        self._procs = [p for p in self._procs if p.poll() is None]


class Cluster:
    """A standalone cluster: the Master on machine 0, one Worker per worker machine."""

    def __init__(self, owner: NetClusters, name: str, subnet_prefix: str) -> None:
        self._owner = owner
        self.name = name
        """``"a"`` or ``"b"``."""
        self.subnet_prefix = subnet_prefix
        """``"10.77.1"``: machine ``i`` is ``10.77.1.(i+1)``."""
        self.subnet = f"{subnet_prefix}.0/24"
        self.gateway = f"{subnet_prefix}.254"
        """The bridge's address in the root namespace."""
        self.bridge = f"{owner.prefix}-br{name}"
        self.driver: Machine = owner._new_machine(self, 0)
        """Machine 0: runs the Master and the test's Spark driver."""
        self.workers: list[Machine] = []
        """Every worker machine ever started, killed ones and replacements included."""
        self.master_url = f"spark://{self.driver.ip}:{MASTER_PORT}"
        self.master_ui_url = f"http://{self.driver.ip}:{MASTER_UI_PORT}"
        self._master: subprocess.Popen[bytes] | None = None
        self._worker_jvms: dict[str, subprocess.Popen[bytes]] = {}

    @property
    def machines(self) -> list[Machine]:
        return [self.driver, *self.workers]

    def spark_conf(self) -> dict[str, str]:
        """What a driver on :attr:`driver` needs (see the module docstring)."""
        return {
            "spark.master": self.master_url,
            "spark.driver.host": self.driver.ip,
            "spark.driver.bindAddress": self.driver.ip,
            "spark.driver.memory": "512m",
            "spark.executor.cores": "1",
            "spark.executor.memory": "512m",
            "spark.cores.max": str(max(1, len(self.alive_workers()))),
            "spark.scheduler.minRegisteredResourcesRatio": "1.0",
            "spark.ui.enabled": "false",
            "spark.ui.showConsoleProgress": "false",
        }

    def master_state(self) -> dict[str, Any]:
        """The Master web UI's ``/json/``: workers, applications, ..."""
        return _http_json(self.master_ui_url + "/json/")

    def alive_workers(self) -> list[str]:
        """Hosts of the workers the Master lists ALIVE."""
        try:
            workers = self.master_state().get("workers", [])
        except (OSError, ValueError):  # the UI may answer HTML while it starts
            return []
        return [w["host"] for w in workers if w.get("state") == "ALIVE"]

    def wait_for_workers(
        self, machines: Sequence[Machine], timeout: float = DEFAULT_START_TIMEOUT
    ) -> None:
        """Wait until the Master lists a Worker ALIVE on each machine."""
        deadline = time.monotonic() + timeout
        want = {m.ip for m in machines}
        while True:
            alive = set(self.alive_workers())
            if want <= alive:
                self._owner._log(f"{self.name}: workers ALIVE on {sorted(want)}")
                return
            if time.monotonic() > deadline:
                missing = [m for m in machines if m.ip not in alive]
                logs = self._owner.log_dir
                worker_logs = ", ".join(str(logs / f"{m.name}-worker.log") for m in missing)
                raise RuntimeError(
                    f"cluster {self.name}: no ALIVE worker on {[m.name for m in missing]} after "
                    f"{timeout:g} s (master log {logs / (self.driver.name + '-master.log')}"
                    f", worker logs {worker_logs}); last lines of the first:\n"
                    + _tail(logs / f"{missing[0].name}-worker.log")
                )
            for m in machines:
                proc = self._worker_jvms.get(m.name)
                if proc is not None and proc.poll() is not None and m.ip not in alive:
                    log = self._owner.log_dir / f"{m.name}-worker.log"
                    raise RuntimeError(
                        f"the Worker on {m.name} exited with {proc.returncode}; see {log}:\n"
                        + _tail(log)
                    )
            time.sleep(0.25)

    def start_worker(
        self, machine: Machine, wait: bool = True, timeout: float = DEFAULT_START_TIMEOUT
    ) -> subprocess.Popen[bytes]:
        """Start a Worker JVM on ``machine`` (again, after a kill); waits until ALIVE."""
        work = machine.dir / "work"
        proc = machine.popen(
            [
                str(self._owner.spark_home / "bin" / "spark-class"),
                "org.apache.spark.deploy.worker.Worker",
                "--host",
                machine.ip,
                "--cores",
                "1",
                "--memory",
                "1g",
                "--webui-port",
                str(WORKER_UI_PORT),
                "--work-dir",
                str(work),
                self.master_url,
            ],
            f"{machine.name}-worker.log",
        )
        self._worker_jvms[machine.name] = proc
        if wait:
            self.wait_for_workers([machine], timeout)
        return proc

    def kill_worker(self, machine: Machine) -> None:
        """ "Machine lost": SIGKILL every process on the worker machine."""
        machine.kill_all()
        self._worker_jvms.pop(machine.name, None)

    def kill_worker_jvm(self, machine: Machine) -> None:
        """SIGKILL the Worker JVM and what it started (executors and their Python
        workers), not the machine's other processes."""
        proc = self._worker_jvms.pop(machine.name, None)
        if proc is None or proc.poll() is not None:
            raise RuntimeError(f"no Worker is running on {machine.name}")
        # `ip netns exec` and spark-class exec, so the Popen's pid is the JVM.
        pids = _descendants(proc.pid)
        _kill_pids(pids)
        proc.wait(10)
        self._owner._log(f"{machine.name}: killed the Worker JVM and its children {pids}")

    def add_worker(self, wait: bool = True, timeout: float = DEFAULT_START_TIMEOUT) -> Machine:
        """A new worker on a NEW machine (namespace, address), e.g. to replace a lost one."""
        machine = self._owner._new_machine(self, len(self.machines))
        self.workers.append(machine)
        self.start_worker(machine, wait=wait, timeout=timeout)
        return machine

    def _start_master(self) -> None:
        self._master = self.driver.popen(
            [
                str(self._owner.spark_home / "bin" / "spark-class"),
                "org.apache.spark.deploy.master.Master",
                "--host",
                self.driver.ip,
                "--port",
                str(MASTER_PORT),
                "--webui-port",
                str(MASTER_UI_PORT),
            ],
            f"{self.driver.name}-master.log",
        )

    def _wait_for_master(self, deadline: float) -> None:
        log = self._owner.log_dir / f"{self.driver.name}-master.log"
        while True:
            try:
                self.master_state()
                return
            except (OSError, ValueError):  # not listening yet, or its UI not yet serving JSON
                pass
            assert self._master is not None
            if self._master.poll() is not None:
                raise RuntimeError(
                    f"the Master of cluster {self.name} exited with {self._master.returncode}; "
                    f"see {log}:\n{_tail(log)}"
                )
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"the Master of cluster {self.name} did not answer on {self.master_ui_url} "
                    f"in time; see {log}:\n{_tail(log)}"
                )
            time.sleep(0.25)


class NetClusters:
    """Clusters A and B, the services address, and the run's resources.

    Use :func:`start_net_clusters`. Run ``slot`` k uses 10.77.3k.1 for the
    services and 10.77.(3k+1).0/24, 10.77.(3k+2).0/24 for A and B, so runs in
    parallel (pytest-xdist) do not collide; the first run gets the addresses in
    the module docstring.
    """

    def __init__(self, log_dir: Path, slot: int, prefix: str) -> None:
        self.log_dir = log_dir
        self.slot = slot
        self.prefix = prefix
        """``sd<4 hex>``: every namespace, veth and bridge of the run starts with it."""
        self.run_dir = RUN_PARENT / f"{RUN_DIR_PREFIX}{prefix[2:]}"
        self.services_ip = f"10.77.{3 * slot}.1"
        self.spark_home = _spark_home()
        self.servers: ServerProcess | None = None
        """The mailbox server and transit relay on :attr:`services_ip` (root namespace)."""
        self.mode = "relay_only"
        self._log = _RunLog(log_dir / "netcluster.log")
        self._closed = False
        self._ip_forward_orig: str | None = None
        self._info: dict[str, Any] = {}
        self.a: Cluster
        self.b: Cluster

    @property
    def clusters(self) -> list[Cluster]:
        return [self.a, self.b]

    @property
    def machines(self) -> list[Machine]:
        return [m for c in self.clusters for m in c.machines]

    @property
    def mailbox_url(self) -> str:
        """``ws://10.77.0.1:PORT/v1``."""
        assert self.servers is not None, "started without servers"
        return self.servers.mailbox_url

    @property
    def relay_url(self) -> str:
        """``tcp:10.77.0.1:PORT``."""
        assert self.servers is not None, "started without servers"
        return self.servers.relay_url

    def __enter__(self) -> NetClusters:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----------------------------------------------------------------- reachability

    def relay_only(self) -> None:
        """A and B cannot reach each other, only the services address (the default)."""
        self.mode = "relay_only"
        for cluster, other in ((self.a, self.b), (self.b, self.a)):
            for m in cluster.machines:
                _run(["ip", "-n", m.ns, "route", "del", other.subnet], self._log, check=False)

    def direct(self) -> None:
        """A and B reach each other through the root namespace's forwarding."""
        self.mode = "direct"
        for cluster in self.clusters:
            for m in cluster.machines:
                self._apply_mode(cluster, m)

    def _apply_mode(self, cluster: Cluster, machine: Machine) -> None:
        if self.mode == "direct":
            other = self.b if cluster is self.a else self.a
            _run(
                ["ip", "-n", machine.ns, "route", "replace", other.subnet, "via", cluster.gateway],
                self._log,
            )

    # ----------------------------------------------------------------- processes

    def run_driver(
        self,
        cluster: Cluster,
        argv: Sequence[str],
        log_path: Path | str,
        env_extra: Mapping[str, str] | None = None,
    ) -> subprocess.Popen[bytes]:
        """Start a Spark application's driver process (``argv``, e.g. ``[sys.executable,
        script]``) on the cluster's machine 0, with ``PYSPARK_SUBMIT_ARGS`` carrying
        :meth:`Cluster.spark_conf`."""
        conf = cluster.spark_conf()
        args = [
            "--master",
            conf.pop("spark.master"),
            "--driver-memory",
            conf.pop("spark.driver.memory"),
        ]
        for key, value in conf.items():
            args += ["--conf", f"{key}={value}"]
        env = {"PYSPARK_SUBMIT_ARGS": shlex.join([*args, "pyspark-shell"])}
        env.update(env_extra or {})
        return cluster.driver.popen(argv, log_path, env)

    def start_servers(self, mailbox_port: int = 0, relay_port: int = 0) -> ServerProcess:
        """Run the project's mailbox server and transit relay on :attr:`services_ip`.

        Started by :func:`start_net_clusters` (``servers=True``); call again with
        the old ports after :meth:`ServerProcess.kill` to bring "the same"
        servers back (the machines' ``SPARK_DILATION_MAILBOX``/``RELAY`` stay valid).
        """
        log_path = self.log_dir / "servers.log"
        cmd = server_command(
            interface=self.services_ip,
            mailbox_port=mailbox_port,
            relay_port=relay_port,
            motd=None,
            signal_error=None,
            allow_list=True,
            extra_args=(),
        )
        env = dict(os.environ)
        env["PYTHONPATH"] = _source_root() + (
            os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else ""
        )
        with log_path.open("ab") as err:
            proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=err,
                env=env,
                process_group=0,
            )
        self._log(f"servers: pid {proc.pid} {shlex.join(cmd)} 2> {log_path}")
        deadline = time.monotonic() + 30.0
        line = read_ready_line(proc, deadline)
        if line is None:
            proc.kill()
            proc.wait()
            raise RuntimeError(f"the servers did not start; see {log_path}:\n{_tail(log_path)}")
        servers = ServerProcess.from_ready(line, proc, log_path)
        self.servers = servers
        # A run killed before close() leaves the servers behind: the next run kills them.
        self._info["servers"] = {"pid": proc.pid, "pid_start": _proc_start_time(proc.pid)}
        self._save_info()
        for port in (servers.mailbox_port, servers.relay_port):
            if not wait_until_accepting(self.services_ip, port, deadline):
                raise RuntimeError(f"the servers do not accept on port {port}; see {log_path}")
        self._log(f"servers: mailbox {servers.mailbox_url} relay {servers.relay_url}")
        return servers

    # ----------------------------------------------------------------- building

    def _new_machine(self, cluster: Cluster, index: int) -> Machine:
        name = f"{cluster.name}{index}"
        ns = f"{self.prefix}-{name}"
        ip = f"{cluster.subnet_prefix}.{index + 1}"
        mdir = self.run_dir / name
        for sub in ("tmp", "local", "work"):
            (mdir / sub).mkdir(parents=True, exist_ok=True)
        log = self._log
        _run(["ip", "netns", "add", ns], log)
        _run(
            ["ip", "link", "add", ns, "type", "veth", "peer", "name", INNER_IFACE, "netns", ns], log
        )
        _run(["ip", "link", "set", ns, "master", cluster.bridge, "up"], log)
        _run(["ip", "-n", ns, "link", "set", "lo", "up"], log)
        _run(["ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", INNER_IFACE], log)
        _run(["ip", "-n", ns, "link", "set", INNER_IFACE, "up"], log)
        _run(
            ["ip", "-n", ns, "route", "add", f"{self.services_ip}/32", "via", cluster.gateway], log
        )
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(_DROPPED_ENV_PREFIXES) and k not in _DROPPED_ENV
        }
        existing_pp = env.get("PYTHONPATH")
        env.update(
            {
                "SPARK_HOME": str(self.spark_home),
                "SPARK_DAEMON_MEMORY": "256m",
                "SPARK_DAEMON_JAVA_OPTS": "-XX:+UseSerialGC",
                # A Worker lost without closing its connection is noticed in 15 s, not 60.
                "SPARK_MASTER_OPTS": "-Dspark.worker.timeout=15",
                # The run's JVM flags (tests/conftest.py: start-up CPU), then the machine's.
                "JAVA_TOOL_OPTIONS": f"{os.environ.get('JAVA_TOOL_OPTIONS', '')} "
                f"-Djava.io.tmpdir={mdir / 'tmp'} -Djava.net.preferIPv4Stack=true".strip(),
                "TMPDIR": str(mdir / "tmp"),
                "SPARK_LOCAL_DIRS": str(mdir / "local"),
                "SPARK_WORKER_DIR": str(mdir / "work"),
                "SPARK_LOCAL_IP": ip,
                "SPARK_LOCAL_HOSTNAME": ip,
                "PYSPARK_PYTHON": sys.executable,
                "PYSPARK_DRIVER_PYTHON": sys.executable,
                "PYTHONPATH": _source_root() + (os.pathsep + existing_pp if existing_pp else ""),
                "PYTHONUNBUFFERED": "1",
                "SPARK_DILATION_MACHINE": name,
            }
        )
        if self.servers is not None:
            env["SPARK_DILATION_MAILBOX"] = self.servers.mailbox_url
            env["SPARK_DILATION_RELAY"] = self.servers.relay_url
        machine = Machine(
            name=name, ns=ns, ip=ip, dir=mdir, env=env, log_dir=self.log_dir, _log=log
        )
        self._apply_mode(cluster, machine)
        return machine

    def _save_info(self) -> None:
        atomic_write(self.run_dir / "run.json", json.dumps(self._info))

    def _build(self, workers: int, servers: bool, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        log = self._log
        _run(["ip", "link", "set", "lo", "up"], log)
        _run(["ip", "addr", "add", f"{self.services_ip}/32", "dev", "lo"], log)
        for name, third in (("a", 3 * self.slot + 1), ("b", 3 * self.slot + 2)):
            bridge = f"{self.prefix}-br{name}"
            _run(["ip", "link", "add", bridge, "type", "bridge"], log)
            _run(["ip", "addr", "add", f"10.77.{third}.254/24", "dev", bridge], log)
            _run(["ip", "link", "set", bridge, "up"], log)
        if servers:
            self.start_servers()
        self.a = Cluster(self, "a", f"10.77.{3 * self.slot + 1}")
        self.b = Cluster(self, "b", f"10.77.{3 * self.slot + 2}")
        for c in self.clusters:
            for _ in range(workers):
                c.workers.append(self._new_machine(c, len(c.machines)))
        for c in self.clusters:
            c._start_master()
        # A Worker that finds no Master retries only after 5-15 s: wait for them.
        for c in self.clusters:
            c._wait_for_master(deadline)
        for c in self.clusters:
            for m in c.workers:
                c.start_worker(m, wait=False)
        for c in self.clusters:
            c.wait_for_workers(c.workers, max(1.0, deadline - time.monotonic()))

    # ----------------------------------------------------------------- teardown

    def leftovers(self) -> list[str]:
        """Whatever of this run still exists (empty after a clean :meth:`close`)."""
        left = [f"netns {ns}" for ns in _netns_list() if ns.startswith(self.prefix + "-")]
        left += [f"link {link}" for link in _links() if link.startswith(self.prefix + "-")]
        out = _run(["ip", "-4", "-o", "addr", "show", "dev", "lo"], None, check=False)
        if f" {self.services_ip}/32 " in out:
            left.append(f"address {self.services_ip} on lo")
        if self.run_dir.exists():
            left.append(f"directory {self.run_dir}")
        if self.servers is not None and self.servers.is_running():
            left.append(f"servers pid {self.servers.pid}")
        return left + [f"process {p}" for p in self._processes()]

    def _processes(self) -> list[str]:
        """Processes whose command line names the run folder or one of its namespaces."""
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            try:
                cmdline = (
                    (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                )
            except OSError:
                continue
            if str(self.run_dir) in cmdline or f"{self.prefix}-" in cmdline:
                found.append(f"{entry.name}: {cmdline[:200]}")
        return found

    def _built_clusters(self) -> list[Cluster]:
        """The clusters made so far (a failed start may have built only some)."""
        return [getattr(self, name) for name in ("a", "b") if hasattr(self, name)]

    def _built_machines(self) -> list[Machine]:
        return [m for c in self._built_clusters() for m in c.machines]

    def _collect_logs(self) -> None:
        """Keep the executors' output and the logs of helper processes that are still on
        disk (a host that exits removes its own; one that is left is what a failure needs)
        before the run directory goes."""
        for m in self._built_machines():
            found = [(m.dir / "work", "*/*/std*", "executors")]
            found.append((m.tmp / "spark-dilation", "**/*.log", "helpers"))
            for root, pattern, kind in found:
                if not root.is_dir():
                    continue
                for f in root.glob(pattern):
                    dest = self.log_dir / kind / m.name / f.relative_to(root)
                    dest.parent.mkdir(parents=True, exist_ok=True)
                    with contextlib.suppress(OSError):
                        shutil.copyfile(f, dest)

    def close(self) -> None:
        """Kill everything and delete everything the run made; raise if anything is left.

        Safe to call more than once (it also runs at interpreter exit).
        """
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        t0 = time.monotonic()
        errors: list[str] = []

        def attempt(what: str, fn: Any, *args: Any) -> None:
            try:
                fn(*args)
            except Exception as e:
                errors.append(f"{what}: {e!r}")
                self._log(f"close: {what} failed: {e!r}")

        self._log("close: start")
        if self.servers is not None:
            attempt("stop servers", self.servers.stop, 5.0)
        with _registry_lock():
            # Workers before Masters: no "connection to master failed" noise in their logs.
            clusters = self._built_clusters()
            namespaces = [m.ns for c in clusters for m in c.workers] + [
                c.driver.ns for c in clusters
            ]
            namespaces += [ns for ns in _netns_list() if ns.startswith(self.prefix + "-")]
            for ns in dict.fromkeys(namespaces):
                if ns in _netns_list():
                    left = _kill_namespace_processes(ns)
                    if left:
                        errors.append(f"processes {left} in {ns} survived SIGKILL")
            for m in self._built_machines():
                attempt(f"reap {m.name}", m._reap)
            attempt("collect logs", self._collect_logs)
            attempt("delete namespaces and links", _remove_run_resources, self._info, self._log)
            for link in _links():
                if link.startswith(self.prefix + "-"):
                    _run(["ip", "link", "del", link], self._log, check=False)
            attempt("remove run directory", shutil.rmtree, self.run_dir)
            attempt("restore ip_forward", _restore_ip_forward, self._ip_forward_orig, self._log)
        left = self.leftovers()
        self._log(f"close: done in {time.monotonic() - t0:.1f} s; left: {left}; errors: {errors}")
        if left or errors:
            raise RuntimeError(
                f"net clusters {self.prefix} not cleaned up: left {left}, errors {errors} "
                f"(see {self.log_dir / 'netcluster.log'})"
            )


def _choose_slot() -> int:
    used = {int(info["slot"]) for _, info in _runs() if _owner_alive(info)}
    taken = _run(["ip", "-4", "-o", "addr", "show"], None, check=False)
    taken += _run(["ip", "-4", "route", "show", "table", "all"], None, check=False)
    for slot in range(MAX_SLOTS):
        subnets = [f"10.77.{3 * slot + i}." for i in range(3)]
        if slot not in used and not any(s in taken for s in subnets):
            return slot
    raise RuntimeError(f"no free 10.77.x.0/24 slot for net clusters (in use: {sorted(used)})")


def start_net_clusters(
    log_dir: Path | str,
    workers: int = 2,
    servers: bool = True,
    timeout: float = DEFAULT_START_TIMEOUT,
) -> NetClusters:
    """Build clusters A and B (``workers`` workers each) and wait until every
    worker is ALIVE; with ``servers``, the mailbox server and transit relay run
    on the services address first (their URLs in every machine's environment).

    Raises ``RuntimeError`` naming the log file if something does not come up
    within ``timeout`` seconds; the partial run is cleaned up first.
    """
    ok, reason = netns_available()
    if not ok:
        raise RuntimeError(f"net clusters are not available here: {reason}")
    log_dir = Path(log_dir).resolve()
    log_dir.mkdir(parents=True, exist_ok=True)
    cleanup_stale()
    with _registry_lock():
        slot = _choose_slot()
        while True:
            prefix = (_run_prefix() + secrets.token_hex(3))[:6]
            if not (RUN_PARENT / f"{RUN_DIR_PREFIX}{prefix[2:]}").exists() and not any(
                n.startswith(prefix + "-") for n in _netns_list() + _links()
            ):
                break
        nc = NetClusters(log_dir, slot, prefix)
        nc.run_dir.mkdir(mode=0o755)
        live = [info for _, info in _runs() if _owner_alive(info)]
        orig = next((i.get("ip_forward_orig") for i in live if i.get("ip_forward_orig")), None)
        nc._ip_forward_orig = orig or IP_FORWARD.read_text().strip()
        nc._info = {
            "pid": os.getpid(),
            "pid_start": _proc_start_time(os.getpid()),
            "slot": slot,
            "prefix": prefix,
            "services_ip": nc.services_ip,
            "ip_forward_orig": nc._ip_forward_orig,
            "log_dir": str(log_dir),
        }
        nc._save_info()
        atexit.register(nc.close)
        nc._log(f"start: prefix {prefix}, slot {slot}, run dir {nc.run_dir}")
        IP_FORWARD.write_text("1")
    t0 = time.monotonic()
    try:
        nc._build(workers, servers, timeout)
    except BaseException:
        with contextlib.suppress(Exception):
            nc.close()
        raise
    nc._log(f"start: clusters up in {time.monotonic() - t0:.1f} s")
    return nc


def _main(argv: Sequence[str]) -> int:
    if list(argv) == ["cleanup"]:
        print("removed:", cleanup_stale() or "nothing")
        return 0
    print("usage: python -m spark_dilation.testing.netcluster cleanup", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
