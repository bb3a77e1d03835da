"""Spark to Spark over Dilation, against the Spark ceiling and the manual handoff, same run.

Usage (see benchmarks/README.md)::

    python benchmarks/spark_transfer.py                        # 10M rows, every case
    python benchmarks/spark_transfer.py --repeat 3             # medians of 3 runs
    python benchmarks/spark_transfer.py --rows 2000000 --cases transfer,ceiling

The data is ``spark.range(N)`` with a long ``id``, a double ``x`` and a
16-character string ``s``, in ``--partitions`` partitions, on ``local[2]``
Spark applications (one JVM per side), loopback, with the real mailbox server
and transit relay started locally. Cases:

- ``transfer``: one application writes ``format("dilation")``, another loads
  it and runs ``count()``; seconds from the later of the sender's ``save()``
  and the receiver's ``load()`` to the end of the receiver's ``count()``.
- ``ceiling``: the same DataFrame into a ``DataSourceArrowWriter`` that only
  counts rows (what Spark's Python writer path costs with no transfer at all).
- ``manual``: Spark writes Parquet, our Transit file transfer sends the
  folder (``spark-dilation send``), the other application reads it back and
  counts; seconds = write + transfer + read.

One JSON object per case (the median run with ``--repeat``): ``rows_per_s``,
``seconds``, ``ratio_to_ceiling``; for ``transfer`` also the CPU seconds per
MB moved of the sending and the receiving Python processes (Spark's Python
workers, the sender host and the receiving lane hosts) and their peak RSS,
sampled from /proc every 0.1 s. MB means 10**6 bytes of Arrow IPC.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PEER = [sys.executable, "-m", "spark_dilation.testing.spark_peer"]
REPORT = "spark-dilation transfer report: "
CASES = ("transfer", "ceiling", "manual")
MB = 1_000_000
CONF_ENV = "SPARK_DILATION_BENCHMARK_CONF"  # --conf, for the helper processes


# --- /proc sampling --------------------------------------------------------------------


class ProcSampler:
    """CPU seconds and peak RSS of the Python processes under given roots."""

    TICK = os.sysconf("SC_CLK_TCK")
    PAGE = os.sysconf("SC_PAGE_SIZE")

    def __init__(self) -> None:
        self.roots: dict[int, str] = {}  # root pid -> side
        self.cpu: dict[int, float] = {}
        self.rss: dict[int, int] = {}
        self.side: dict[int, str] = {}
        self.cmd: dict[int, str] = {}
        self.seen: dict[int, list[float]] = {}  # pid -> [first, last] wall time sampled
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            self.sample()

    def sample(self) -> None:
        parents: dict[int, int] = {}
        stats: dict[int, tuple[float, int, str]] = {}
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            pid = int(entry)
            try:
                with open(f"/proc/{pid}/stat") as f:
                    raw = f.read()
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            fields = raw[raw.rindex(")") + 2 :].split()
            parents[pid] = int(fields[1])
            cpu = (int(fields[11]) + int(fields[12])) / self.TICK
            stats[pid] = (cpu, int(fields[21]) * self.PAGE, cmd)
        for pid, (cpu, rss, cmd) in stats.items():
            exe = cmd.split(" ")[0]
            if ("python" not in exe and not exe.endswith("java")) or pid in self.roots:
                continue
            side = self.side.get(pid)
            if side is None:
                if "spark_dilation.transfer.receive.lanehost" in cmd:
                    side = "receive"
                elif "spark_dilation.transfer.send.senderhost" in cmd:
                    side = "send"  # reparented to init once its planner worker ends
                else:
                    p = pid
                    while p > 1 and p not in self.roots:
                        p = parents.get(p, 1)
                    side = self.roots.get(p)
            if side is None:
                continue
            self.side[pid] = side
            self.cmd[pid] = cmd
            now = time.time()
            self.seen.setdefault(pid, [now, now])[1] = now
            self.cpu[pid] = max(self.cpu.get(pid, 0.0), cpu)
            self.rss[pid] = max(self.rss.get(pid, 0), rss)

    def cpu_of(self, side: str) -> float:
        """CPU seconds of one side's Python processes (the JVM is not ours to tune)."""
        return sum(
            c for pid, c in self.cpu.items()
            if self.side[pid] == side and not self._is_jvm(pid)
        )  # fmt: skip

    def _is_jvm(self, pid: int) -> bool:
        return self.cmd[pid].split(" ")[0].endswith("java")

    def breakdown(self, side: str) -> dict[str, float]:
        """CPU seconds by kind of process: task workers, planner workers, lane hosts."""
        kinds: dict[str, float] = {}
        for pid, cpu in self.cpu.items():
            if self.side[pid] != side:
                continue
            cmd = self.cmd[pid]
            kind = (
                "jvm" if self._is_jvm(pid)
                else "lanehost" if "lanehost" in cmd
                else "senderhost" if "senderhost" in cmd
                else "planner" if "plan_data_source" in cmd or "commit_data_source" in cmd
                or "lookup_data_sources" in cmd or "write_into_data_source" in cmd
                else "daemon+tasks"
            )  # fmt: skip
            kinds[kind] = round(kinds.get(kind, 0.0) + cpu, 2)
        return kinds

    def peak_rss_mb(self, side: str) -> float:
        peaks = [
            r for pid, r in self.rss.items() if self.side[pid] == side and not self._is_jvm(pid)
        ]  # fmt: skip
        return round(max(peaks, default=0) / 2**20, 1)


# --- cases ---------------------------------------------------------------------------------


def _json_line(out: bytes) -> dict[str, Any]:
    lines = [line for line in out.decode().splitlines() if line.startswith("{")]
    if not lines:
        raise RuntimeError("a benchmark process printed no result")
    return json.loads(lines[-1])


def run_transfer(args: argparse.Namespace, servers: Any, tmp: Path, n: int) -> dict[str, Any]:
    code = f"{900 + n}-bench-transfer"
    common = ["--code", code, "--mailbox", servers.mailbox_url, "--relay", servers.relay_url]
    sampler = ProcSampler()
    recv_err = tmp / f"recv-{n}.stderr"
    send_err = tmp / f"send-{n}.stderr"
    receiver = subprocess.Popen(
        [*PEER, "receive", *common, "--no-show", "--register", "--option", f"lanes={args.lanes}",
         "--option", f"staging_dir={tmp / 'staging'}", *_conf_args(args)],
        stdout=subprocess.PIPE, stderr=recv_err.open("w"), **_pinned(args, 1),
    )  # fmt: skip
    sampler.roots[receiver.pid] = "receive"
    sender = subprocess.Popen(
        [*PEER, "send", *common, "--register", "--shape", "bench", "--rows", str(args.rows),
         "--partitions", str(args.partitions), "--option", f"compression={args.compression}",
         *_conf_args(args)],
        stdout=subprocess.PIPE, stderr=send_err.open("w"), **_pinned(args, 0),
    )  # fmt: skip
    sampler.roots[sender.pid] = "send"
    sampler.start()
    sent = _json_line(sender.communicate(timeout=3600)[0])
    got = _json_line(receiver.communicate(timeout=3600)[0])
    sampler.stop()
    t0 = max(sent.get("t0", 0), got.get("t0", 0))
    if args.logs:  # the peers' stderr (Spark's and the workers') outlives the temporary dir
        Path(args.logs).mkdir(parents=True, exist_ok=True)
        for f in (send_err, recv_err):
            shutil.copy(f, Path(args.logs) / f.name)
    _print_procs(args, sampler, t0, tmp / "staging")
    if args.procs and "t_loaded" in got:
        print(f"receiver: load() returned at {got['t_loaded'] - t0:.1f} s", file=sys.stderr)
    for side in (sent, got):
        if "error" in side:
            raise RuntimeError(side["error"])
    report = next(
        json.loads(line[len(REPORT) :])
        for line in send_err.read_text().splitlines()
        if line.startswith(REPORT)
    )
    if got["count"] != args.rows or report["rows"] != args.rows:
        raise RuntimeError(f"rows differ: {got['count']} received, report {report}")
    # From the moment both applications are waiting on the code (the later
    # of the two calls) to the end of the receiver's count().
    seconds = got["t1"] - max(sent["t0"], got["t0"])
    mb = report["bytes"] / MB
    return {
        "case": "transfer",
        "rows": args.rows,
        "seconds": round(seconds, 3),
        "rows_per_s": round(args.rows / seconds),
        "mb": round(mb, 1),
        "cpu_s_per_mb_send": round(sampler.cpu_of("send") / mb, 5),
        "cpu_s_per_mb_receive": round(sampler.cpu_of("receive") / mb, 5),
        "cpu_s_send_by_process": sampler.breakdown("send"),
        "cpu_s_receive_by_process": sampler.breakdown("receive"),
        "peak_rss_mb_send_worker": sampler.peak_rss_mb("send"),
        "peak_rss_mb_receive_worker": sampler.peak_rss_mb("receive"),
        "connections": report["connections"],
        "path": report["path"],
        "partitions": report["partitions"],
        "lanes": report["lanes"],
        "compression": report["compression"],
    }


def run_ceiling(args: argparse.Namespace, servers: Any, tmp: Path, n: int) -> dict[str, Any]:
    proc = subprocess.Popen(
        [sys.executable, __file__, "_ceiling", "--rows", str(args.rows),
         "--partitions", str(args.partitions)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, **_pinned(args, 0),
    )  # fmt: skip
    sampler = ProcSampler()
    sampler.roots[proc.pid] = "ceiling"
    sampler.start()
    stdout, stderr = proc.communicate(timeout=3600)
    sampler.stop()
    result = _json_line(stdout)
    t0 = result.get("t0", 0.0)
    _print_procs(args, sampler, t0)
    for line in stderr.decode().splitlines() if args.procs else ():
        if line.startswith("ceiling "):  # the sink's task and commit times, from t0
            what, times = line.split(": ")
            spans = "..".join(f"{float(t) - t0:.1f}" for t in times.split(".."))
            print(f"procs: {what} {spans} s", file=sys.stderr)
    if result.get("rows") != args.rows:
        raise RuntimeError(f"the counting sink saw {result}: {stderr.decode()[-2000:]}")
    return {"case": "ceiling", "rows": args.rows, "seconds": result["seconds"],
            "rows_per_s": round(args.rows / result["seconds"]),
            "cpu_s_by_process": sampler.breakdown("ceiling")}  # fmt: skip


def _pinned(args: argparse.Namespace, cpu: int) -> dict[str, Any]:
    """With ``--pin``: Popen arguments that bind a process tree (the JVM and its
    Python workers inherit the affinity) to one core, to model one machine each."""
    if not args.pin:
        return {}
    return {"preexec_fn": lambda: os.sched_setaffinity(0, {cpu})}


def _conf_args(args: argparse.Namespace) -> list[str]:
    return [arg for kv in args.conf for arg in ("--conf", kv)]


def _print_procs(
    args: argparse.Namespace, sampler: ProcSampler, t0: float = 0.0, staging: Path | None = None
) -> None:
    """With ``--procs``: each Python process's CPU, RSS and lifetime (seconds from
    ``t0``), and when each staged file appeared: a timeline of one run."""
    if not args.procs:
        return
    for pid in sorted(sampler.cpu, key=lambda p: sampler.seen[p][0]):
        first, last = (t - t0 if t0 else 0.0 for t in sampler.seen[pid])
        print(
            f"procs: {sampler.side[pid]:7} {first:6.1f}..{last:6.1f} s {sampler.cpu[pid]:6.2f} "
            f"CPU-s {sampler.rss[pid] / 2**20:5.0f} MB  {sampler.cmd[pid][31:120]}",
            file=sys.stderr,
        )
    if staging is not None and staging.exists():
        for f in sorted(staging.rglob("*"), key=lambda f: f.stat().st_mtime):
            if f.is_file():
                at = f.stat().st_mtime - t0
                print(f"staged: {at:6.1f} s {f.relative_to(staging)}", file=sys.stderr)


def run_manual(args: argparse.Namespace, servers: Any, tmp: Path, n: int) -> dict[str, Any]:
    code = f"{800 + n}-bench-manual"
    go = tmp / f"go-{n}"
    common = ["--mailbox", servers.mailbox_url, "--relay", servers.relay_url, "--code", code]
    receiver = subprocess.Popen(
        [sys.executable, __file__, "_manual_receive", *common, "--go", str(go),
         "--dir", str(tmp / f"manual-in-{n}")],
        stdout=subprocess.PIPE, stderr=(tmp / f"mrecv-{n}.stderr").open("w"),
        **_pinned(args, 1),
    )  # fmt: skip
    sender = subprocess.Popen(
        [sys.executable, __file__, "_manual_send", *common, "--go", str(go),
         "--dir", str(tmp / f"manual-out-{n}"), "--rows", str(args.rows),
         "--partitions", str(args.partitions)],
        stdout=subprocess.PIPE, stderr=(tmp / f"msend-{n}.stderr").open("w"),
        **_pinned(args, 0),
    )  # fmt: skip
    sent = _json_line(sender.communicate(timeout=3600)[0])
    got = _json_line(receiver.communicate(timeout=3600)[0])
    if got.get("rows") != args.rows:
        raise RuntimeError(f"manual handoff read {got}")
    seconds = sent["write_s"] + got["receive_s"] + got["read_s"]
    return {
        "case": "manual",
        "rows": args.rows,
        "seconds": round(seconds, 3),
        "rows_per_s": round(args.rows / seconds),
        "write_s": sent["write_s"],
        "send_s": got["receive_s"],
        "read_s": got["read_s"],
    }


RUNNERS = {"transfer": run_transfer, "ceiling": run_ceiling, "manual": run_manual}


# --- helper processes ------------------------------------------------------------------------


def _spark() -> Any:
    from spark_dilation.testing.spark_peer import session

    conf = json.loads(os.environ.get(CONF_ENV, "{}"))
    return session("local[2]", "spark-dilation-benchmark", conf)


def _ceiling(argv: list[str]) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int)
    p.add_argument("--partitions", type=int)
    a = p.parse_args(argv)
    from dataclasses import dataclass

    from pyspark.sql.datasource import DataSource, DataSourceArrowWriter, WriterCommitMessage

    from spark_dilation.testing.spark_peer import generate

    @dataclass
    class Counted(WriterCommitMessage):
        rows: int

    class CountingWriter(DataSourceArrowWriter):
        def write(self, iterator: Any) -> Counted:
            started = time.time()
            rows = sum(batch.num_rows for batch in iterator)
            print(f"ceiling task: {started:.3f}..{time.time():.3f}", file=sys.stderr)
            return Counted(rows)

        def commit(self, messages: Any) -> None:
            print(f"ceiling commit: {time.time():.3f}", file=sys.stderr)

    class CountingSink(DataSource):
        @classmethod
        def name(cls) -> str:
            return "countsink"

        def writer(self, schema: Any, overwrite: bool) -> CountingWriter:
            return CountingWriter()

    spark = _spark()
    spark.dataSource.register(CountingSink)
    df = generate(spark, a.rows, a.partitions, "bench")
    t0, wall = time.monotonic(), time.time()
    df.write.format("countsink").mode("append").save()
    seconds = time.monotonic() - t0
    print(json.dumps({"rows": a.rows, "seconds": round(seconds, 3), "t0": wall}), flush=True)


def _manual_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    for name in ("--mailbox", "--relay", "--code", "--go", "--dir"):
        p.add_argument(name)
    p.add_argument("--rows", type=int, default=0)
    p.add_argument("--partitions", type=int, default=8)
    p.add_argument("--shape", default="bench")
    return p.parse_args(argv)


def _manual_send(argv: list[str]) -> None:
    a = _manual_args(argv)
    from spark_dilation.testing.spark_peer import generate

    spark = _spark()
    df = generate(spark, a.rows, a.partitions, a.shape)
    t0 = time.monotonic()
    df.write.mode("overwrite").parquet(a.dir)
    write_s = time.monotonic() - t0
    Path(a.go).write_text("go")
    cli = Path(sys.executable).parent / "spark-dilation"
    subprocess.run(
        [str(cli), "--mailbox", a.mailbox, "send", "--classic", "--relay", a.relay, "--code",
         a.code, a.dir],
        check=True, capture_output=True, timeout=3600,
    )  # fmt: skip
    print(json.dumps({"write_s": round(write_s, 3)}), flush=True)


def _manual_receive(argv: list[str]) -> None:
    a = _manual_args(argv)
    from spark_dilation.spark import receive_file

    spark = _spark()
    while not Path(a.go).exists():
        time.sleep(0.05)
    t0 = time.monotonic()
    received = receive_file(a.code, a.dir, mailbox=a.mailbox, relay=a.relay)
    receive_s = time.monotonic() - t0
    t0 = time.monotonic()
    rows = spark.read.parquet(str(received.path)).count()
    read_s = time.monotonic() - t0
    print(json.dumps({"rows": rows, "receive_s": round(receive_s, 3),
                      "read_s": round(read_s, 3)}), flush=True)  # fmt: skip


# --- main ------------------------------------------------------------------------------------


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1].startswith("_"):
        {"_ceiling": _ceiling, "_manual_send": _manual_send,
         "_manual_receive": _manual_receive}[sys.argv[1]](sys.argv[2:])  # fmt: skip
        return
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=10_000_000)
    p.add_argument("--partitions", type=int, default=8)
    p.add_argument("--lanes", type=int, default=2)
    p.add_argument("--compression", default="none", choices=["auto", "none", "lz4", "zstd"])
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--procs", action="store_true", help="print CPU and RSS per Python process")
    p.add_argument("--logs", metavar="DIR", help="keep each transfer's peer logs in DIR")
    p.add_argument(
        "--pin", action="store_true",
        help="one core per side (sender and ceiling on CPU 0, receiver on CPU 1): two machines",
    )  # fmt: skip
    p.add_argument(
        "--conf", action="append", default=[], metavar="KEY=VALUE",
        help="a Spark setting for every application of every case",
    )  # fmt: skip
    args = p.parse_args()
    os.environ[CONF_ENV] = json.dumps(dict(kv.split("=", 1) for kv in args.conf))
    cases = [c for c in args.cases.split(",") if c]
    from spark_dilation.testing import running_servers

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    results: dict[str, list[dict[str, Any]]] = {c: [] for c in cases}
    with running_servers() as servers, tempfile.TemporaryDirectory() as tmpdir:
        tmp = Path(tmpdir)
        for n in range(args.repeat):
            for case in cases:
                results[case].append(RUNNERS[case](args, servers, tmp, n))
    ceiling = _median(results["ceiling"]) if "ceiling" in results else None
    for case in cases:
        best = _median(results[case])
        if ceiling is not None:
            best["ratio_to_ceiling"] = round(best["seconds"] / ceiling["seconds"], 3)
        best["runs"] = [r["seconds"] for r in results[case]]
        print(json.dumps(best), flush=True)


def _median(runs: list[dict[str, Any]]) -> dict[str, Any]:
    seconds = statistics.median(r["seconds"] for r in runs)
    return dict(min(runs, key=lambda r: abs(r["seconds"] - seconds)))


if __name__ == "__main__":
    main()
