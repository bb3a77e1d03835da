"""Smoke test of spark_dilation.testing.netcluster: two standalone clusters whose
machines are network namespaces.

On the set the multi-machine tests share (a second set would cost a minute of
both cores): the fixture fails (never skips) where namespaces cannot be made, and
checks that closing the set leaves nothing.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from spark_dilation.testing.netcluster import (
    IP_FORWARD,
    Machine,
    NetClusters,
)
from spark_dilation.testing.waiting import wait_until

# On the worker that runs the shared clusters' tests, after them: two sets of
# namespace clusters at once would double the JVMs on the machine.
pytestmark = [pytest.mark.xdist_group("net_clusters"), pytest.mark.multimachine]

DRIVER = """\
import json, sys
from pyspark.sql import SparkSession

out, services_ip = sys.argv[1], sys.argv[2]


def where(i):
    import os, socket, tempfile

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((services_ip, 9))  # UDP: no packet, just the source address
        ip = s.getsockname()[0]
    env = os.environ
    return [i, env.get("SPARK_DILATION_MACHINE"), tempfile.gettempdir(), ip,
            env.get("SPARK_DILATION_MAILBOX")]


spark = SparkSession.builder.appName("netcluster-smoke").getOrCreate()
tasks = spark.sparkContext.parallelize(range(4), 4).map(where).collect()
import os, tempfile

result = {"driver": os.environ.get("SPARK_DILATION_MACHINE"),
          "driver_tmp": tempfile.gettempdir(), "tasks": tasks}
with open(out, "w") as f:
    json.dump(result, f)
spark.stop()
"""

LISTENER = """\
import socket
s = socket.create_server(("0.0.0.0", 9099))
while True:
    s.accept()[0].close()
"""


def _tail(path: Path, n: int = 40) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-n:]) if path.exists() else ""


def _our_processes(nc: NetClusters, ns: str) -> list[str]:
    """Processes in namespace ``ns``."""
    out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout
    return out.split()


def _run_smoke_job(nc: NetClusters, log_dir: Path) -> dict:
    script = log_dir / "smoke_driver.py"
    script.write_text(DRIVER)
    out = log_dir / "smoke_result.json"
    proc = nc.run_driver(
        nc.a, [sys.executable, str(script), str(out), nc.services_ip], "smoke-driver.log"
    )
    try:
        code = proc.wait(180)
    except subprocess.TimeoutExpired:
        pytest.fail("the driver did not finish in 180 s:\n" + _tail(log_dir / "smoke-driver.log"))
    assert code == 0, f"driver exited {code}:\n" + _tail(log_dir / "smoke-driver.log")
    return json.loads(out.read_text())


def _check_reachability(nc: NetClusters, log_dir: Path) -> None:
    a1, b1 = nc.a.workers[0], nc.b.workers[0]
    for m in nc.machines:
        routes = subprocess.run(
            ["ip", "-n", m.ns, "route", "show", "default"], capture_output=True, text=True
        )
        assert routes.stdout.strip() == "", f"{m.name} has a default route: {routes.stdout}"
    b1.popen([sys.executable, "-c", LISTENER], "listener-b1.log")
    # The root namespace reaches every subnet: wait there until the listener is up.
    wait_until("the listener on b1", lambda: _connects(b1.ip, 9099), 30)
    mailbox, relay = nc.servers.mailbox_port, nc.servers.relay_port

    assert nc.mode == "relay_only"
    assert not a1.can_connect(b1.ip, 9099), "relay_only: a1 reached b1"
    assert not b1.can_connect(nc.a.driver.ip, 7077), "relay_only: b1 reached A's master"
    assert a1.can_connect(nc.services_ip, mailbox)
    assert b1.can_connect(nc.services_ip, relay)

    nc.direct()
    assert a1.can_connect(b1.ip, 9099), "direct: a1 cannot reach b1"
    assert b1.can_connect(nc.a.driver.ip, 7077), "direct: b1 cannot reach A's master"
    assert a1.can_connect(nc.services_ip, mailbox)

    nc.relay_only()
    assert not a1.can_connect(b1.ip, 9099), "relay_only again: a1 reached b1"
    assert b1.can_connect(nc.services_ip, mailbox)

    b1.disconnect()
    assert not b1.can_connect(nc.services_ip, mailbox, timeout=1), "disconnected b1 connected"
    b1.reconnect()
    assert b1.can_connect(nc.services_ip, mailbox)


def _connects(host: str, port: int) -> bool:
    import socket

    try:
        socket.create_connection((host, port), timeout=1).close()
        return True
    except OSError:
        return False


def _check_worker_loss(nc: NetClusters) -> Machine:
    a1 = nc.a.workers[0]
    sleeper = a1.popen([sys.executable, "-c", "import time; time.sleep(600)"], "sleeper-a1.log")
    nc.a.kill_worker_jvm(a1)
    wait_until("the master to drop a1's worker", lambda: a1.ip not in nc.a.alive_workers(), 30)
    assert sleeper.poll() is None, "kill_worker_jvm killed another process of the machine"
    assert sleeper.pid in a1.pids()

    t0 = time.monotonic()
    a3 = nc.a.add_worker()
    print(f"replacement worker up in {time.monotonic() - t0:.1f} s")
    assert a3.name == "a3" and a3.ip.endswith(".4")
    assert a3.ip in nc.a.alive_workers()

    nc.a.kill_worker(a1)  # "machine lost": everything on it
    assert sleeper.poll() is not None
    assert a1.pids() == []
    nc.a.start_worker(a1)  # the machine comes back
    assert a1.ip in nc.a.alive_workers()
    return a3


def test_net_clusters(net_clusters: NetClusters) -> None:
    """On the shared clusters (tests/conftest.py, which also checks that their close
    leaves nothing and keeps the executors' logs): A's workers, a driver job whose tasks
    run on both, reachability by mode, a Worker and a machine lost and replaced."""
    nc = net_clusters
    assert IP_FORWARD.read_text().strip() == "1"
    assert nc.mailbox_url == f"ws://{nc.services_ip}:{nc.servers.mailbox_port}/v1"
    assert nc.relay_url == f"tcp:{nc.services_ip}:{nc.servers.relay_port}"
    # The multi-machine tests replace B's machines; A keeps its two.
    assert sorted(nc.a.alive_workers()) == [m.ip for m in nc.a.workers]
    assert set(nc.b.alive_workers()) <= {m.ip for m in nc.b.workers}

    t1 = time.monotonic()
    result = _run_smoke_job(nc, nc.log_dir)
    print(f"driver job done in {time.monotonic() - t1:.1f} s")
    assert result["driver"] == "a0"
    assert result["driver_tmp"] == str(nc.a.driver.tmp)
    by_name = {m.name: m for m in nc.a.workers}
    seen = {}
    for _i, machine, tmp, ip, mailbox in result["tasks"]:
        assert machine in by_name, result
        assert tmp == str(by_name[machine].tmp), result
        assert ip == by_name[machine].ip, result
        assert mailbox == nc.mailbox_url, result
        seen[machine] = tmp
    assert set(seen) == {"a1", "a2"}, f"tasks did not run on both workers: {result}"
    assert len(set(seen.values())) == 2

    t1 = time.monotonic()
    _check_reachability(nc, nc.log_dir)
    print(f"reachability checked in {time.monotonic() - t1:.1f} s")

    a3 = _check_worker_loss(nc)
    # A as the other tests know it: a1 and a2 (a3's machine stays down until close).
    nc.a.kill_worker(a3)
    nc.a.workers.remove(a3)
    wait_until("the master to drop a3's worker", lambda: a3.ip not in nc.a.alive_workers(), 30)
    assert _our_processes(nc, a3.ns) == []
