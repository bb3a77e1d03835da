"""Spark to Spark over a shaped relay-only link, against the manual handoff, same run.

Usage (root: network namespaces and ``tc``; not run by the tests)::

    python benchmarks/link_bound.py                                 # 10M rows, 100mbit
    python benchmarks/link_bound.py --rows 1000000 --rate 100mbit --repeat 1
    python benchmarks/link_bound.py --cases auto,zstd --repeat 3    # medians of 3 runs

What it builds (and tears down at the end, on errors and on Ctrl-C)::

    lb<id>-a 10.88.1.2 --veth-- 10.88.1.1 lb<id>-srv 10.88.2.1 --veth-- 10.88.2.2 lb<id>-b
    (sending Spark app)        mailbox server + transit relay         (receiving Spark app)

No namespace forwards or routes to the other peer's subnet, so the peers
meet only through the relay. Both ends of both veths get ``tc qdisc add dev
X root tbf rate RATE burst 32kbit latency 400ms``. The link is measured with
one TCP stream (peer a to the server namespace, ``--probe-mb``).

Cases, each with the benchmark's data (``spark.range(N)``: ``id``, ``rand()``
as ``x``, a 16-character hex string ``s``; ``--partitions``), ``local[2]``
applications (one JVM per side):

- ``manual``: Spark writes Parquet, ``spark-dilation send --classic`` sends
  the folder through the relay, the other application reads it and counts;
  seconds = write + transfer + read.
- ``auto`` (the default options), ``none``, ``lz4``, ``zstd``, ``parquet``: one
  application writes ``format("dilation")`` with that ``compression``
  (``auto``: none given), the other loads and counts; seconds from the later
  of ``save()``/``load()`` to the end of ``count()``.
- ``tuned``: ``auto`` with ``spark_dilation.tune(spark)`` in both applications
  (Spark's Arrow batch byte cap off, :mod:`spark_dilation.spark.tuning`).

One JSON object per case (the median run with ``--repeat``): ``seconds``,
``wire_bytes`` (bytes the sender's link carried towards the relay, from
``ip -s link`` on the server's end of peer a's veth), ``link_mb_s`` (the TCP
probe), ``wire_bound_s`` (``wire_bytes`` / link rate: the least time those
bytes need), and for the dilation cases the report's ``mb`` (Arrow IPC bytes),
``compression`` and ``compression_detail``. MB means 10**6 bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from spark_transfer import PEER, REPORT, _json_line, _pinned  # noqa: E402

MB = 1_000_000
MAILBOX_PORT = 4000
RELAY_PORT = 4001
PROBE_PORT = 5001
CASES = ("manual", "auto", "tuned", "none", "lz4", "zstd", "parquet")


def sh(*argv: str, check: bool = True) -> str:
    proc = subprocess.run(argv, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if check and proc.returncode:
        raise RuntimeError(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc.stdout


class Topology:
    """Three namespaces, two shaped veths; :meth:`close` removes everything it made."""

    def __init__(self, rate: str) -> None:
        self.id = secrets.token_hex(2)
        self.ns = {side: f"lb{self.id}-{side}" for side in ("a", "b", "srv")}
        self.addr = {"a": "10.88.1.2", "b": "10.88.2.2"}
        self.gateway = {"a": "10.88.1.1", "b": "10.88.2.1"}
        self.procs: list[subprocess.Popen] = []
        self.made: list[str] = []
        self.rate = rate

    def build(self) -> None:
        for ns in self.ns.values():
            sh("ip", "netns", "add", ns)
            self.made.append(ns)
            sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
        srv = self.ns["srv"]
        for side in ("a", "b"):
            outer = self.srv_dev(side)
            sh("ip", "link", "add", outer, "netns", srv, "type", "veth",
               "peer", "name", "eth0", "netns", self.ns[side])  # fmt: skip
            sh("ip", "netns", "exec", srv, "ip", "addr", "add", f"{self.gateway[side]}/24",
               "dev", outer)  # fmt: skip
            sh("ip", "netns", "exec", srv, "ip", "link", "set", outer, "up")
            sh("ip", "netns", "exec", self.ns[side], "ip", "addr", "add",
               f"{self.addr[side]}/24", "dev", "eth0")  # fmt: skip
            sh("ip", "netns", "exec", self.ns[side], "ip", "link", "set", "eth0", "up")
            for ns, dev in ((srv, outer), (self.ns[side], "eth0")):
                sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
                   "rate", self.rate, "burst", "32kbit", "latency", "400ms")  # fmt: skip
        # The server namespace must not forward between the peers: relay only.
        sh("ip", "netns", "exec", srv, "sh", "-c", "echo 0 > /proc/sys/net/ipv4/ip_forward")

    def srv_dev(self, side: str) -> str:
        return f"v{self.id}{side}"

    def exec(self, side: str) -> list[str]:
        return ["ip", "netns", "exec", self.ns[side]]

    def start_servers(self) -> None:
        proc = subprocess.Popen(
            [*self.exec("srv"), sys.executable, "-m", "spark_dilation.servers", "--interface",
             "0.0.0.0", "--mailbox-port", str(MAILBOX_PORT), "--relay-port", str(RELAY_PORT),
             "--ready-json"],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
        self.procs.append(proc)
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line.startswith(b"{"):
            raise RuntimeError(f"the servers did not start: {line!r}")

    def mailbox(self, side: str) -> str:
        return f"ws://{self.gateway[side]}:{MAILBOX_PORT}/v1"

    def relay(self, side: str) -> str:
        return f"tcp:{self.gateway[side]}:{RELAY_PORT}"

    def wire_bytes(self) -> int:
        """Bytes peer a's link carried towards the server so far (its veth's rx there)."""
        out = sh(*self.exec("srv"), "ip", "-j", "-s", "link", "show", "dev", self.srv_dev("a"))
        return int(json.loads(out)[0]["stats64"]["rx"]["bytes"])

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                with_suppressed(os.killpg, proc.pid, signal.SIGKILL)
                proc.wait(10)
        for ns in self.made:
            for pid in sh("ip", "netns", "pids", ns, check=False).split():
                with_suppressed(os.kill, int(pid), signal.SIGKILL)
            sh("ip", "netns", "del", ns, check=False)  # takes its veth ends with it
        self.made.clear()


def with_suppressed(fn: Any, *args: Any) -> None:
    try:
        fn(*args)
    except (ProcessLookupError, PermissionError):
        pass


# --- the link probe -----------------------------------------------------------------------------

_SINK = f"""
import socket
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", {PROBE_PORT})); s.listen(1); print("ready", flush=True)
c, _ = s.accept()
while c.recv(1 << 20):
    pass
c.sendall(b"k"); c.close()
"""

_SOURCE = """
import socket, sys, time
n = int(sys.argv[2]) * 1_000_000
c = socket.create_connection((sys.argv[1], {port}))
chunk = bytes(1 << 20); t0 = time.monotonic(); sent = 0
while sent < n:
    c.sendall(chunk); sent += len(chunk)
c.shutdown(socket.SHUT_WR); c.recv(1)
print(sent / (time.monotonic() - t0) / 1e6)
""".replace("{port}", str(PROBE_PORT))


def probe_link(topo: Topology, mb: int) -> float:
    """MB/s of one TCP stream from peer a to the server namespace."""
    sink = subprocess.Popen(
        [*topo.exec("srv"), sys.executable, "-c", _SINK], stdout=subprocess.PIPE
    )
    topo.procs.append(sink)
    assert sink.stdout is not None
    sink.stdout.readline()
    out = sh(*topo.exec("a"), sys.executable, "-c", _SOURCE, topo.gateway["a"], str(mb))
    sink.wait(30)
    return float(out.strip())


# --- the timeline -------------------------------------------------------------------------------


class Timeline:
    """Samples peer a's wire bytes and the machine's CPU every ``period`` s while a case runs.

    :meth:`phases` splits a case's seconds into: before the first MB left
    (session, Spark planning, the first partition's encoding), the stream
    (first to last MB on the wire; ``link_idle_s`` of it the link had nothing
    to carry), and after the last byte (commit, the reader's count). CPU busy
    is the share of all cores in use during the stream, and before it (``/proc/stat``).
    """

    def __init__(self, topo: Topology, period: float = 0.25) -> None:
        self.topo, self.period = topo, period
        self.samples: list[tuple[float, int, int, int]] = []
        # pid: (side kind, [(time, CPU seconds so far), ...])
        self.cpu: dict[str, tuple[str, list[tuple[float, float]]]] = {}
        self.cmd: dict[str, str] = {}  # pid: command line as last seen
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._first_round = float("inf")  # end of the first sampling of the processes

    def __enter__(self) -> Timeline:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        nets = {os.stat(f"/run/netns/{ns}").st_ino: side for side, ns in self.topo.ns.items()}
        while True:
            busy, total = _cpu_jiffies()
            self.samples.append((time.time(), self.topo.wire_bytes(), busy, total))
            self._sample_processes(nets)
            self._first_round = min(self._first_round, time.time())
            if self._stop.wait(self.period):
                return

    def _sample_processes(self, nets: dict[int, str]) -> None:
        """CPU seconds so far of every process in the namespaces, by (side, kind)."""
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                side = nets.get(os.stat(f"/proc/{pid}/ns/net").st_ino)
                if side is None:
                    continue
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmd = f.read().decode(errors="replace")
            except OSError:
                continue
            cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
            kind, series = self.cpu.get(pid, ("", []))
            series.append((time.time(), cpu))
            if cmd or not kind:  # the kind as last seen (ip netns exec execs); an exiting
                kind = f"{side} {_kind(cmd)}"  # process's command line reads empty
                self.cmd[pid] = cmd.replace("\0", " ").strip()
            self.cpu[pid] = (kind, series)

    def processes(self, t0: float) -> list[dict[str, Any]]:
        """Each process seen: when (from ``t0``), CPU seconds, command (``--logs``)."""
        rows = [
            {"pid": int(pid), "kind": kind, "seen_s": round(s[0][0] - t0, 2),
             "gone_s": round(s[-1][0] - t0, 2), "cpu_s": round(s[-1][1] - s[0][1], 2),
             "cpu_at_seen": round(s[0][1], 2), "cmd": self.cmd.get(pid, "")[:160]}
            for pid, (kind, s) in self.cpu.items()
        ]  # fmt: skip
        return sorted(rows, key=lambda r: r["seen_s"])

    def cpu_by_kind(self, t0: float, t1: float) -> dict[str, float]:
        """CPU seconds each (side, kind) used between ``t0`` and ``t1`` (the measured time)."""
        out: dict[str, float] = {}
        for kind, series in self.cpu.values():
            before = [c for t, c in series if t <= t0]
            upto = [c for t, c in series if t <= t1 + self.period]
            if upto:
                # A process that ran before the timeline (the relay, in every case)
                # counts from its first sample, one started since from zero.
                existed = series[0][0] <= self._first_round
                base = before[-1] if before else series[0][1] if existed else 0.0
                used = upto[-1] - base
                out[kind] = round(out.get(kind, 0.0) + max(used, 0.0), 1)
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))

    def phases(self, t0: float, t1: float, link_mb_s: float) -> dict[str, float]:
        s = [x for x in self.samples if t0 - self.period <= x[0] <= t1 + self.period]
        if len(s) < 2:
            return {}
        base, end = s[0][1], s[-1][1]
        first = next((x for x in s if x[1] - base >= MB), s[0])
        last = next((x for x in s if end - x[1] < 64 * 1024), s[-1])
        streamed = last[1] - first[1]
        stream_s = max(last[0] - first[0], 1e-9)
        cpu = (last[2] - first[2]) / max(last[3] - first[3], 1)
        cpu_before = (first[2] - s[0][2]) / max(first[3] - s[0][3], 1)
        return {
            "before_first_mb_s": round(first[0] - t0, 2),
            "cpu_busy_before_first_mb": round(cpu_before, 2),
            "stream_s": round(stream_s, 2),
            "stream_mb_s": round(streamed / MB / stream_s, 2),
            "link_idle_s": round(max(0.0, stream_s - streamed / (link_mb_s * MB)), 2),
            "after_last_byte_s": round(t1 - last[0], 2),
            "cpu_busy_in_stream": round(cpu, 2),
        }


def _kind(cmdline: str) -> str:
    for needle, kind in (
        ("senderhost", "sender-host"), ("lanehost", "lane-host"), ("registryhost", "lane-host"),
        ("spark_dilation.servers", "mailbox+relay"), ("pyspark.daemon", "python-workers"),
        ("pyspark.worker", "python-workers"), ("java", "spark-jvm"), ("spark_peer", "driver-py"),
    ):  # fmt: skip
        if needle in cmdline:
            return kind
    return "other"


def _cpu_jiffies() -> tuple[int, int]:
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)


# --- cases ----------------------------------------------------------------------------------------


def run_dilation(
    args: argparse.Namespace, topo: Topology, tmp: Path, case: str, n: int, link_mb_s: float
) -> dict:
    code = f"{700 + n}-link-{case}"
    send_err, recv_err = tmp / f"send-{case}-{n}.stderr", tmp / f"recv-{case}-{n}.stderr"
    options = [] if case in ("auto", "tuned") else ["--option", f"compression={case}"]
    tune = ["--tune"] if case == "tuned" else []

    def common(side: str) -> list[str]:
        return ["--code", code, "--mailbox", topo.mailbox(side), "--relay", topo.relay(side)]

    before = topo.wire_bytes()
    receiver = subprocess.Popen(
        [*topo.exec("b"), *PEER, "receive", *common("b"), "--no-show", "--register", *tune,
         "--option", f"lanes={args.lanes}", "--option", f"staging_dir={tmp / 'staging'}"],
        stdout=subprocess.PIPE, stderr=recv_err.open("w"), start_new_session=True,
        **_pinned(args, 1),
    )  # fmt: skip
    sender = subprocess.Popen(
        [*topo.exec("a"), *PEER, "send", *common("a"), "--register", *tune, "--shape", args.shape,
         "--rows", str(args.rows), "--partitions", str(args.partitions), *options],
        stdout=subprocess.PIPE, stderr=send_err.open("w"), start_new_session=True,
        **_pinned(args, 0),
    )  # fmt: skip
    topo.procs += [receiver, sender]
    with Timeline(topo) as timeline:
        sent = _json_line(sender.communicate(timeout=3600)[0])
        got = _json_line(receiver.communicate(timeout=3600)[0])
    wire = topo.wire_bytes() - before
    (tmp / f"result-{case}-{n}.json").write_text(json.dumps({"sent": sent, "got": got}))
    t0 = max(sent["t0"], got["t0"])
    with (tmp / f"processes-{case}-{n}.jsonl").open("w") as f:
        f.writelines(json.dumps(row) + "\n" for row in timeline.processes(t0))
    for side in (sent, got):
        if "error" in side:
            raise RuntimeError(f"{case}: {side['error']}")
    report = next(
        json.loads(line[len(REPORT) :])
        for line in send_err.read_text().splitlines()
        if line.startswith(REPORT)
    )
    if got["count"] != args.rows:
        raise RuntimeError(f"{case}: {got['count']} rows arrived of {args.rows}")
    return {
        "case": f"dilation {case}",
        "seconds": round(got["t1"] - max(sent["t0"], got["t0"]), 3),
        "wire_bytes": wire,
        "mb": round(report["bytes"] / MB, 1),
        "path": report["path"],
        "compression": report["compression"],
        "compression_detail": report.get("compression_detail", ""),
        "timeline": timeline.phases(max(sent["t0"], got["t0"]), got["t1"], link_mb_s),
        "cpu_s": timeline.cpu_by_kind(max(sent["t0"], got["t0"]), got["t1"]),
    }


def run_manual(args: argparse.Namespace, topo: Topology, tmp: Path, n: int) -> dict:
    code = f"{600 + n}-link-manual"
    go = tmp / f"go-{n}"
    script = str(HERE / "spark_transfer.py")

    def common(side: str) -> list[str]:
        return ["--mailbox", topo.mailbox(side), "--relay", topo.relay(side), "--code", code]

    before = topo.wire_bytes()
    receiver = subprocess.Popen(
        [*topo.exec("b"), sys.executable, script, "_manual_receive", *common("b"),
         "--go", str(go), "--dir", str(tmp / f"manual-in-{n}")],
        stdout=subprocess.PIPE, stderr=(tmp / f"mrecv-{n}.stderr").open("w"),
        start_new_session=True, **_pinned(args, 1),
    )  # fmt: skip
    sender = subprocess.Popen(
        [*topo.exec("a"), sys.executable, script, "_manual_send", *common("a"), "--go", str(go),
         "--dir", str(tmp / f"manual-out-{n}"), "--rows", str(args.rows),
         "--partitions", str(args.partitions), "--shape", args.shape],
        stdout=subprocess.PIPE, stderr=(tmp / f"msend-{n}.stderr").open("w"),
        start_new_session=True, **_pinned(args, 0),
    )  # fmt: skip
    topo.procs += [receiver, sender]
    with Timeline(topo) as timeline:
        sent = _json_line(sender.communicate(timeout=3600)[0])
        got = _json_line(receiver.communicate(timeout=3600)[0])
    if got.get("rows") != args.rows:
        raise RuntimeError(f"manual handoff read {got}")
    return {
        "case": "manual",
        "seconds": round(sent["write_s"] + got["receive_s"] + got["read_s"], 3),
        "wire_bytes": topo.wire_bytes() - before,
        "write_s": sent["write_s"],
        "send_s": got["receive_s"],
        "read_s": got["read_s"],
        "cpu_s": timeline.cpu_by_kind(0.0, float("inf")),  # the whole run: JVM starts too
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=10_000_000)
    p.add_argument("--rate", default="100mbit", help="tbf rate of both peer links")
    p.add_argument("--partitions", type=int, default=8)
    p.add_argument("--lanes", type=int, default=2)
    p.add_argument("--shape", default="link", help="the data (spark_peer.SHAPES)")
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument(
        "--pin", action="store_true",
        help="one core per peer (sender CPU 0, receiver CPU 1): two machines; servers unpinned",
    )  # fmt: skip
    p.add_argument("--logs", metavar="DIR", help="work in DIR and keep the peers' logs there")
    p.add_argument("--probe-mb", type=int, default=20, help="MB the TCP link probe sends")
    args = p.parse_args()
    if os.geteuid() != 0:
        sys.exit("link_bound.py needs root (network namespaces, tc)")
    cases = [c for c in args.cases.split(",") if c]
    env = os.environ
    env.setdefault("PYSPARK_PYTHON", sys.executable)
    env["SPARK_LOCAL_IP"] = "127.0.0.1"  # each namespace's Spark on its own loopback
    env["SPARK_LOCAL_HOSTNAME"] = "localhost"  # the namespaces cannot resolve the hostname
    env.pop("SPARK_DILATION_RELAY", None)
    env.pop("SPARK_DILATION_MAILBOX", None)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    topo = Topology(args.rate)
    # Ctrl-C or SIGTERM: unwind through the finally below, which tears down.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    results: dict[str, list[dict[str, Any]]] = {c: [] for c in cases}
    try:
        topo.build()
        topo.start_servers()
        link = probe_link(topo, args.probe_mb)
        print(json.dumps({"case": "link", "rate": args.rate, "link_mb_s": round(link, 2)}))
        with tempfile.TemporaryDirectory(prefix="link-bound-") as tmpdir:
            tmp = Path(args.logs) if args.logs else Path(tmpdir)
            tmp.mkdir(parents=True, exist_ok=True)
            for n in range(args.repeat):
                for case in cases:
                    if case == "manual":
                        r = run_manual(args, topo, tmp, n)
                    else:
                        r = run_dilation(args, topo, tmp, case, n, link)
                    r.update(rows=args.rows, link_mb_s=round(link, 2))
                    r["wire_bound_s"] = round(r["wire_bytes"] / (link * MB), 2)
                    results[case].append(r)
        for case in cases:
            runs = results[case]
            median = statistics.median(r["seconds"] for r in runs)
            best = dict(min(runs, key=lambda r: abs(r["seconds"] - median)))
            best["runs"] = [r["seconds"] for r in runs]
            print(json.dumps(best), flush=True)
    finally:
        topo.close()


if __name__ == "__main__":
    main()
