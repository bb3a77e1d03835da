"""Structured Streaming over Dilation: latency, throughput against the batch path, RSS paused.

Usage (see benchmarks/README.md)::

    python benchmarks/streaming.py                       # every case, medians of 3 runs
    python benchmarks/streaming.py --quick --repeat 1    # short windows, one run
    python benchmarks/streaming.py --cases latency --rate 10000 --window 60

Every Spark application is ``local[2]`` in its own process (a sub-mode of this
file: ``python benchmarks/streaming.py _rate_send ...``), on this machine, with
the real mailbox server and transit relay started locally. Cases:

- ``latency``: a sending application streams ``readStream.format("rate")`` at
  ``--rate`` rows/s (each row stamped by the rate source at its creation,
  ``generated_at``), with ``current_timestamp()`` (the sender's micro-batch
  time) as ``sent_at``, into ``writeStream.format("dilation")``; the receiving
  application's ``foreachBatch`` takes the time on entry, reads the rows to
  its driver (``toArrow``) and takes the time again: the moment the rows are
  read. **Headline** ``p50_s``/``p99_s``/``max_s``: per row, from its creation
  to that moment (one clock: both on this machine), over the rows created in
  a ``--window`` after a ``--warmup`` (from the receiver's first rows).
  Breakdown: ``created_to_sent_p50_s`` (the sender's micro-batch wait),
  ``sent_to_entry_*`` (the sender's micro-batch time to the receiving
  ``foreachBatch``'s entry, the narrower figure earlier versions headlined)
  and ``entry_to_read_p50_s`` (reading the micro-batch's rows).
- ``throughput``: ``--rows`` rows of the bench shape (``id``, ``x``, ``s``) as
  Parquet files, streamed with Trigger.AvailableNow (``--max-files`` files a
  micro-batch) into the dilation sink, the receiver counting in
  ``foreachBatch``; against the batch path in the same run: the same Parquet
  ``write.format("dilation")``, ``read.format("dilation").load().count()``.
  Both timed from the later of the two applications' start calls to the
  receiver's last row; ``ratio_to_batch`` = stream rows/s over batch rows/s.
- ``paused``: the ``latency`` pair; after ``--warmup`` the receiving
  application (its driver, JVM and workers) is stopped with SIGSTOP for
  ``--pause`` seconds while the sender keeps producing, then resumed. RSS of
  the sending side's processes (the stream host, the driver's Python, Spark's
  Python workers; the JVM for context) sampled from /proc every 0.5 s: peak
  before, during the pause and in the catch-up; ``catch_up_s``: from SIGCONT
  to the receiver's first micro-batch holding rows created after it; and
  whether every row arrived once (ids 0..max, counted).

One JSON object per case on stdout (the median run with ``--repeat``; for
latency each percentile is the median of the runs' values; ``runs`` lists all).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

CASES = ("latency", "throughput", "paused")
PAGE = os.sysconf("SC_PAGE_SIZE")
TMP_ENV = "SPARK_DILATION_BENCHMARK_TMP"  # the run's scratch folder, for the helpers' Spark
MARK_ENV = "SPARK_DILATION_BENCHMARK_RUN"  # in every process of a run: how cleanup finds them


# --- helper processes (each its own Spark application) ----------------------------------------


def _spark(name: str) -> Any:
    from spark_dilation.testing.spark_peer import session

    conf: dict[str, str] = {}
    tmp = os.environ.get(TMP_ENV)
    if tmp:  # Spark's scratch files with ours, not in /tmp
        conf["spark.local.dir"] = str(Path(tmp) / "spark-local")
        conf["spark.driver.extraJavaOptions"] = f"-Djava.io.tmpdir={tmp}"
    spark = session("local[2]", name, conf)
    import spark_dilation

    spark_dilation.register(spark)  # the one-time data source lookup, before any clock
    return spark


def _helper_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    for name in ("--code", "--mailbox", "--relay", "--checkpoint", "--pairing", "--stop"):
        p.add_argument(name)
    for name in ("--status", "--source", "--out"):
        p.add_argument(name)
    p.add_argument("--rate", type=int, default=10_000)
    p.add_argument("--trigger-ms", type=int, default=0)
    p.add_argument("--rows", type=int, default=0)
    p.add_argument("--files", type=int, default=8)
    p.add_argument("--partitions", type=int, default=0)
    p.add_argument("--max-files", type=int, default=1)
    p.add_argument("--timeout", type=float, default=1800)
    return p.parse_args(argv)


def _options(a: argparse.Namespace) -> dict[str, str]:
    opts = {"code": a.code, "mailbox": a.mailbox}
    if a.relay:
        opts["relay"] = a.relay
    if a.pairing:
        opts["pairing_dir"] = a.pairing
    return opts


def _trigger(writer: Any, ms: int) -> Any:
    return writer.trigger(processingTime=f"{ms} milliseconds") if ms > 0 else writer


def _wait_stop(query: Any, stop: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not Path(stop).exists() and time.monotonic() < deadline:
        if query.exception() is not None:
            raise RuntimeError(str(query.exception()))
        time.sleep(0.2)


def _generate(argv: list[str]) -> dict[str, Any]:
    a = _helper_args(argv)
    from spark_dilation.testing.spark_peer import BENCH_COLUMNS

    spark = _spark("bench-stream-generate")
    df = spark.range(0, a.rows, numPartitions=a.files).selectExpr(*BENCH_COLUMNS)
    df.write.mode("overwrite").parquet(a.out)
    return {"rows": spark.read.parquet(a.out).count()}


def _rate_send(argv: list[str]) -> dict[str, Any]:
    """Rows from the rate source, stamped with this micro-batch's time, until ``--stop``."""
    a = _helper_args(argv)
    spark = _spark("bench-stream-rate-send")
    reader = spark.readStream.format("rate").option("rowsPerSecond", a.rate)
    if a.partitions:
        reader = reader.option("numPartitions", a.partitions)
    stream = reader.load().selectExpr(
        "value AS id", "timestamp AS generated_at", "current_timestamp() AS sent_at"
    )
    writer = stream.writeStream.format("dilation").options(**_options(a))
    query = _trigger(writer.option("checkpointLocation", a.checkpoint), a.trigger_ms).start()
    _wait_stop(query, a.stop, a.timeout)
    progress = query.recentProgress
    query.stop()
    return {
        "batches": int(progress[-1]["batchId"]) + 1 if progress else 0,
        "longest_batch_ms": max((p["durationMs"].get("triggerExecution", 0) for p in progress),
                                default=0),
    }  # fmt: skip


def _rate_receive(argv: list[str]) -> dict[str, Any]:
    """Each micro-batch: its time on entry, rows by (sent_at, 10 ms of generated_at), ids."""
    a = _helper_args(argv)
    import pyarrow.compute as pc
    from pyspark.sql import functions as F

    spark = _spark("bench-stream-rate-receive")
    status = open(a.status, "a")  # for as long as the query runs

    def each(df: Any, batch_id: int) -> None:
        t = time.time()
        # The rows' stamps to this driver as Arrow (one stage, no shuffle: 24 bytes a row),
        # counted here by (sent_at, 10 ms of generated_at).
        table = df.select(
            F.unix_micros("sent_at").alias("sent"),
            F.floor(F.unix_micros("generated_at") / 10_000).alias("gen"),
            "id",
        ).toArrow()
        groups = table.group_by(["sent", "gen"]).aggregate([("id", "count")]).to_pylist()
        ids = table.column("id")
        line = {
            "batch": batch_id,
            "t": t,
            "t_end": time.time(),
            "rows": table.num_rows,
            "lo": pc.min(ids).as_py(),
            "hi": pc.max(ids).as_py(),
            "groups": [[g["sent"], g["gen"], g["id_count"]] for g in groups],
        }
        status.write(json.dumps(line) + "\n")
        status.flush()

    stream = spark.readStream.format("dilation").options(**_options(a)).load()
    writer = stream.writeStream.foreachBatch(each).option("checkpointLocation", a.checkpoint)
    query = _trigger(writer, a.trigger_ms).start()
    _wait_stop(query, a.stop, a.timeout)
    query.stop()
    return {"stopped": True}


def _stream_send(argv: list[str]) -> dict[str, Any]:
    from spark_dilation.testing.stream_peer import send_files

    a = _helper_args(argv)
    spark = _spark("bench-stream-send")
    schema = spark.read.parquet(a.source).schema  # before the clock, as the batch path's
    t0 = time.time()
    query = send_files(
        spark,
        a.source,
        _options(a),
        a.checkpoint,
        max_files=a.max_files,
        timeout=a.timeout,
        schema=schema,
    )
    progress = query.lastProgress
    return {"t0": t0, "t1": time.time(), "batches": int(progress["batchId"]) + 1 if progress else 0}


def _stream_receive(argv: list[str]) -> dict[str, Any]:
    a = _helper_args(argv)
    spark = _spark("bench-stream-receive")
    seen = {"rows": 0, "batches": 0, "t_first": 0.0, "t_last": 0.0}
    done = threading.Event()

    def each(df: Any, batch_id: int) -> None:
        n = df.count()
        if n:
            seen["rows"] += n
            seen["batches"] += 1
            seen["t_last"] = time.time()
            seen["t_first"] = seen["t_first"] or seen["t_last"]
        if seen["rows"] >= a.rows:
            done.set()

    t0 = time.time()
    stream = spark.readStream.format("dilation").options(**_options(a)).load()
    seen["t_loaded"] = time.time()  # paired: schema() returned
    writer = stream.writeStream.foreachBatch(each).option("checkpointLocation", a.checkpoint)
    query = _trigger(writer, a.trigger_ms).start()
    deadline = time.monotonic() + a.timeout
    while not done.wait(0.2):
        if query.exception() is not None:
            raise RuntimeError(str(query.exception()))
        if time.monotonic() > deadline:
            raise TimeoutError(f"{seen['rows']} of {a.rows} rows after {a.timeout:g} s")
    query.stop()
    return {"t0": t0, **seen}


def _batch_send(argv: list[str]) -> dict[str, Any]:
    a = _helper_args(argv)
    spark = _spark("bench-batch-send")
    df = spark.read.parquet(a.source)
    t0 = time.time()
    df.write.format("dilation").options(**_options(a)).option("compression", "none").mode(
        "append"
    ).save()
    return {"t0": t0, "t1": time.time()}


def _batch_receive(argv: list[str]) -> dict[str, Any]:
    a = _helper_args(argv)
    spark = _spark("bench-batch-receive")
    t0 = time.time()
    df = spark.read.format("dilation").options(**_options(a)).load()
    t_loaded = time.time()  # paired: schema() returned
    rows = df.count()
    return {"t0": t0, "t_loaded": t_loaded, "t1": time.time(), "rows": rows}


HELPERS = {
    "_generate": _generate,
    "_rate_send": _rate_send,
    "_rate_receive": _rate_receive,
    "_stream_send": _stream_send,
    "_stream_receive": _stream_receive,
    "_batch_send": _batch_send,
    "_batch_receive": _batch_receive,
}


def _helper(mode: str, argv: list[str]) -> int:
    try:
        result = HELPERS[mode](argv)
    except Exception as e:  # one line for the benchmark; Spark's log has the rest
        import traceback

        traceback.print_exc()
        result = {"error": f"{type(e).__name__}: {e}"[:4000]}
    print(json.dumps(result), flush=True)
    return 0 if "error" not in result else 1


# --- the benchmark's side: processes, /proc ----------------------------------------------------


class Run:
    """The helper processes of one case run, their logs, and their cleanup."""

    def __init__(self, tmp: Path, name: str) -> None:
        self.tmp, self.name = tmp, name
        self.procs: dict[str, subprocess.Popen] = {}
        self.mark = f"{name}-{os.getpid()}-{time.time_ns()}"

    def start(self, role: str, mode: str, *args: str) -> subprocess.Popen:
        err = (self.tmp / f"{self.name}-{role}.stderr").open("w")
        env = {**os.environ, MARK_ENV: self.mark}
        proc = subprocess.Popen(
            [sys.executable, __file__, mode, *args],
            stdout=subprocess.PIPE, stderr=err, start_new_session=True, env=env,
        )  # fmt: skip
        self.procs[role] = proc
        return proc

    def result(self, role: str, timeout: float) -> dict[str, Any]:
        out, _ = self.procs[role].communicate(timeout=timeout)
        lines = [line for line in out.decode().splitlines() if line.startswith("{")]
        result = json.loads(lines[-1]) if lines else {"error": "no result"}
        if "error" in result:
            log = self.tmp / f"{self.name}-{role}.stderr"
            raise RuntimeError(f"{self.name} {role}: {result['error']} (see {log})")
        return result

    def kill(self) -> None:
        """Every process of this run: the helpers' groups (sessions of their own), then
        whatever else carries the run's mark (the stream host and lane hosts leave the
        group; they end with their driver, given a few seconds)."""
        for proc in self.procs.values():
            for sig in (signal.SIGCONT, signal.SIGKILL):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, sig)
            with contextlib.suppress(Exception):
                proc.wait(10)
        needle = f"{MARK_ENV}={self.mark}".encode()
        for attempt in range(20):
            left = []
            for pid in _procs():
                with contextlib.suppress(OSError), open(f"/proc/{pid}/environ", "rb") as f:
                    if needle in f.read().split(b"\0"):
                        left.append(pid)
            if not left:
                return
            for pid in left if attempt >= 10 else ():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.5)


def _procs() -> dict[int, tuple[int, str]]:
    """pid -> (parent, command line) of every process."""
    found: dict[int, tuple[int, str]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                raw = f.read()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        found[int(entry)] = (int(raw[raw.rindex(")") + 2 :].split()[1]), cmd)
    return found


def _tree(root: int, procs: dict[int, tuple[int, str]]) -> list[int]:
    children: dict[int, list[int]] = {}
    for pid, (parent, _cmd) in procs.items():
        children.setdefault(parent, []).append(pid)
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        if pid in procs:
            out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def _status_kb(pid: int, field: str) -> int:
    with contextlib.suppress(OSError, ValueError), open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _pss_kb(pid: int) -> int:
    with contextlib.suppress(OSError, ValueError), open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith("Pss:"):
                return int(line.split()[1])
    return 0


def _kind(pid: int, root: int, cmd: str) -> str:
    exe = cmd.split(" ")[0]
    if exe.endswith("java"):
        return "jvm"
    if "spark_dilation.transfer.send.streamhost" in cmd:
        return "streamhost"
    if pid == root:
        return "driver"
    return "python_workers" if "python" in exe else "other"


class RssSampler:
    """Peak RSS (MB) by kind of the sending application's processes, by phase."""

    def __init__(self, root: int, tmp: Path) -> None:
        self.root, self.tmp = root, str(tmp)
        self.phase = "before"
        self.peaks: dict[str, dict[str, float]] = {}
        self.hwm: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _pids(self) -> dict[int, str]:
        procs = _procs()
        pids = {pid: _kind(pid, self.root, procs[pid][1]) for pid in _tree(self.root, procs)}
        for pid, (_parent, cmd) in procs.items():  # the host runs in a session of its own
            if "spark_dilation.transfer.send.streamhost" in cmd and self.tmp in cmd:
                pids[pid] = "streamhost"
        return pids

    def _loop(self) -> None:
        while not self._stop.wait(0.5):
            self.sample()

    def sample(self) -> None:
        """The largest VmRSS of each kind of process; ``ours_total``: the PSS of the
        driver, the host and the workers summed (forked workers share pages)."""
        largest: dict[str, int] = {}
        ours = 0
        for pid, kind in self._pids().items():
            largest[kind] = max(largest.get(kind, 0), _status_kb(pid, "VmRSS"))
            self.hwm[kind] = max(self.hwm.get(kind, 0.0), _status_kb(pid, "VmHWM") / 1024)
            if kind in ("driver", "streamhost", "python_workers"):
                ours += _pss_kb(pid)
        largest["ours_total"] = ours
        peaks = self.peaks.setdefault(self.phase, {})
        for kind, kb in largest.items():
            if kind != "other":
                peaks[kind] = round(max(peaks.get(kind, 0.0), kb / 1024), 1)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


def _read_status(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    return [json.loads(line) for line in lines if line.endswith("}")]


def _wait_for(what: str, ready: Any, timeout: float, run: Run) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        for role, proc in run.procs.items():
            if proc.poll() is not None:
                raise RuntimeError(f"{run.name} {role} ended early: {run.result(role, 5)}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{run.name}: no {what} after {timeout:g} s")
        time.sleep(0.2)


def _percentile(hist: dict[float, int], q: float) -> float | None:
    total = sum(hist.values())
    if not total:
        return None
    rank, seen = q * total, 0
    for value in sorted(hist):
        seen += hist[value]
        if seen >= rank:
            return value
    return max(hist)


# --- cases ---------------------------------------------------------------------------------


def _rate_pair(args: argparse.Namespace, servers: Any, tmp: Path, run: Run, n: int) -> Path:
    """Start the rate sender and the timing receiver; the receiver's status file."""
    code = f"{600 + n}-bench-stream-{run.name}"
    base = tmp / run.name
    common = ["--code", code, "--mailbox", servers.mailbox_url, "--relay", servers.relay_url]
    status = base / "status.jsonl"
    base.mkdir(parents=True)
    run.start("receiver", "_rate_receive", *common, "--stop", str(base / "stop-receiver"),
              "--checkpoint", str(base / "ck-recv"),
              "--pairing", str(base / "pair-recv"), "--status", str(status),
              "--trigger-ms", str(args.receiver_trigger_ms))  # fmt: skip
    run.start("sender", "_rate_send", *common, "--stop", str(base / "stop-sender"),
              "--checkpoint", str(base / "ck-send"),
              "--pairing", str(base / "pair-send"), "--rate", str(args.rate),
              "--partitions", str(args.rate_partitions),
              "--trigger-ms", str(args.sender_trigger_ms))  # fmt: skip
    return status


def _stop_pair(run: Run, tmp: Path) -> dict[str, Any]:
    """The sender first: its query's stop() waits for a commit in flight, which waits
    for the receiving side (up to peer_timeout when that side is gone)."""
    (tmp / run.name / "stop-sender").write_text("stop")
    sent = run.result("sender", 120)
    (tmp / run.name / "stop-receiver").write_text("stop")
    run.result("receiver", 120)
    return sent


def run_latency(args: argparse.Namespace, servers: Any, tmp: Path, n: int) -> dict[str, Any]:
    run = Run(tmp, f"latency-{n}")
    try:
        status = _rate_pair(args, servers, tmp, run, n)
        _wait_for("rows", lambda: any(b["rows"] for b in _read_status(status)), 300, run)
        first = next(b["t"] for b in _read_status(status) if b["rows"])
        start, end = first + args.warmup, first + args.warmup + args.window
        _wait_for("end", lambda: time.time() > end + args.tail, args.warmup + args.window + 60,
                  run)  # fmt: skip
        sent = _stop_pair(run, tmp)
    finally:
        run.kill()
    # Per row (counted by 10 ms of its creation and its sender's micro-batch time):
    # creation -> rows read (the headline), and the spans that add up to it.
    read_hist: dict[float, int] = {}
    to_sent: dict[float, int] = {}
    sent_to_entry: dict[float, int] = {}
    entry_to_read: dict[float, int] = {}
    rows = 0
    for b in _read_status(status):
        for sent_us, gen, count in b["groups"]:
            created = (gen * 10_000 + 5_000) / 1e6
            if not start <= created < end:
                continue
            rows += count
            for hist, span in (
                (read_hist, b["t_end"] - created),
                (to_sent, sent_us / 1e6 - created),
                (sent_to_entry, b["t"] - sent_us / 1e6),
                (entry_to_read, b["t_end"] - b["t"]),
            ):
                key = round(span, 2)
                hist[key] = hist.get(key, 0) + count
    batches = [b for b in _read_status(status) if start <= b["t"] < end]
    return {
        "case": "latency",
        "rate": args.rate,
        "window_s": args.window,
        "rows_measured": rows,
        "rows_per_s_received": round(rows / args.window),
        "p50_s": _percentile(read_hist, 0.50),
        "p99_s": _percentile(read_hist, 0.99),
        "max_s": max(read_hist, default=None),
        "created_to_sent_p50_s": _percentile(to_sent, 0.50),
        "sent_to_entry_p50_s": _percentile(sent_to_entry, 0.50),
        "sent_to_entry_p99_s": _percentile(sent_to_entry, 0.99),
        "entry_to_read_p50_s": _percentile(entry_to_read, 0.50),
        "receiver_batches_in_window": len(batches),
        "sender_batches": sent["batches"],
        "sender_trigger_ms": args.sender_trigger_ms,
        "receiver_trigger_ms": args.receiver_trigger_ms,
    }


def _generate_data(args: argparse.Namespace, tmp: Path) -> Path:
    out = tmp / "bench-parquet"
    run = Run(tmp, "generate")
    try:
        run.start("generate", "_generate", "--rows", str(args.rows), "--files",
                  str(args.files), "--out", str(out))  # fmt: skip
        got = run.result("generate", 1800)
    finally:
        run.kill()
    if got["rows"] != args.rows:
        raise RuntimeError(f"generated {got}")
    return out


def run_throughput(args: argparse.Namespace, servers: Any, tmp: Path, n: int) -> dict[str, Any]:
    source = tmp / "bench-parquet"
    common = ["--mailbox", servers.mailbox_url, "--relay", servers.relay_url,
              "--source", str(source), "--rows", str(args.rows)]  # fmt: skip
    out: dict[str, Any] = {"case": "throughput", "rows": args.rows, "files": args.files}
    for path in ("stream", "batch"):
        run = Run(tmp, f"{path}-{n}")
        base = tmp / run.name
        base.mkdir()
        code = ["--code", f"{500 + n}-bench-{path}"]
        try:
            if path == "stream":
                run.start("receiver", "_stream_receive", *common, *code, "--checkpoint",
                          str(base / "ck-recv"), "--pairing", str(base / "pair-recv"),
                          "--trigger-ms", str(args.receiver_trigger_ms))  # fmt: skip
                run.start("sender", "_stream_send", *common, *code, "--checkpoint",
                          str(base / "ck-send"), "--pairing", str(base / "pair-send"),
                          "--max-files", str(args.max_files))  # fmt: skip
            else:
                run.start("receiver", "_batch_receive", *common, *code)
                run.start("sender", "_batch_send", *common, *code)
            sent = run.result("sender", 3600)
            got = run.result("receiver", 3600)
        finally:
            run.kill()
        rows = got.get("rows")
        if rows != args.rows:
            raise RuntimeError(f"{path}: {rows} rows of {args.rows} arrived")
        t_end = got["t_last"] if path == "stream" else got["t1"]
        seconds = t_end - max(sent["t0"], got["t0"])
        out[f"{path}_seconds"] = round(seconds, 3)
        out[f"{path}_rows_per_s"] = round(args.rows / seconds)
        # Once paired (the receiver's load() returned), to the last row.
        out[f"{path}_paired_seconds"] = round(t_end - got["t_loaded"], 3)
        out[f"{path}_paired_rows_per_s"] = round(args.rows / (t_end - got["t_loaded"]))
        if path == "stream":
            out["stream_batches"] = got["batches"]  # the receiver's, holding rows
            out["stream_first_rows_s"] = round(got["t_first"] - max(sent["t0"], got["t0"]), 3)
    out["ratio_to_batch"] = round(out["stream_rows_per_s"] / out["batch_rows_per_s"], 3)
    out["ratio_to_batch_paired"] = round(
        out["stream_paired_rows_per_s"] / out["batch_paired_rows_per_s"], 3
    )
    out["seconds"] = out["stream_seconds"]
    return out


def run_paused(args: argparse.Namespace, servers: Any, tmp: Path, n: int) -> dict[str, Any]:
    run = Run(tmp, f"paused-{n}")
    sampler = None
    try:
        status = _rate_pair(args, servers, tmp, run, n)
        sampler = RssSampler(run.procs["sender"].pid, tmp)
        _wait_for("rows", lambda: any(b["rows"] for b in _read_status(status)), 300, run)
        first = next(b["t"] for b in _read_status(status) if b["rows"])
        _wait_for("warm-up", lambda: time.time() > first + args.warmup, args.warmup + 60, run)
        receiver = run.procs["receiver"].pid
        paused_pids = _tree(receiver, _procs())
        sampler.phase = "paused"
        t_pause = time.time()
        os.killpg(receiver, signal.SIGSTOP)  # its own session: driver, JVM, workers
        time.sleep(args.pause)
        sampler.sample()
        hwm_paused = dict(sampler.hwm)
        sampler.phase = "catch_up"
        t_resume = time.time()
        os.killpg(receiver, signal.SIGCONT)
        caught = -1.0

        def caught_up() -> bool:
            nonlocal caught
            for b in _read_status(status):
                newest = max(((g[1] + 1) * 0.01 for g in b["groups"]), default=0.0)
                if b["t"] > t_resume and newest >= t_resume:
                    caught = b["t"]
                    return True
            return False

        with contextlib.suppress(TimeoutError):
            _wait_for("catch-up", caught_up, args.catch_up_timeout, run)
        time.sleep(args.tail)
        sampler.stop()
        sent = _stop_pair(run, tmp)
    finally:
        if sampler is not None:
            sampler.stop()
        run.kill()
    batches = _read_status(status)
    rows = sum(b["rows"] for b in batches)
    hi = max((b["hi"] for b in batches if b["hi"] is not None), default=-1)
    lo = min((b["lo"] for b in batches if b["lo"] is not None), default=0)
    after = [b for b in batches if b["t"] > t_resume]
    return {
        "case": "paused",
        "rate": args.rate,
        "pause_s": args.pause,
        "receiver_processes_stopped": len(paused_pids),
        "peak_rss_mb": sampler.peaks,
        "hwm_mb_at_resume": {k: round(v, 1) for k, v in hwm_paused.items() if k != "other"},
        "catch_up_s": round(caught - t_resume, 3) if caught > 0 else None,
        "largest_batch_after_resume": max((b["rows"] for b in after), default=0),
        "rows_received": rows,
        "every_row_once": lo == 0 and rows == hi + 1,
        "sender_batches": sent["batches"],
        "longest_sender_batch_s": round(sent["longest_batch_ms"] / 1000, 1),
        "pause_started_after_first_rows_s": round(t_pause - first, 1),
        "seconds": round(caught - t_resume, 3) if caught > 0 else float("inf"),
    }


RUNNERS = {"latency": run_latency, "throughput": run_throughput, "paused": run_paused}


# --- main ------------------------------------------------------------------------------------


def _median_run(runs: list[dict[str, Any]], key: str) -> dict[str, Any]:
    middle = statistics.median(r[key] for r in runs)
    return dict(min(runs, key=lambda r: abs(r[key] - middle)))


def summarize(case: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    if case == "latency":
        best = _median_run(runs, "p50_s")
        for key in (
            "p50_s",
            "p99_s",
            "max_s",
            "created_to_sent_p50_s",
            "sent_to_entry_p50_s",
            "sent_to_entry_p99_s",
            "entry_to_read_p50_s",
        ):
            best[key] = statistics.median(r[key] for r in runs)
        best["runs"] = [{"p50_s": r["p50_s"], "p99_s": r["p99_s"]} for r in runs]
        return best
    if case == "throughput":
        best = _median_run(runs, "ratio_to_batch")
        keys = ("stream_seconds", "batch_seconds", "ratio_to_batch", "ratio_to_batch_paired")
        best["runs"] = [{k: r[k] for k in keys} for r in runs]
        return best
    best = _median_run(runs, "seconds")
    best.pop("seconds")
    best["runs"] = [
        {"catch_up_s": r["catch_up_s"], "ours_total_paused_mb": r["peak_rss_mb"].get(
            "paused", {}).get("ours_total")} for r in runs
    ]  # fmt: skip
    return best


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1].startswith("_"):
        sys.exit(_helper(sys.argv[1], sys.argv[2:]))
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--quick", action="store_true",
                   help="warm-up 20 s, window 20 s, pause 20 s, 500k rows")  # fmt: skip
    p.add_argument("--rate", type=int, default=10_000, help="rows/s of the rate source")
    p.add_argument("--warmup", type=float, help="seconds after the first rows (default 30)")
    p.add_argument("--window", type=float, help="latency: seconds measured (default 60)")
    p.add_argument("--tail", type=float, default=5.0, help="seconds kept after the window")
    p.add_argument("--pause", type=float, help="paused: seconds stopped (default 120)")
    p.add_argument("--catch-up-timeout", type=float, default=180.0)
    p.add_argument("--rows", type=int, help="throughput: rows (default 3,000,000)")
    p.add_argument("--files", type=int, default=8, help="throughput: Parquet files")
    p.add_argument("--max-files", type=int, default=1, help="throughput: maxFilesPerTrigger")
    p.add_argument("--rate-partitions", type=int, default=0,
                   help="the rate source's numPartitions (0: Spark's default, 2 here)")  # fmt: skip
    p.add_argument("--sender-trigger-ms", type=int, default=500)
    p.add_argument("--receiver-trigger-ms", type=int, default=100)
    p.add_argument("--keep", metavar="DIR", help="work in DIR and keep it (logs, status files)")
    args = p.parse_args()
    quick = args.quick
    for name, full, short in (("warmup", 30.0, 20.0), ("window", 60.0, 20.0),
                              ("pause", 120.0, 20.0), ("rows", 3_000_000, 500_000)):  # fmt: skip
        if getattr(args, name) is None:
            setattr(args, name, short if quick else full)
    cases = [c for c in args.cases.split(",") if c]
    from spark_dilation.testing import running_servers

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    results: dict[str, list[dict[str, Any]]] = {c: [] for c in cases}
    with contextlib.ExitStack() as stack:
        if args.keep:
            tmp = Path(args.keep)
            tmp.mkdir(parents=True, exist_ok=True)
        else:
            tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-stream-")))
        os.environ[TMP_ENV] = str(tmp)
        os.environ.setdefault("SPARK_DILATION_HOME", str(tmp / "home"))
        servers = stack.enter_context(running_servers())
        if "throughput" in cases:
            _generate_data(args, tmp)
        for n in range(args.repeat):
            for case in cases:
                result = RUNNERS[case](args, servers, tmp, n)
                print(f"run {n}: {json.dumps(result)}", file=sys.stderr, flush=True)
                results[case].append(result)
    for case in cases:
        best = summarize(case, results[case])
        best["repeat"] = args.repeat
        print(json.dumps(best), flush=True)


if __name__ == "__main__":
    main()
