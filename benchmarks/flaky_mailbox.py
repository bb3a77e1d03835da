"""CLI dataset transfers through a flaky network in front of the mailbox server.

A loopback proxy in front of the real mailbox server closes each new
connection on arrival with probability ``--loss`` (seeded per transfer), as a
flaky network or a middlebox would; the anchor is the same transfers with no
loss, interleaved with them in the same run. Each transfer is one
``spark-dilation send`` of a Parquet file (2 lanes on the receiver) and one
``spark-dilation receive``; its outcome is ``exact`` (both exit 0 and the rows
match), ``failed`` (an exit code, with the sender's and the receiver's last
error lines) or ``stalled`` (still running after ``--deadline`` s). One JSON
object per transfer, then one per case with the counts and the median and
p90 of the time from the sender's start to the receiver's end::

    .venv/bin/python benchmarks/flaky_mailbox.py --transfers 10 --loss 0.2
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from spark_dilation.testing import running_servers
from spark_dilation.testing._proxy import TcpProxy

CLI = [sys.executable, "-m", "spark_dilation.cli"]


def last_error(text: str) -> str:
    lines = [line for line in text.splitlines() if "error" in line.lower()]
    return (lines or text.splitlines() or [""])[-1][:300]


def transfer(
    folder: Path, source: Path, code: str, mailbox: str, relay: str, deadline: float
) -> dict[str, object]:
    out = folder / "out"
    common = ["--mailbox", mailbox, "--relay", relay]
    started = time.monotonic()
    with (folder / "send.log").open("w") as slog, (folder / "receive.log").open("w") as rlog:
        sender = subprocess.Popen(
            [*CLI, "send", *common, "--code", code, str(source)],
            stdout=slog, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True,
        )  # fmt: skip
        receiver = subprocess.Popen(
            [*CLI, "receive", *common, "--lanes", "2", "-o", str(out), code],
            stdout=rlog, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True,
        )  # fmt: skip
        outcome = "exact"
        try:
            for proc in (receiver, sender):
                proc.wait(max(0.1, started + deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            outcome = "stalled"
        took = time.monotonic() - started
        for proc in (sender, receiver):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    result: dict[str, object] = {"seconds": round(took, 2)}
    if outcome == "exact" and (sender.returncode or receiver.returncode):
        outcome = "failed"
    if outcome == "exact":
        got = pq.read_table(out).sort_by("id")
        if not got.equals(pq.read_table(source).sort_by("id")):
            outcome = "failed"
            result["why"] = "rows differ"
    if outcome != "exact":
        result["sender"] = last_error((folder / "send.log").read_text(errors="replace"))
        result["receiver"] = last_error((folder / "receive.log").read_text(errors="replace"))
    result["outcome"] = outcome
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--transfers", type=int, default=10, help="transfers per case")
    p.add_argument("--loss", type=float, default=0.2, help="share of new connections closed")
    p.add_argument("--rows", type=int, default=200_000)
    p.add_argument("--deadline", type=float, default=120.0, help="s before a transfer stalled")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="flaky-mailbox-") as tmp, running_servers() as srv:
        root = Path(tmp)
        source = root / "data.parquet"
        ids = pa.array(range(args.rows), pa.int64())
        pq.write_table(pa.table({"id": ids, "s": [f"row-{i}" for i in range(args.rows)]}), source)
        results: dict[str, list[dict[str, object]]] = {"no loss": [], f"loss {args.loss}": []}
        with TcpProxy("127.0.0.1", srv.mailbox_port) as proxy:
            for i in range(args.transfers):  # interleaved: both cases see the same machine
                for case, loss in (("no loss", 0.0), (f"loss {args.loss}", args.loss)):
                    proxy.refuse_randomly(loss, seed=i)
                    refused = proxy.refused_connections
                    folder = root / f"{case.replace(' ', '-')}-{i}"
                    folder.mkdir()
                    code = f"{9000 + 2 * i + (loss > 0)}-flaky-trial"
                    one = transfer(folder, source, code, proxy.url(), srv.relay_url, args.deadline)
                    one.update(case=case, transfer=i, refused=proxy.refused_connections - refused)
                    results[case].append(one)
                    print(json.dumps(one), flush=True)
    anchor = statistics.median(float(r["seconds"]) for r in results["no loss"])  # type: ignore[arg-type]
    for case, runs in results.items():
        times = sorted(float(r["seconds"]) for r in runs)  # type: ignore[arg-type]
        counts = {k: sum(r["outcome"] == k for r in runs) for k in ("exact", "failed", "stalled")}
        median = statistics.median(times)
        print(json.dumps({
            "case": case, "transfers": len(runs), **counts,
            "refused_connections": sum(int(r["refused"]) for r in runs),  # type: ignore[call-overload]
            "median_s": round(median, 2), "p90_s": times[max(0, round(0.9 * len(times)) - 1)],
            "all_s": [r["seconds"] for r in runs], "ratio_to_no_loss": round(median / anchor, 2),
        }))  # fmt: skip


if __name__ == "__main__":
    main()
