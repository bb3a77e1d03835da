"""Meeting by introduction on two clusters of namespace machines: transfers in a row, no stall.

Usage (root: the machines are network namespaces; see
``spark_dilation.testing.netcluster``)::

    sudo .venv/bin/python benchmarks/rendezvous_multimachine.py             # 10 transfers
    sudo .venv/bin/python benchmarks/rendezvous_multimachine.py --runs 3 --keep
    sudo .venv/bin/python benchmarks/rendezvous_multimachine.py --cases show-first
    sudo .venv/bin/python benchmarks/rendezvous_multimachine.py \\
        --runs 20 --loss 0.2 --restart-mailbox   # 10 under faults, 10 without

It starts the two standalone clusters of ``tests/test_multimachine.py`` once
(cluster A writes, cluster B reads, 2 one-core workers each, relay only: the
clusters cannot reach each other), then runs ``--runs`` transfers one after the
other, cycling over the cases:

- ``show-first``: the writer sends 200k rows in 4 partitions; the stepped
  reader's first action is ``show()`` (it reads lane 0 only), then the digest
  of every row.
- ``4-lanes-2-slots``: the reader asks for ``lanes=4`` on its 2 task slots
  (the lanes no slot runs are received on its driver's machine); digest.
- ``more-senders-than-lanes``: the writer has 8 partitions on its machines, the
  reader ``lanes=2``; digest.

With ``--loss P`` or ``--restart-mailbox`` the transfers meet on a mailbox
server of their own (``spark-dilation``'s servers on the services address, an
on-disk database) behind a proxy on that address (``TcpProxy``), and every
other transfer (odd runs) meets under faults: the proxy closes each new
connection on arrival with probability ``P`` (seeded by ``--seed`` and the
run), and ``--restart-mailbox`` kills the mailbox server (SIGKILL, as a crash)
at a seeded moment ``--restart-window`` seconds into the reader's first action
(default 0.2 to 2: the session and the directory links are up; on the 2-core
box the lanes host about 10 s into the action, so 9 to 14 cuts their doors
too), then starts it again on the same port and database. The even runs are
the anchor: the same clusters, server and proxy, no faults.

Each transfer gets a fresh code and ``--timeout`` seconds (300): a transfer
that does not finish in time is a stall, a failed result (both applications
are then killed with their process groups), never a hang. Before the reading
application ends (its lane hosts then delete their staging, logs included),
every machine's helper logs (``**/*.log`` under ``tmp/spark-dilation``) and the
executors' output are copied to the run's folder.

From those logs: for each lane host that received a lane, the seconds from
its ``lane L (epoch E): receiving; a door for each sender named`` to its first
``lane L (epoch E): sender S of lane L connected`` (the hosting-to-first-sender
time), and the lines that say "crowded" (case-insensitive; the drivers' logs
too). One JSON object per run::

    {"case", "run", "ok", "seconds", "loaded_s", "rows", "digest_equal", "connections",
     "hosting_to_first_sender_s": [...], "crowded_lines": N,
     "mailbox_reconnects": {"lane_hosts": N, "other_helpers": N}, ...}

(``mailbox_reconnects``: the helpers' wormholes that lost the mailbox and came
back, from their logs: which meetings a restart cut.)

then one summary object (p50 and p99 of every hosting-to-first-sender time,
stalls, failures, crowded lines), and with faults one more per setting
(``"faults": true/false``: its runs, p50/p99, refused connections, restarts,
and the faulty p50 and p99 as ratios to the anchor's). Exit status 1 if a run failed or a log said
"crowded". ``--keep`` keeps the folder with every log (printed to stderr).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any

PY = sys.executable
ROWS = 200_000
CASES = ("show-first", "4-lanes-2-slots", "more-senders-than-lanes")
# case -> (writer partitions, reader options, reader actions)
PLANS: dict[str, tuple[int, list[str], list[str]]] = {
    "show-first": (4, [], ["show", "digest"]),
    "4-lanes-2-slots": (4, ["lanes=4"], ["digest"]),
    "more-senders-than-lanes": (8, ["lanes=2"], ["digest"]),
}
STAMP = r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) "
HOSTING = re.compile(STAMP + r".*lane (\d+) \(epoch (\d+)\): receiving; a door for each sender")
CONNECTED = re.compile(STAMP + r".*lane (\d+) \(epoch (\d+)\): sender (\d+) of lane \d+ connected")
HELPERS = ("lanehost", "registryhost", "senderhost")
CROWDED = re.compile("crowded", re.IGNORECASE)
RECONNECTED = "reconnected to the mailbox server"


class Stall(Exception):
    """The transfer did not finish within its deadline."""


def _tail(path: Path, n: int = 40) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-n:]) if path.exists() else ""


def _json_line(log: Path, key: str) -> dict[str, Any] | None:
    for line in reversed(log.read_text(errors="replace").splitlines()):
        if line.startswith("{") and f'"{key}"' in line:
            return json.loads(line)
    return None


def _report(log: Path) -> dict[str, Any] | None:
    from spark_dilation.spark.dataset import REPORT_PREFIX

    lines = [ln for ln in log.read_text(errors="replace").splitlines() if REPORT_PREFIX in ln]
    return json.loads(lines[-1].split(REPORT_PREFIX, 1)[1]) if lines else None


def _stamp(text: str) -> float:
    return datetime.strptime(text, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def _percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (``q`` in 0..100)."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * q // 100))  # ceil
    return ordered[int(rank) - 1]


class FlakyMailbox:
    """A mailbox server of the benchmark's own (on-disk database) behind a proxy, both on
    the clusters' services address, that it can make flaky and restart."""

    def __init__(self, ip: str, folder: Path, loss: float) -> None:
        from spark_dilation.testing._proxy import TcpProxy

        self.ip, self.db, self.loss = ip, folder / "mailbox.sqlite", loss
        self.server = self._start(0)
        self.port = self.server.mailbox_port
        # TcpProxy listens on its class's host: the services address, which every
        # namespace machine reaches (loopback would be each machine's own).
        self.proxy = type("ServicesProxy", (TcpProxy,), {"host": ip})(ip, self.port)
        self.url = self.proxy.url()
        self.restarts = 0

    def _start(self, port: int) -> Any:
        from spark_dilation.testing._servers import start_server_process

        return start_server_process(
            interface=self.ip, mailbox_port=port, extra_args=["--channel-db", str(self.db)]
        )

    def faults(self, on: bool, seed: int) -> None:
        self.proxy.refuse_randomly(self.loss if on else 0.0, seed)

    def restart(self) -> None:
        """A crash and a restart on the same port and database."""
        old, self.server = self.server, None
        old.kill()
        old.stderr_path.unlink(missing_ok=True)
        self.server = self._start(self.port)
        self.restarts += 1

    def close(self) -> None:
        self.proxy.close()
        if self.server is not None:
            self.server.stop()
            self.server.stderr_path.unlink(missing_ok=True)


class Run:
    """One transfer: the writer on cluster A, the stepped reader on cluster B."""

    def __init__(
        self, nc: Any, case: str, index: int, folder: Path, timeout: float,
        mailbox_url: str | None = None, restart_at: float | None = None,
        restart: Any = None,
    ) -> None:  # fmt: skip
        self.nc, self.case, self.index, self.folder = nc, case, index, folder
        self.mailbox_url = mailbox_url or nc.mailbox_url
        self.restart_at, self._restart = restart_at, restart
        self.restarted_s: float | None = None
        self.deadline = time.monotonic() + timeout
        self.code = f"{index + 1}-rendezvous-bench"
        self.writer: subprocess.Popen[bytes] | None = None
        self.reader: Any = None
        self.started_wall = time.time()
        folder.mkdir(parents=True)
        # Logs left by earlier runs (a host that did not clean up) are not this run's.
        self.before = {p for _, p in self._helper_logs()}

    def left(self) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise Stall(f"{self.case} run {self.index}: not done by its deadline")
        return left

    def _helper_logs(self) -> list[tuple[Any, Path]]:
        out = []
        for m in self.nc.machines:
            root = m.tmp / "spark-dilation"
            out += [(m, p) for p in (root.rglob("*.log") if root.exists() else ())]
        return out

    def keep_logs(self) -> None:
        """Copy (again: files only grow) every machine's helper logs and executor output."""
        for m, path in self._helper_logs():
            if path in self.before:
                continue
            target = self.folder / "helpers" / m.name / path.relative_to(m.tmp / "spark-dilation")
            target.parent.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(OSError):  # a host may remove it meanwhile
                shutil.copyfile(path, target)
        for app in self.app_ids() or ():
            for m in self.nc.machines:
                for path in (m.dir / "work" / app).glob("*/std*"):
                    target = self.folder / "executors" / m.name / path.relative_to(m.dir / "work")
                    target.parent.mkdir(parents=True, exist_ok=True)
                    with contextlib.suppress(OSError):
                        shutil.copyfile(path, target)

    def app_ids(self) -> set[str]:
        """This run's Spark applications (their work directories), found by start time."""
        ids = set()
        for m in self.nc.machines:
            work = m.dir / "work"
            for d in work.glob("app-*") if work.exists() else ():
                if d.stat().st_mtime >= self.started_wall - 5:
                    ids.add(d.name)
        return ids

    def run(self) -> dict[str, Any]:
        from spark_dilation.testing.stepped_reader import SteppedReader

        partitions, options, actions = PLANS[self.case]
        nc = self.nc
        self.started_wall = time.time()
        started = time.monotonic()
        writer_log = self.folder / "writer.log"
        self.writer = nc.run_driver(
            nc.a,
            [
                PY, "-m", "spark_dilation.testing.spark_peer", "send", "--code", self.code,
                "--mailbox", self.mailbox_url, "--relay", nc.relay_url, "--master", nc.a.master_url,
                "--rows", str(ROWS), "--partitions", str(partitions), "--digest",
            ],
            writer_log,
        )  # fmt: skip
        self.reader = SteppedReader(
            lambda argv, log: nc.run_driver(nc.b, argv, log),
            self.folder / "control",
            self.folder / "reader.log",
            code=self.code, mailbox=self.mailbox_url, relay=nc.relay_url, master=nc.b.master_url,
            options=options,
        )  # fmt: skip
        result: dict[str, Any] = {"case": self.case, "run": self.index, "code": self.code}
        loaded = self._wait(lambda: self.reader.loaded(self.left()))
        if "error" in loaded:
            raise RuntimeError(f"load failed: {loaded['error']}")
        # Both applications' start (Spark) and the code's agreement: not the transfer.
        result["loaded_s"] = round(time.monotonic() - started, 2)
        got: dict[str, Any] = {}
        steps = {}
        timer = None
        if self.restart_at is not None:
            # Mid-rendezvous: the first action is when lanes host and senders meet.
            def restart() -> None:
                self.restarted_s = round(time.monotonic() - started, 2)
                self._restart()

            timer = threading.Timer(self.restart_at, restart)
            timer.start()
        for action in actions:
            got = self._wait(lambda a=action: self.reader.step(a, timeout=self.left()))
            self.keep_logs()
            if "error" in got:
                raise RuntimeError(f"{action} failed: {got['error']}")
            steps[action] = got.get("seconds")
            if action == "show" and got.get("shown") != 5:
                raise RuntimeError(f"show() showed {got.get('shown')} rows, not 5")
        if timer is not None:
            timer.join()
            result["mailbox_restarted_at_s"] = self.restarted_s
        try:
            code = self.writer.wait(self.left())
        except subprocess.TimeoutExpired:
            raise Stall("the writer did not end after the reader's last action") from None
        result["seconds"] = round(time.monotonic() - started, 2)
        result["step_seconds"] = steps
        self.keep_logs()
        sent = _json_line(writer_log, "side")
        if code != 0 or sent is None or "error" in sent:
            raise RuntimeError(f"the writer failed ({code}): {sent}")
        report = _report(writer_log) or {}
        result.update(
            rows=report.get("rows"),
            digest_equal=got.get("digest") == sent.get("digest"),
            connections=report.get("connections"),
            path=report.get("path"),
        )
        if not result["digest_equal"]:
            raise RuntimeError(f"digests differ: {got.get('digest')} vs {sent.get('digest')}")
        if result["rows"] != ROWS:
            raise RuntimeError(f"the report names {result['rows']} rows: {report}")
        stopped = self._wait(lambda: self.reader.step("stop", timeout=self.left()))
        if stopped.get("action") != "stop":
            raise RuntimeError(f"stop: {stopped}")
        self.reader.proc.wait(max(1.0, self.left()))
        self.keep_logs()
        return result

    def _wait(self, fn: Any) -> dict[str, Any]:
        """A stepped reader's wait: past the deadline it is a stall, not a failure."""
        try:
            return fn()
        except AssertionError as e:
            if time.monotonic() >= self.deadline - 0.5:
                raise Stall(str(e).splitlines()[0]) from None
            raise RuntimeError(str(e)[-2000:]) from None

    def kill(self) -> None:
        """SIGKILL both drivers and their JVMs (process groups), as the tests do."""
        procs = [self.writer, self.reader.proc if self.reader is not None else None]
        for proc in procs:
            if proc is not None and proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(30)


def _lane_helpers(nc: Any) -> list[str]:
    """Lane hosts and sender hosts still running on either cluster."""
    found = []
    for m in nc.machines:
        for pid in m.pids():
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if "spark_dilation.transfer." in cmd and any(f".{name} " in cmd for name in HELPERS):
                found.append(f"{m.name}:{pid}")
    return found


def analyse(folder: Path) -> dict[str, Any]:
    """Hosting-to-first-sender times and "crowded" lines from a run's copied logs."""
    times: list[float] = []
    never: list[str] = []
    crowded: list[str] = []
    reconnects = {"lane_hosts": 0, "other_helpers": 0}  # wormholes cut by a mailbox restart
    helpers = folder / "helpers"
    for path in sorted(folder.rglob("*")):
        if not path.is_file() or path.suffix == ".json":
            continue
        hosted: dict[tuple[str, str], float] = {}
        first: dict[tuple[str, str], float] = {}
        for line in path.read_text(errors="replace").splitlines():
            if CROWDED.search(line):
                crowded.append(f"{path.relative_to(folder)}: {line[:300]}")
            if helpers not in path.parents:
                continue  # the lane hosts log to their own files only
            if RECONNECTED in line:
                reconnects["lane_hosts" if "lane-" in str(path) else "other_helpers"] += 1
            if m := HOSTING.match(line):
                hosted.setdefault((m[2], m[3]), _stamp(m[1]))
            elif m := CONNECTED.match(line):
                first.setdefault((m[2], m[3]), _stamp(m[1]))
        for key, t0 in hosted.items():
            if key in first:
                times.append(round(first[key] - t0, 3))
            else:
                never.append(f"{path.relative_to(folder)}: lane {key[0]} epoch {key[1]}")
    return {"times": times, "never": never, "crowded": crowded, "reconnects": reconnects}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=10, help="transfers in a row (cycling the cases)")
    p.add_argument(
        "--cases", default=",".join(CASES), help="comma-separated, from " + ",".join(CASES)
    )
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per transfer")
    p.add_argument("--keep", action="store_true", help="keep the folder with every log")
    p.add_argument(
        "--loss", type=float, default=0.0,
        help="odd runs: the share of new mailbox connections closed on arrival",
    )  # fmt: skip
    p.add_argument(
        "--restart-mailbox", action="store_true",
        help="odd runs: crash and restart the mailbox server (same database) mid-rendezvous",
    )  # fmt: skip
    p.add_argument(
        "--restart-window", default="0.2,2",
        help="LO,HI: the restart comes this many seconds into the reader's first action",
    )  # fmt: skip
    p.add_argument("--seed", type=int, default=1, help="seeds the faults")
    args = p.parse_args()
    if not 0.0 <= args.loss < 1.0:
        p.error("--loss is a probability in [0, 1)")
    faulty = args.loss > 0 or args.restart_mailbox
    try:
        lo, hi = (float(x) for x in args.restart_window.split(","))
    except ValueError:
        p.error("--restart-window is LO,HI in seconds")
    cases = [c for c in args.cases.split(",") if c]
    unknown = set(cases) - set(CASES)
    if unknown or not cases:
        p.error(f"unknown cases {sorted(unknown)}; choose from {', '.join(CASES)}")

    from spark_dilation.testing.netcluster import netns_available, start_net_clusters

    ok, reason = netns_available()
    if not ok:
        print(f"needs network namespaces (run as root): {reason}", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="rendezvous-bench-"))
    results: list[dict[str, Any]] = []
    nc = None
    mailbox: FlakyMailbox | None = None
    try:
        t0 = time.monotonic()
        nc = start_net_clusters(work / "netcluster")
        nc.relay_only()
        if faulty:
            mailbox = FlakyMailbox(nc.services_ip, work, args.loss)
        print(f"clusters up in {time.monotonic() - t0:.0f} s; logs in {work}", file=sys.stderr)
        for i in range(args.runs):
            # Faulty runs cycle the cases too: run i and i + 1 share a case.
            case = cases[(i // 2 if faulty else i) % len(cases)]
            folder = work / f"run-{i:02d}-{case}"
            faults = faulty and i % 2 == 1
            restart_at = None
            if mailbox is not None:
                rng = random.Random(args.seed * 1000 + i)
                mailbox.faults(faults, rng.randrange(2**31))
                if faults and args.restart_mailbox:
                    restart_at = round(rng.uniform(lo, hi), 2)
            refused = mailbox.proxy.refused_connections if mailbox else 0
            run = Run(
                nc, case, i, folder, args.timeout,
                mailbox_url=mailbox.url if mailbox else None,
                restart_at=restart_at, restart=mailbox.restart if mailbox else None,
            )  # fmt: skip
            started = time.monotonic()
            try:
                result = run.run()
                result["ok"] = True
            except Exception as e:
                with contextlib.suppress(Exception):
                    run.keep_logs()
                run.kill()
                result = {
                    "case": case,
                    "run": i,
                    "code": run.code,
                    "ok": False,
                    "stall": isinstance(e, Stall),
                    "error": f"{type(e).__name__}: {e}"[:2000],
                    "seconds": round(time.monotonic() - started, 2),
                }
                for name in ("writer.log", "reader.log"):
                    print(f"--- {folder / name}\n{_tail(folder / name)}", file=sys.stderr)
            if mailbox is not None:
                result["faults"] = faults
                result["refused_connections"] = mailbox.proxy.refused_connections - refused
                mailbox.faults(False, 0)
            # The next transfer starts on idle clusters: the helpers leave with their apps.
            deadline = time.monotonic() + 30
            while (left := _lane_helpers(nc)) and time.monotonic() < deadline:
                time.sleep(0.5)
            if left:
                result["helpers_left"] = left
            found = analyse(folder)
            result["hosting_to_first_sender_s"] = found["times"]
            result["crowded_lines"] = len(found["crowded"])
            result["mailbox_reconnects"] = found["reconnects"]
            if found["never"]:
                result["hosts_without_sender"] = found["never"]
            if found["crowded"]:
                result["crowded"] = found["crowded"][:10]
            result["_times"] = found["times"]
            results.append(result)
            print(json.dumps({k: v for k, v in result.items() if k != "_times"}), flush=True)
    finally:
        if mailbox is not None:
            try:
                mailbox.close()
            except Exception as e:
                print(f"closing the mailbox server: {e}", file=sys.stderr)
        if nc is not None:
            try:
                nc.close()
            except Exception as e:
                print(f"closing the clusters: {e}", file=sys.stderr)
        if args.keep:
            print(f"logs kept in {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)

    times = [t for r in results for t in r["_times"]]
    summary = {
        "summary": True,
        "runs": len(results),
        "ok": sum(r["ok"] for r in results),
        "stalls": sum(bool(r.get("stall")) for r in results),
        "failures": sum(not r["ok"] for r in results),
        "lane_hosts": len(times),
        "hosting_to_first_sender_p50_s": _percentile(times, 50),
        "hosting_to_first_sender_p99_s": _percentile(times, 99),
        "hosting_to_first_sender_max_s": max(times) if times else None,
        "crowded_lines": sum(r["crowded_lines"] for r in results),
        "seconds_p50": statistics.median([r["seconds"] for r in results]) if results else None,
    }
    print(json.dumps(summary), flush=True)
    if faulty:
        p50s: dict[bool, float | None] = {}
        p99s: dict[bool, float | None] = {}
        for setting in (False, True):
            mine = [r for r in results if r.get("faults") is setting]
            ts = [t for r in mine for t in r["_times"]]
            p50s[setting], p99s[setting] = _percentile(ts, 50), _percentile(ts, 99)
            line: dict[str, Any] = {
                "summary": True,
                "faults": setting,
                "loss": args.loss if setting else 0.0,
                "mailbox_restarts": sum(r.get("mailbox_restarted_at_s") is not None for r in mine),
                "runs": len(mine),
                "ok": sum(r["ok"] for r in mine),
                "stalls": sum(bool(r.get("stall")) for r in mine),
                "refused_connections": sum(r.get("refused_connections", 0) for r in mine),
                "lane_hosts": len(ts),
                "hosting_to_first_sender_p50_s": p50s[setting],
                "hosting_to_first_sender_p99_s": p99s[setting],
                "seconds_p50": statistics.median([r["seconds"] for r in mine]) if mine else None,
                "seconds_each": [r["seconds"] for r in mine],
            }
            if setting:
                for name, ps in (("p50", p50s), ("p99", p99s)):
                    base, value = ps[False], ps[True]
                    line[f"{name}_ratio_to_no_faults"] = (
                        round(value / base, 2) if base and value is not None else None
                    )
            print(json.dumps(line), flush=True)
    return 0 if summary["failures"] == 0 and summary["crowded_lines"] == 0 and results else 1


if __name__ == "__main__":
    sys.exit(main())
