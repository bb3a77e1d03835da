"""The suite's own plugins, each in an inner pytest run of its own.

The leftover check (spark_dilation.testing.leftovers): one test plants a file
in /tmp, a process of the run and a network namespace (whose mount under
/run/netns comes with it); the run must fail naming each, and kill the process.
A clean inner run, whose temp files go where the plugin points TMPDIR, passes.
The live failure line (spark_dilation.testing.live_failures) comes before the
summary, with and without xdist.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from spark_dilation.testing.leftovers import RUN_MARK, SYSTEM_TMP
from spark_dilation.testing.waiting import wait_until

pytestmark = pytest.mark.integration

PLANTING = """\
import subprocess, tempfile

def test_plants():
    open({file!r}, "w").close()
    subprocess.Popen(["sleep", "300"], start_new_session=True)
    subprocess.run(["ip", "netns", "add", {ns!r}], check=True)
"""

CLEAN = """\
import os, subprocess, sys, tempfile

def test_leaves_nothing(tmp_path):
    fd, name = tempfile.mkstemp(prefix="kept-by-pytest-")
    os.close(fd)
    assert not name.startswith("/tmp/kept"), name  # TMPDIR points into pytest's folders
    (tmp_path / "x").write_text("pytest's own")
    subprocess.run([sys.executable, "-c", "pass"], check=True)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _inner_run(
    tmp_path: Path, source: str, *args: str, plugin: str = "spark_dilation.testing.leftovers"
) -> subprocess.CompletedProcess[str]:
    (tmp_path / "inner").mkdir()
    test = tmp_path / "inner" / "test_inner.py"
    test.write_text(source)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTEST_ADDOPTS", RUN_MARK)}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", plugin, "-p", "no:cacheprovider", "-q",
         f"--basetemp={tmp_path / 'base'}", *args, str(test)],
        cwd=tmp_path / "inner", env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_a_planted_file_process_and_namespace_fail_the_run(tmp_path: Path) -> None:
    tag = uuid.uuid4().hex[:8]
    planted = SYSTEM_TMP / f"spark-dilation-planted-{tag}"
    ns = f"sdplant-{tag}"
    try:
        run = _inner_run(tmp_path, PLANTING.format(file=str(planted), ns=ns))
        out = run.stdout + run.stderr
        print(out)
        assert run.returncode == 1, out
        assert "1 passed" in out, out  # the test passed: the check failed the run
        assert f"left behind: file {planted}" in out, out
        assert f"left behind: network namespace {ns}" in out, out
        assert f"left behind: mount /run/netns/{ns}" in out, out
        sleeper = [line for line in out.splitlines() if "left behind: process" in line]
        assert len(sleeper) == 1 and sleeper[0].endswith("sleep 300"), out
        pid = int(sleeper[0].split("left behind: process ")[1].split()[0])
        # Reported, then killed (and reaped by init).
        wait_until("the planted sleeper to be gone", lambda: not _alive(pid), 5)
    finally:
        planted.unlink(missing_ok=True)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)


def test_a_clean_run_passes(tmp_path: Path) -> None:
    run = _inner_run(tmp_path, CLEAN)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out
    assert "left behind" not in out, out
    assert list((tmp_path / "base" / "tmp").glob("kept-by-pytest-*")), "TMPDIR was not redirected"


FAILING = """\
def test_fails_first():
    assert 1 + 1 == 3, "arithmetic"

def test_then_another():
    pass
"""


@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["serial", "xdist"])
def test_a_failure_is_printed_when_it_happens(tmp_path: Path, workers: list[str]) -> None:
    """One line per failure as its report arrives (under xdist too), before the summary."""
    run = _inner_run(tmp_path, FAILING, *workers, plugin="spark_dilation.testing.live_failures")
    out = run.stdout
    assert run.returncode == 1, out
    live = [line for line in out.splitlines() if line.startswith("FAILED test_inner.py::")]
    assert live and "test_fails_first (" in live[0] and "arithmetic" in live[0], out
    assert out.index(live[0]) < out.index("short test summary"), out
