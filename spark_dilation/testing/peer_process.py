"""One side of a Spark-to-Spark transfer run as its own process (:mod:`.spark_peer`).

The demo and the tests start two of these, a sender and a receiver::

    receiver = PeerProcess("receive", code, mailbox, relay, logs / "receive.log", "--no-show")
    sender = PeerProcess("send", code, mailbox, relay, logs / "send.log", "--rows", "1000")
    sent, got = sender.result(600), receiver.result(600)
    report = sender.report()  # what the writer's commit() logged

Spark's output (stderr) goes to the log file: it is chatty, and the writer's
transfer report is read back from it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from spark_dilation.errors import DilationError

PEER = [sys.executable, "-m", "spark_dilation.testing.spark_peer"]


class PeerError(DilationError):
    """The peer did not finish, printed no result, or logged no transfer report."""


class PeerProcess:
    """A ``spark_peer`` process: ``side`` is ``send`` or ``receive``; ``args`` go to it as is."""

    def __init__(
        self,
        side: str,
        code: str,
        mailbox: str,
        relay: str | None,
        log: Path,
        *args: str,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.side = side
        self.log = log
        relay_args = ["--relay", relay] if relay else []
        with log.open("w") as stderr:  # the child keeps its own copy of the descriptor
            self.proc = subprocess.Popen(
                [*PEER, side, "--code", code, "--mailbox", mailbox, *relay_args, *args],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=stderr,
                env={**os.environ, **(env or {})},
            )

    def result(self, timeout: float = 600) -> dict[str, Any]:
        """The JSON line the peer printed last (``{"error": ...}`` if it failed)."""
        try:
            stdout, _ = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise PeerError(
                f"the Spark {self.side}er did not finish within {timeout:g} s (its log: {self.log})"
            ) from None
        finally:
            self.kill()  # stopped, or already ended
        lines = [line for line in stdout.decode().splitlines() if line.startswith("{")]
        if not lines:
            raise PeerError(
                f"the Spark {self.side}er exited ({self.proc.returncode}) without a result "
                f"(its log: {self.log}); its end:\n{self.stderr()[-3000:]}"
            )
        return json.loads(lines[-1])

    def stderr(self) -> str:
        return self.log.read_text(errors="replace")

    def report(self) -> dict[str, Any]:
        """The transfer report the writer's ``commit()`` logged (the sender's side)."""
        return transfer_report(self.stderr(), self.log)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def transfer_report(text: str, where: Path) -> dict[str, Any]:
    """The last transfer report a writer's ``commit()`` logged in ``text`` (from ``where``)."""
    from spark_dilation.spark.dataset import REPORT_PREFIX

    lines = [line for line in text.splitlines() if line.startswith(REPORT_PREFIX)]
    if not lines:
        raise PeerError(f"the writer's commit() logged no transfer report ({where})")
    return json.loads(lines[-1][len(REPORT_PREFIX) :])
