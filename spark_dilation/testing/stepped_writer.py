"""A sending Spark application that writes one dataset per step, on one long-lived session.

A fault test that repeats a case many times (a reader killed, a reader's disk
full) needs a fresh reading application each time, but not a fresh writer:
this one starts once and serves every round::

    python -m spark_dilation.testing.stepped_writer --mailbox URL --relay URL \\
        --master local[2,2] --control DIR [--conf KEY=VALUE ...]

It writes ``DIR/loaded.json`` once its session is up, then answers each
``DIR/step-N.json`` (see :mod:`.stepped_reader`, whose loop it shares):
``{"action": "send", "code": C, "rows": N, "partitions": P, "shape": S,
"options": {...}}`` writes :func:`.spark_peer.generate`'s dataset with
``format("dilation")``, and the result is ``{"seconds", "t1"}`` (``t1``:
``time.time()`` when ``save()`` returned or raised) or ``{"error": ...}``.
``stop`` stops the session.
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
from .spark_peer import generate, session
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
    ) -> None:
        control.mkdir(parents=True)
        argv = [
            sys.executable, "-m", "spark_dilation.testing.stepped_writer",
            "--mailbox", mailbox, "--master", master, "--control", str(control),
        ]  # fmt: skip
        if relay:
            argv += ["--relay", relay]
        for item in conf:
            argv += ["--conf", item]
        super().__init__(start(argv, log), control, log)

    def send(
        self, code: str, rows: int, partitions: int, shape: str = "bench", **options: str
    ) -> None:
        """Start one write of ``format("dilation")`` ``options`` (its result: :meth:`result`)."""
        self.start(
            "send", code=code, rows=rows, partitions=partitions, shape=shape, options=options
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mailbox", required=True)
    p.add_argument("--relay")
    p.add_argument("--master", required=True)
    p.add_argument("--control", required=True)
    p.add_argument("--conf", action="append", default=[], help="KEY=VALUE for the SparkSession")
    p.add_argument("--step-timeout", type=float, default=900.0)
    args = p.parse_args(argv)
    control = Path(args.control)
    base = {"mailbox": args.mailbox, **({"relay": args.relay} if args.relay else {})}
    spark = session(
        args.master, "spark-dilation-stepped-writer", dict(c.split("=", 1) for c in args.conf)
    )

    def send(step: dict[str, Any]) -> dict[str, Any]:
        if step["action"] != "send":
            raise ValueError(f"unknown action {step['action']!r}")
        df = generate(spark, int(step["rows"]), int(step["partitions"]), step.get("shape", "bench"))
        options = {**base, **step.get("options", {}), "code": step["code"]}
        try:
            df.write.format("dilation").options(**options).mode("append").save()
        except Exception as e:  # one line for the test; the traceback went to stderr
            return {"error": f"{type(e).__name__}: {e}"[:4000], "t1": time.time()}
        return {"t1": time.time()}

    atomic_write(control / "loaded.json", json.dumps({"ready": True}))
    return serve_steps(control, args.step_timeout, send, spark.stop)


if __name__ == "__main__":
    sys.exit(main())
