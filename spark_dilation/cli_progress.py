"""What ``spark-dilation send``/``receive`` show while data moves.

Four modes, picked from the command line and the terminal:

* ``bar``: a live ``tqdm`` bar on a terminal's stderr (rows or bytes, rate,
  ETA when the total is known, path and reconnects in the postfix), with a
  line for each connection path change, each lost connection and each
  reconnect;
* ``plain``: stderr is not a terminal (a log file, a CI job): only those
  event lines and the final summary, no carriage returns;
* ``quiet`` (``--quiet``): only the code banner, the result and errors;
* ``json`` (``--json``): one JSON object per line on stdout, for scripts
  (``{"event": "code" | "connected" | "reconnect" | "progress" | "done" |
  "text" | "error", ...}``).

tqdm rather than rich: it is one small pure-Python module with no
dependencies of its own, it already comes with the Spark/pandas stack in
most environments, and a single-line bar is all we draw.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from typing import Any, TextIO

from .transfer.rules.report import Progress, path_of

MODES = ("bar", "plain", "quiet", "json")


def pick_mode(quiet: bool, as_json: bool, err: TextIO) -> str:
    if as_json:
        return "json"
    if quiet:
        return "quiet"
    isatty = getattr(err, "isatty", None)
    return "bar" if isatty is not None and isatty() else "plain"


class Reporter:
    """Turns :class:`Progress` snapshots and events into the chosen mode's output."""

    def __init__(self, mode: str, out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> None:
        assert mode in MODES
        self.mode = mode
        self.out = out
        self.err = err
        self._bar: Any = None
        self._moving = False  # the bar's clock runs (rows have moved)
        self._lock = threading.Lock()
        self._path = "unknown"
        self._reconnects = 0
        self._down = False  # every connection is down and a reconnect is under way
        self._last_json = 0.0

    # --- events ----------------------------------------------------------------------

    def emit(self, event: str, **fields: Any) -> None:
        """A JSON line on stdout (json mode only)."""
        if self.mode == "json":
            with self._lock:
                self.out.write(json.dumps({"event": event, **fields}) + "\n")
                self.out.flush()

    def say(self, text: str) -> None:
        """A line for people on stderr (not in quiet or json mode)."""
        if self.mode in ("bar", "plain"):
            self._line(text)

    def _line(self, text: str) -> None:
        with self._lock:
            if self._bar is not None:
                self._bar.write(text, file=self.err)
            else:
                print(text, file=self.err, flush=True)

    # --- progress ---------------------------------------------------------------------

    def saw_path(self, path: str) -> None:
        """The connection path was already announced (no "connected:" line for it)."""
        self._path = path
        self.emit("connected", path=path, connections=1)

    def progress(self, p: Progress) -> None:
        """One snapshot: path changes and reconnects become lines, the rest the bar."""
        if p.reconnecting and p.path == "unknown":
            # Every connection is down and being re-established. (A path alone
            # going unknown is no sign: connections also end with the transfer.)
            if not self._down:
                self._down = True
                self.say("connection lost: reconnecting..")
        elif p.path != "unknown":
            self._down = False
            if p.path != self._path:
                self._path = p.path
                self.say(f"connected: {p.path} ({p.connections} connection(s))")
                self.emit("connected", path=p.path, connections=p.connections)
            if p.reconnects > self._reconnects:
                self._reconnects = p.reconnects
                self.say(
                    f"connection dropped and came back ({p.path}): "
                    f"{p.reconnects} reconnect(s) so far"
                )
                self.emit("reconnect", reconnects=p.reconnects, path=p.path)
        if self.mode == "json":
            now = time.monotonic()
            if p.done or now - self._last_json >= 1.0:
                self._last_json = now
                self.emit("progress", **p.to_dict())
        elif self.mode == "bar":
            self._draw(p)
            if p.done:
                self.close()  # the rate stays as it was when the data had arrived

    def _draw(self, p: Progress) -> None:
        from tqdm import tqdm

        by_rows = p.total_rows is not None or (p.side == "send" and not p.total_bytes)
        with self._lock:
            if self._bar is None:
                self._bar = tqdm(
                    total=p.total_rows if by_rows else p.total_bytes,
                    unit=" rows" if by_rows else "B",
                    unit_scale=True,
                    unit_divisor=1000,  # MB = 10^6 bytes, as in the summaries
                    file=self.err,
                    dynamic_ncols=True,
                    mininterval=0.2,
                    desc="sending" if p.side == "send" else "receiving",
                    leave=True,
                    smoothing=0,  # the average since the start: partitions land in jumps
                )
                self._moving = False
            bar = self._bar
            if not self._moving:
                # The clock of the rate and ETA starts when the first rows move, not
                # when the transfer started: meeting and connecting (seconds on a
                # busy machine) are not the link's rate, and counting them made the
                # ETA 40 % long 5 s in. Snapshots come every 0.5 s: the first rows
                # moved about a quarter second before this one.
                self._moving = bool(p.rows or p.bytes)
                bar.start_t = bar._time() - (min(0.25, p.seconds) if self._moving else 0.0)
            bar.n = p.rows if by_rows else p.bytes
            # tqdm shows the count and its rate; the postfix adds the other unit.
            if by_rows:
                postfix = [size_text(p.bytes), f"{size_text(p.bytes_per_s)}/s"]
            else:
                postfix = [f"{p.rows:,} rows"] if p.rows else []
            if self._down:
                postfix.append("reconnecting")
            else:
                postfix.append("connecting" if p.connecting and p.path == "unknown" else p.path)
            postfix.append(f"{p.reconnects} reconnect(s)")
            bar.set_postfix_str(", ".join(postfix), refresh=False)
            bar.refresh()

    def file_meter(self, side: str, total_bytes: int) -> FileMeter:
        return FileMeter(self, side, total_bytes)

    def close(self) -> None:
        """End the bar (before the summary or an error line)."""
        with self._lock:
            if self._bar is not None:
                self._bar.close()
                self._bar = None


class FileMeter:
    """Progress of a classic Transit file: byte callbacks on the reactor, throttled."""

    def __init__(self, reporter: Reporter, side: str, total_bytes: int) -> None:
        self.reporter = reporter
        self.side = side
        self.total = total_bytes
        self.got = 0
        self.path = "unknown"
        self.started = time.monotonic()
        self._last = 0.0

    def status(self, text: str) -> None:
        """``on_status`` of the file transfer: "sending (direct ...)"."""
        self.reporter.say(text.capitalize() + "..")  # "Sending (direct ...).." as before
        if text.startswith(("sending", "receiving")):
            self.path = path_of(text)
            self.reporter.saw_path(self.path)  # the line above already said it
            self.started = time.monotonic()
            self._report(False)

    def __call__(self, n: int) -> None:
        self.got += n
        now = time.monotonic()
        if now - self._last >= 0.2 or self.got >= self.total:
            self._last = now
            self._report(self.got >= self.total)

    def _report(self, done: bool) -> None:
        self.reporter.progress(
            Progress(
                side=self.side,
                rows=0,
                bytes=self.got,
                seconds=time.monotonic() - self.started,
                total_bytes=self.total,
                connections=1 if self.path != "unknown" else 0,
                path=self.path,
                done=done,
            )
        )


def size_text(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")
