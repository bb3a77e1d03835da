"""A Spark application that sends (or receives) one dataset per step, on one long-lived session.

A fault test that repeats a case many times (a reader killed, a reader's disk
full) needs a fresh reading application each time, but not a fresh writer:
this one starts once and serves every round; and cases that only need the same
kind of application (``local[2,2]``, a local cluster) share one, a failed case
included::

    python -m spark_dilation.testing.stepped_writer --mailbox URL --relay URL \\
        --master local[2,2] --control DIR [--conf KEY=VALUE ...] [--executors N]

It writes ``DIR/loaded.json`` once its session is up (with ``--executors``, once
that many executors registered), then answers each ``DIR/step-N.json`` (see
:mod:`.stepped_reader`, whose loop it shares):

- ``{"action": "send", "code": C, "rows": N, "partitions": P, "shape": S,
  "options": {...}, "expected": DIR}`` writes :func:`.spark_peer.generate`'s
  dataset with ``format("dilation")`` (first as Parquet to ``expected``, if
  given); the result is ``{"seconds", "t1"}`` (``t1``: ``time.time()`` when
  ``save()`` returned or raised) or ``{"error": ...}``;
- ``{"action": "receive", "code": C, "options": {...}, "out": DIR}`` loads it,
  counts it and writes it as Parquet to ``out``: ``{"count"}`` or ``{"error"}``;
- ``stop`` stops the session.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ..transfer.machine import atomic_write
from .spark_peer import generate, session, wait_for_executors
from .stepped_reader import SteppedApp, serve_steps


class SteppedWriter(SteppedApp):
    """Start the writing application (``start(argv, log)`` returns its ``Popen``)."""

    def __init__(
        self,
        start: Callable[[list[str], Path], subprocess.Popen[bytes]],
        control: Path,
        log: Path,
        *,
        mailbox: str,
        relay: str | None,
        master: str,
        conf: Sequence[str] = (),
        executors: int = 0,
    ) -> None:
        control.mkdir(parents=True)
        argv = [
            sys.executable, "-m", "spark_dilation.testing.stepped_writer",
            "--mailbox", mailbox, "--master", master, "--control", str(control),
            "--executors", str(executors),
        ]  # fmt: skip
        if relay:
            argv += ["--relay", relay]
        for item in conf:
            argv += ["--conf", item]
        super().__init__(start(argv, log), control, log)

    def send(
        self,
        code: str,
        rows: int,
        partitions: int,
        shape: str = "bench",
        expected: Path | None = None,
        **options: str,
    ) -> None:
        """Start one write of ``format("dilation")`` ``options`` (its result: :meth:`result`)."""
        extra = {"expected": str(expected)} if expected is not None else {}
        self.start(
            "send", code=code, rows=rows, partitions=partitions, shape=shape, options=options,
            **extra,
        )  # fmt: skip

    def receive(self, code: str, out: Path, **options: str) -> None:
        """Start one load of ``code``, its count and its Parquet copy in ``out``."""
        self.start("receive", code=code, out=str(out), options=options)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mailbox", required=True)
    p.add_argument("--relay")
    p.add_argument("--master", required=True)
    p.add_argument("--control", required=True)
    p.add_argument("--conf", action="append", default=[], help="KEY=VALUE for the SparkSession")
    p.add_argument("--step-timeout", type=float, default=900.0)
    p.add_argument("--executors", type=int, default=0, help="wait for this many executors")
    args = p.parse_args(argv)
    control = Path(args.control)
    base = {"mailbox": args.mailbox, **({"relay": args.relay} if args.relay else {})}
    spark = session(
        args.master, "spark-dilation-stepped-writer", dict(c.split("=", 1) for c in args.conf)
    )
    if args.executors:
        wait_for_executors(spark, args.executors)

    def send(step: dict[str, Any]) -> dict[str, Any]:
        df = generate(spark, int(step["rows"]), int(step["partitions"]), step.get("shape", "bench"))
        if step.get("expected"):
            df.write.mode("overwrite").parquet(step["expected"])
        options = {**base, **step.get("options", {}), "code": step["code"]}
        try:
            df.write.format("dilation").options(**options).mode("append").save()
        except Exception as e:  # one line for the test; the traceback went to stderr
            return {"error": f"{type(e).__name__}: {e}"[:4000], "t1": time.time()}
        return {"t1": time.time()}

    def receive(step: dict[str, Any]) -> dict[str, Any]:
        options = {**base, **step.get("options", {}), "code": step["code"]}
        df = spark.read.format("dilation").options(**options).load()
        count = df.count()
        df.write.mode("overwrite").parquet(step["out"])
        return {"count": count}

    def run(step: dict[str, Any]) -> dict[str, Any]:
        actions = {"send": send, "receive": receive}
        if step["action"] not in actions:
            raise ValueError(f"unknown action {step['action']!r}")
        return actions[step["action"]](step)

    atomic_write(control / "loaded.json", json.dumps({"ready": True}))
    return serve_steps(control, args.step_timeout, run, spark.stop)


if __name__ == "__main__":
    sys.exit(main())
