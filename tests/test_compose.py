"""docker-compose.yml, without Docker: every service's command runs here, on loopback.

Each service's command line is taken from the compose file, its host names
become 127.0.0.1 and its ports free local ones, and it runs as a plain
process from this venv (what the Dockerfile installs). The test then checks
that they talk: each worker registers with its own master, the mailbox
and relay named in the services' environment carry a dataset, and JupyterLab
serves the mounted notebooks and runs a kernel.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

import spark_dilation
from spark_dilation.testing.waiting import wait_until

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
LISTEN_FLAGS = ("--port", "--webui-port", "--mailbox-port", "--relay-port")
HOST_FLAGS = ("--host", "--interface", "--ip")
ADDRESS = re.compile(r"(?P<scheme>spark://|ws://|tcp:)(?P<host>[\w.-]+):(?P<port>\d+)")
STARTUP = 150  # seconds: a guard against hanging, not a performance bound


def compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Remap:
    """Container (host, port) pairs to free loopback ports, the same pair to the same port;
    named volumes to folders under ``data``."""

    def __init__(self, data: Path) -> None:
        self.ports: dict[tuple[str, int], int] = {}
        self.data = data

    def port(self, host: str, port: int) -> int:
        return self.ports.setdefault((host, port), free_port())

    def text(self, value: str) -> str:
        def swap(m: re.Match) -> str:
            return f"{m['scheme']}127.0.0.1:{self.port(m['host'], int(m['port']))}"

        return ADDRESS.sub(swap, value)

    def command(self, name: str, service: dict) -> list[str]:
        me = service.get("hostname", name)
        args = list(service["command"])
        mounts = volumes(service, self.data)
        out: list[str] = []
        for i, arg in enumerate(args):
            before = args[i - 1] if i else ""
            inside = [t for t in mounts if arg == t or arg.startswith(t + "/")]
            if before in LISTEN_FLAGS:
                out.append(str(self.port(me, int(arg))))
            elif before in HOST_FLAGS:
                out.append("127.0.0.1")
            elif inside:
                out.append(str(mounts[inside[0]]) + arg[len(inside[0]) :])
            else:
                out.append(self.text(arg))
        # The image's programs are this venv's.
        out[0] = str(BIN / out[0])
        return out

    def environment(self, service: dict) -> dict[str, str]:
        env = {k: self.text(str(v)) for k, v in (service.get("environment") or {}).items()}
        env["PYSPARK_PYTHON"] = sys.executable
        return env


def volumes(service: dict, data: Path | None = None) -> dict[str, Path]:
    """Container paths of the service's mounts -> folders here: a bind mount's the
    repository's, a named volume's one under ``data`` (made, as Docker makes it)."""
    mounts = {}
    for volume in service.get("volumes") or []:
        source, target = volume.split(":")[:2]
        if source.startswith((".", "/")):
            mounts[target] = (ROOT / source).resolve()
        elif data is not None:
            mounts[target] = data / source
            mounts[target].mkdir(parents=True, exist_ok=True)
    return mounts


def start_service(name: str, service: dict, remap: Remap, logs: Path) -> subprocess.Popen:
    """The service's command as a local process (its own session, so stop() gets it all)."""
    env = {
        **os.environ,
        **remap.environment(service),
        "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}",
        "SPARK_LOCAL_IP": "127.0.0.1",
        "SPARK_WORKER_DIR": str(logs / f"{name}-work"),
        "SPARK_LOG_DIR": str(logs),
        # Jupyter's runtime files, settings and IPython profile in the test's
        # folder, not in this user's home (and no user settings leak in).
        "JUPYTER_RUNTIME_DIR": str(logs / f"{name}-runtime"),
        "JUPYTER_CONFIG_DIR": str(logs / f"{name}-config"),
        "IPYTHONDIR": str(logs / f"{name}-ipython"),
    }
    with open(logs / f"{name}.log", "wb") as log:
        return subprocess.Popen(
            remap.command(name, service),
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def stop(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture(scope="module")
def services(tmp_path_factory) -> Iterator[tuple[dict, Remap, dict[str, subprocess.Popen]]]:
    spec = compose()
    logs = tmp_path_factory.mktemp("compose")
    remap = Remap(logs / "volumes")
    procs: dict[str, subprocess.Popen] = {}
    try:
        for name, service in spec["services"].items():
            if name == "jupyter":
                continue  # its own test starts it: it needs none of the others to serve
            procs[name] = start_service(name, service, remap, logs)
        yield spec, remap, procs
    finally:
        stop(list(procs.values()))


def master_state(port: int) -> dict | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/", timeout=5) as r:
            return json.load(r)
    except OSError:
        return None


def test_the_compose_file_has_the_services_the_readme_describes():
    spec = compose()
    assert set(spec["services"]) == {
        "wormhole",
        "spark-a-master",
        "spark-a-worker",
        "spark-b-master",
        "spark-b-worker",
        "jupyter",
    }
    for name, service in spec["services"].items():
        assert service["build"] == "."
        env = service["environment"]
        assert env["SPARK_DILATION_MAILBOX"] == "ws://wormhole:4000/v1", name
        assert env["SPARK_DILATION_RELAY"] == "tcp:wormhole:4001", name


@pytest.mark.integration  # starts processes of its own
@pytest.mark.multimachine  # make test-multimachine: alone
def test_each_worker_registers_with_its_own_master(services):
    spec, remap, procs = services

    def exited() -> str | None:
        gone = [
            f"service {n} exited with {p.returncode}"
            for n, p in procs.items()
            if p.poll() is not None
        ]
        return gone[0] if gone else None

    for cluster in ("a", "b"):
        master = spec["services"][f"spark-{cluster}-master"]
        webui = remap.port(master["hostname"], 8080)
        spark_port = remap.port(master["hostname"], 7077)

        def one_alive(webui: int = webui) -> bool:
            state = master_state(webui)
            return bool(state and [w for w in state["workers"] if w["state"] == "ALIVE"])

        what = f"an ALIVE worker at the master of cluster {cluster}"
        wait_until(what, one_alive, STARTUP, interval=0.5, stop_if=exited)
        state = master_state(webui)
        assert state is not None, f"the master of cluster {cluster} stopped answering"
        alive = [w for w in state["workers"] if w["state"] == "ALIVE"]
        assert len(alive) == 1, state
        assert state["url"] == f"spark://127.0.0.1:{spark_port}"
        assert alive[0]["cores"] == 2


@pytest.mark.integration  # starts processes of its own
@pytest.mark.multimachine  # make test-multimachine: alone
def test_the_wormhole_service_carries_a_dataset(services):
    spec, remap, procs = services
    env = remap.environment(spec["services"]["spark-a-worker"])
    mailbox, relay = env["SPARK_DILATION_MAILBOX"], env["SPARK_DILATION_RELAY"]
    table = pa.table({"id": list(range(1000)), "word": [f"w{i}" for i in range(1000)]})

    def listening() -> bool:  # the server process may still be starting
        try:
            with socket.create_connection(("127.0.0.1", int(mailbox.rsplit(":", 1)[1][:-3]))):
                return True
        except OSError:
            return False

    wormhole = procs["wormhole"]
    wait_until(
        "the mailbox to listen", listening, STARTUP, interval=0.5,
        stop_if=lambda: "the wormhole service exited" if wormhole.poll() is not None else None,
    )  # fmt: skip
    handle = spark_dilation.send(table, mailbox=mailbox, relay=relay, no_listen=True)
    got = spark_dilation.receive(None, handle.code, mailbox=mailbox, relay=relay, no_listen=True)
    report = handle.wait(STARTUP)
    assert got.equals(table)
    assert report.path == "relay"  # no_listen on both sides: only the relay service joins them
    # Its mailbox database is on the service's volume (a restart keeps the meetings).
    assert (remap.data / "wormhole-data" / "mailbox.sqlite").is_file()


@pytest.mark.integration  # starts processes of its own
@pytest.mark.multimachine  # make test-multimachine: alone
def test_cluster_b_receives_a_dataset_through_the_wormhole_service(services, tmp_path):
    # A Spark application on standalone cluster B (its driver here, its
    # executor on B's worker, lanes in the executor's tasks) receives what this
    # process sends, through the wormhole service. (Spark to Spark between two
    # applications is the demo's and tests/test_spark_transfer.py's job.)
    spec, remap, _ = services
    test_each_worker_registers_with_its_own_master(services)
    env = remap.environment(spec["services"]["spark-b-worker"])
    mailbox, relay = env["SPARK_DILATION_MAILBOX"], env["SPARK_DILATION_RELAY"]
    table = pa.table(
        {
            "id": pa.array(range(3000), pa.int64()),
            "name": [f"n{i}" if i % 7 else None for i in range(3000)],
            "x": [i / 8 for i in range(3000)],
        }
    )
    handle = spark_dilation.send(table, mailbox=mailbox, relay=relay)
    master = f"spark://127.0.0.1:{remap.port('spark-b-master', 7077)}"
    out, log = tmp_path / "out", tmp_path / "receive.log"
    with open(log, "wb") as err:
        done = subprocess.run(
            [sys.executable, "-m", "spark_dilation.testing.spark_peer", "receive",
             "--code", handle.code, "--mailbox", mailbox, "--relay", relay,
             "--master", master, "--no-show", "--out", str(out),
             "--conf", "spark.executor.memory=512m"],
            env={**os.environ, **env, "SPARK_LOCAL_IP": "127.0.0.1"},
            stdout=subprocess.PIPE, stderr=err, text=True, timeout=STARTUP * 2, check=False,
        )  # fmt: skip
    assert done.returncode == 0, done.stdout + log.read_text(errors="replace")[-3000:]
    handle.wait(STARTUP)
    result = json.loads(done.stdout.splitlines()[-1])
    assert result["count"] == 3000
    got = pq.read_table(out).select(["id", "name", "x"]).sort_by("id")
    assert got.to_pylist() == table.to_pylist()


class Jupyter:
    """The jupyter service's REST API and kernel WebSocket, as a browser uses them.

    The compose file sets an empty token (no login), so requests carry no
    token; POST and DELETE carry the XSRF cookie and header, as JupyterLab's
    own pages do.
    """

    def __init__(self, port: int) -> None:
        self.base = f"127.0.0.1:{port}"
        self.xsrf = ""

    def call(self, method: str, path: str, body: dict | None = None) -> dict | None:
        request = urllib.request.Request(
            f"http://{self.base}{path}",
            data=None if body is None else json.dumps(body).encode(),
            method=method,
            headers={"X-XSRFToken": self.xsrf, "Cookie": f"_xsrf={self.xsrf}"},
        )
        with urllib.request.urlopen(request, timeout=30) as r:
            data = r.read()
        return json.loads(data) if data else None

    def xsrf_cookie(self) -> None:
        """Any page sets the _xsrf cookie; the lab page does."""
        with urllib.request.urlopen(f"http://{self.base}/lab", timeout=30) as r:
            cookies = r.headers.get_all("Set-Cookie") or []
        found = [m[1] for c in cookies if (m := re.search(r"_xsrf=([^;]+)", c))]
        assert found, cookies
        self.xsrf = found[0]

    def execute(self, kernel_id: str, code: str) -> tuple[str, dict]:
        """Run ``code`` over the kernel's WebSocket: (its stdout, the execute_reply content)."""
        import websocket  # websocket-client, a dependency of jupyter_server

        session = uuid.uuid4().hex
        ws = websocket.create_connection(
            f"ws://{self.base}/api/kernels/{kernel_id}/channels?session_id={session}",
            timeout=STARTUP,
        )
        try:
            msg_id = uuid.uuid4().hex
            ws.send(
                json.dumps(
                    {
                        "header": {
                            "msg_id": msg_id,
                            "msg_type": "execute_request",
                            "session": session,
                            "username": "test",
                            "version": "5.3",
                        },
                        "parent_header": {},
                        "metadata": {},
                        "content": {"code": code, "silent": False, "allow_stdin": False},
                        "channel": "shell",
                        "buffers": [],
                    }
                )
            )
            stdout, reply, idle = "", None, False
            while reply is None or not idle:  # the reply and iopub's idle may come in any order
                msg = json.loads(ws.recv())
                if msg["parent_header"].get("msg_id") != msg_id:
                    continue
                kind = msg["msg_type"]
                if kind == "stream" and msg["content"]["name"] == "stdout":
                    stdout += msg["content"]["text"]
                elif kind == "error":
                    raise AssertionError("\n".join(msg["content"]["traceback"]))
                elif kind == "execute_reply":
                    reply = msg["content"]
                elif kind == "status" and msg["content"]["execution_state"] == "idle":
                    idle = True
            return stdout, reply
        finally:
            ws.close()


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.integration  # starts processes of its own
@pytest.mark.multimachine  # make test-multimachine: alone
def test_the_jupyter_service_serves_the_tested_notebooks(tmp_path):
    """The jupyter service's command, run here: it serves the mounted notebooks
    (the ones tests/test_notebooks.py runs) and a kernel that has spark_dilation."""
    spec = compose()
    jupyter = spec["services"]["jupyter"]
    assert jupyter["command"][:2] == ["jupyter", "lab"]
    assert jupyter["environment"]["SPARK_MASTER"] == "spark://spark-a-master:7077"
    folder = jupyter["command"][jupyter["command"].index("--notebook-dir") + 1]
    assert volumes(jupyter)[folder] == ROOT / "notebooks"
    # It has no token, so it must not be published beyond the host's loopback.
    assert jupyter["ports"] == ["127.0.0.1:8888:8888"]
    # The image runs the JupyterLab this test runs.
    pinned = re.search(r'"(jupyterlab==[\d.]+)"', (ROOT / "pyproject.toml").read_text())
    assert pinned and pinned[1] in (ROOT / "Dockerfile").read_text()
    remap = Remap(tmp_path / "volumes")
    proc = start_service("jupyter", jupyter, remap, tmp_path)
    api = Jupyter(remap.port("jupyter", 8888))
    kernel_pid = None
    try:

        def answers() -> bool:
            try:
                return api.call("GET", "/api/status") is not None
            except OSError:
                return False

        wait_until(
            "JupyterLab to answer", answers, STARTUP, interval=0.5,
            stop_if=lambda: "JupyterLab exited" if proc.poll() is not None else None,
            details=lambda: (tmp_path / "jupyter.log").read_text()[-3000:],
        )  # fmt: skip
        status = api.call("GET", "/api/status")
        assert status is not None and "started" in status
        specs = api.call("GET", "/api/kernelspecs")
        assert specs is not None
        for name in ("send_a_dataset.ipynb", "receive_a_dataset.ipynb"):
            used = json.loads((ROOT / "notebooks" / name).read_text())["metadata"]["kernelspec"]
            assert used["name"] in specs["kernelspecs"], (name, specs)
        # The root is the mounted folder: what the notebooks folder holds.
        listing = api.call("GET", "/api/contents/")
        assert listing is not None
        names = {item["name"] for item in listing["content"]}
        assert {"send_a_dataset.ipynb", "receive_a_dataset.ipynb"} <= names, names

        api.xsrf_cookie()
        kernel = api.call("POST", "/api/kernels", {"name": "python3"})
        assert kernel is not None
        stdout, reply = api.execute(
            kernel["id"],
            "import os, spark_dilation\n"
            "print(spark_dilation.__version__, os.getpid(), os.environ['SPARK_DILATION_MAILBOX'])",
        )
        assert reply["status"] == "ok", reply
        version, pid, mailbox = stdout.split()
        kernel_pid = int(pid)
        assert version == spark_dilation.__version__
        # The service's environment reached the kernel (the mailbox, remapped here).
        assert mailbox == remap.environment(jupyter)["SPARK_DILATION_MAILBOX"]
        api.call("DELETE", f"/api/kernels/{kernel['id']}")
        kernels = api.call("GET", "/api/kernels")
        assert kernels == [], kernels
        # A clean stop: the server's own shutdown, then the process exits by itself.
        api.call("POST", "/api/shutdown")
        assert proc.wait(STARTUP) == 0, (tmp_path / "jupyter.log").read_text()[-3000:]
        assert not alive(kernel_pid)
    finally:
        stop([proc])
        if kernel_pid is not None and alive(kernel_pid):
            os.kill(kernel_pid, signal.SIGKILL)  # the kernel runs in a session of its own
