"""Time from start to the code prompt: `spark-dilation receive` against `wormhole receive`.

Each run starts the command on a pseudo-terminal against a local mailbox server
and times the first "Enter receive wormhole code" it prints; the command is
then killed. One JSON object per command with the median of ``--repeat`` runs,
and the ratio to the reference (the anchor) measured in the same run::

    .venv/bin/python benchmarks/cli_prompt.py --repeat 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from spark_dilation.testing import running_servers
from spark_dilation.testing.terminal import Terminal

PROMPT = "Enter receive wormhole code"


def time_to_prompt(argv: list[str], timeout: float = 30.0) -> float:
    started = time.monotonic()
    term = Terminal(argv).start()
    try:
        return term.wait_for(PROMPT, timeout) - started
    finally:
        term.kill()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=5)
    args = p.parse_args()
    bin_dir = Path(sys.executable).parent
    with running_servers() as servers:
        commands = {
            "wormhole receive": [
                str(bin_dir / "wormhole"), "--relay-url", servers.mailbox_url, "receive",
            ],
            "spark-dilation receive": [
                sys.executable, "-m", "spark_dilation.cli", "receive",
                "--mailbox", servers.mailbox_url,
            ],
        }  # fmt: skip
        times: dict[str, list[float]] = {name: [] for name in commands}
        for _ in range(args.repeat):  # interleaved: both see the same machine load
            for name, argv in commands.items():
                times[name].append(time_to_prompt(argv))
    anchor = statistics.median(times["wormhole receive"])
    for name, runs in times.items():
        median = statistics.median(runs)
        print(json.dumps({
            "case": name, "runs": len(runs), "median_s": round(median, 3),
            "all_s": [round(t, 3) for t in runs], "ratio_to_reference": round(median / anchor, 2),
        }))  # fmt: skip


if __name__ == "__main__":
    main()
