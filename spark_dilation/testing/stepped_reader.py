"""A receiving Spark application that runs actions on one loaded DataFrame when told to.

Multi-machine tests change the cluster between actions (lose a worker, add
one) and check each action's result::

    python -m spark_dilation.testing.stepped_reader --code C --mailbox URL --relay URL \\
        --master spark://... --control DIR [--option KEY=VALUE ...]

It loads the dataset, writes ``DIR/loaded.json``, then waits for
``DIR/step-N.json`` (``{"action": A}``, N = 1, 2, ...) and answers each with
``DIR/result-N.json``: ``{"action", "seconds", ...}`` and the action's result,
or ``{"error": "Class: message"}``. Actions: ``show`` (rows shown), ``digest``
(see :func:`.spark_peer.digest`), ``count``, ``filter_count`` (rows with an
even ``id``), ``parquet`` (write to ``{"path"}``, read back, digest) and
``stop``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from ..transfer.machine import atomic_write
from .spark_peer import digest, session


def _write(path: Path, body: dict[str, Any]) -> None:
    atomic_write(path, json.dumps(body))


def run_action(spark: Any, df: Any, step: dict[str, Any]) -> dict[str, Any]:
    action = step["action"]
    if action == "show":
        rows = df.limit(5).collect()  # what show() runs: lane 0 first, more only if short
        df.show(3, truncate=30)
        return {"shown": len(rows)}
    if action == "digest":
        return {"digest": digest(df)}
    if action == "count":
        return {"count": df.count()}
    if action == "filter_count":
        return {"count": df.filter("id % 2 = 0").count()}
    if action == "parquet":
        df.write.mode("overwrite").parquet(step["path"])
        return {"digest": digest(spark.read.parquet(step["path"]))}
    raise ValueError(f"unknown action {action!r}")


class SteppedApp:
    """The test's side of a stepped application (a reader here, or a
    :mod:`.stepped_writer`): ``proc`` runs it; ``step(action)`` and read each result."""

    def __init__(self, proc: subprocess.Popen[bytes], control: Path, log: Path) -> None:
        self.proc, self.control, self.log = proc, control, log
        self.step_no = 0

    def logged(self, since: int = 0) -> str:
        """Its log from byte ``since`` on (:meth:`log_size` before a step: that step's)."""
        with self.log.open("rb") as f:
            f.seek(since)
            return f.read().decode(errors="replace")

    def log_size(self) -> int:
        return self.log.stat().st_size if self.log.exists() else 0

    @contextlib.contextmanager
    def running(self) -> Iterator[SteppedApp]:
        """Loaded (else fails), then stopped at the end; SIGKILLed with its process
        group (started in a session of its own) if it did not stop."""
        try:
            loaded = self.loaded()
            assert "error" not in loaded, f"{loaded}\n{self.logged()[-3000:]}"
            yield self
            assert self.step("stop", timeout=120)["action"] == "stop"
            self.proc.wait(60)
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()

    def loaded(self, timeout: float = 300) -> dict[str, Any]:
        return self._wait("loaded.json", timeout)

    def step(self, action: str, timeout: float = 600, **extra: Any) -> dict[str, Any]:
        self.start(action, **extra)
        return self.result(timeout)

    def start(self, action: str, **extra: Any) -> None:
        self.step_no += 1
        _write(self.control / f"step-{self.step_no}.json", {"action": action, **extra})

    def result(self, timeout: float = 600) -> dict[str, Any]:
        return self._wait(f"result-{self.step_no}.json", timeout)

    def _wait(self, name: str, timeout: float) -> dict[str, Any]:
        path = self.control / name
        deadline = time.monotonic() + timeout
        while not path.exists():
            if time.monotonic() > deadline or self.proc.poll() is not None:
                tail = self.log.read_text(errors="replace")[-3000:] if self.log.exists() else ""
                raise AssertionError(f"no {name} in {timeout:g} s (or the app ended):\n{tail}")
            time.sleep(0.1)
        return json.loads(path.read_text())


class SteppedReader(SteppedApp):
    """Start the reading application (``start(argv, log)`` returns its ``Popen``)."""

    def __init__(
        self,
        start: Callable[[list[str], Path], subprocess.Popen[bytes]],
        control: Path,
        log: Path,
        *,
        code: str,
        mailbox: str,
        relay: str | None,
        master: str,
        options: Sequence[str] = (),
    ) -> None:
        control.mkdir(parents=True)
        argv = [
            sys.executable, "-m", "spark_dilation.testing.stepped_reader", "--code", code,
            "--mailbox", mailbox, "--master", master, "--control", str(control),
        ]  # fmt: skip
        if relay:
            argv += ["--relay", relay]
        for option in options:
            argv += ["--option", option]
        super().__init__(start(argv, log), control, log)


def serve_steps(
    control: Path,
    step_timeout: float,
    run: Callable[[dict[str, Any]], dict[str, Any]],
    stop: Callable[[], None],
) -> int:
    """Answer ``step-N.json`` with ``result-N.json`` (``run(step)``, or its error) until
    ``stop`` (answered once ``stop()`` returned); 2 if no step came within ``step_timeout``."""
    n = 1
    while True:
        path = control / f"step-{n}.json"
        deadline = time.monotonic() + step_timeout
        while not path.exists():
            if time.monotonic() > deadline:
                return 2
            time.sleep(0.05)
        step = json.loads(path.read_text())
        if step["action"] == "stop":
            stop()
            _write(control / f"result-{n}.json", {"action": "stop"})
            return 0
        started = time.monotonic()
        try:
            result = run(step)
        except Exception as e:  # one line for the test; the traceback went to stderr
            result = {"error": f"{type(e).__name__}: {e}"[:4000]}
        result.update(action=step["action"], seconds=round(time.monotonic() - started, 2))
        _write(control / f"result-{n}.json", result)
        n += 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--code", required=True)
    p.add_argument("--mailbox", required=True)
    p.add_argument("--relay")
    p.add_argument("--master", required=True)
    p.add_argument("--control", required=True)
    p.add_argument("--option", action="append", default=[], help="KEY=VALUE for format(dilation)")
    p.add_argument("--conf", action="append", default=[], help="KEY=VALUE for the SparkSession")
    p.add_argument("--step-timeout", type=float, default=900.0)
    args = p.parse_args(argv)
    control = Path(args.control)
    options = dict(o.split("=", 1) for o in args.option)
    options.update(code=args.code, mailbox=args.mailbox)
    if args.relay:
        options["relay"] = args.relay
    spark = session(
        args.master, "spark-dilation-stepped-reader", dict(c.split("=", 1) for c in args.conf)
    )
    try:
        df = spark.read.format("dilation").options(**options).load()
    except Exception as e:
        _write(control / "loaded.json", {"error": f"{type(e).__name__}: {e}"[:4000]})
        return 1
    _write(control / "loaded.json", {"schema": df.schema.json()})
    return serve_steps(
        control, args.step_timeout, lambda step: run_action(spark, df, step), spark.stop
    )


if __name__ == "__main__":
    sys.exit(main())
