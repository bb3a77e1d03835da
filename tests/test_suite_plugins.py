"""The suite's own plugins, each in an inner pytest run of its own.

The leftover check (spark_dilation.testing.leftovers): one test plants a file
in the run's temp folder, a process of the run and a network namespace with the
run's prefix (whose mount under /run/netns comes with it); the run must fail
naming each, and kill the process. Another job's files in /tmp and its
namespaces, made while the run goes, do not fail it; nor does a clean inner
run's temp file that it removes.
The cost of each test (spark_dilation.testing.cputime) counts the CPU of a
process that outlived its parent and the Spark JVMs a test launched.
The live failure line (spark_dilation.testing.live_failures) comes before the
summary, with and without xdist. Under --dist loadgroup a group stays on one worker
(spark_dilation.testing.xdist_groups), and a test that lost its group fails saying so.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from spark_dilation.testing.cputime import open_meter
from spark_dilation.testing.leftovers import RUN_MARK, RUN_PREFIX_ENV, SYSTEM_TMP
from spark_dilation.testing.waiting import wait_until
from spark_dilation.testing.xdist_groups import order_units

pytestmark = pytest.mark.integration

PLANTING = """\
import os, subprocess, tempfile

def test_plants():
    fd, name = tempfile.mkstemp(prefix="planted-")
    os.close(fd)
    print("PLANTED", name)
    subprocess.Popen(["sleep", "300"], start_new_session=True)
    subprocess.run(["ip", "netns", "add", os.environ[{prefix_env!r}] + "-plant"], check=True)
"""

CLEAN = """\
import os, subprocess, sys, tempfile

def test_leaves_nothing(tmp_path):
    fd, name = tempfile.mkstemp(prefix="removed-")
    os.close(fd)
    assert not name.startswith("/tmp/removed"), name  # TMPDIR points into pytest's folders
    os.unlink(name)
    os.makedirs(os.path.join(tempfile.gettempdir(), "empty", "folders"))  # hold nothing
    (tmp_path / "x").write_text("pytest's own")
    subprocess.run([sys.executable, "-c", "pass"], check=True)
    # Another job on the machine, meanwhile: a file in /tmp and a namespace of its own.
    open({other_file!r}, "w").close()
    subprocess.run(["ip", "netns", "add", {other_ns!r}], check=True)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _inner_run(
    tmp_path: Path,
    source: str,
    *args: str,
    plugin: str = "spark_dilation.testing.leftovers",
    folder: str = "inner",
    conftest: str | None = None,
) -> subprocess.CompletedProcess[str]:
    """``source`` as ``tmp_path/folder/test_inner.py`` (beside ``conftest`` if given), run
    by a pytest of its own with ``plugin``; its base temp is ``tmp_path/folder-base``."""
    (tmp_path / folder).mkdir()
    test = tmp_path / folder / "test_inner.py"
    test.write_text(source)
    if conftest is not None:
        (tmp_path / folder / "conftest.py").write_text(conftest)
    own = ("PYTEST_ADDOPTS", RUN_MARK, "PYTEST_XDIST_WORKER")  # a run of its own
    env = {k: v for k, v in os.environ.items() if k not in own}
    # The inner run's own prefix: "sq" is never a suite run's ("sd"), so neither sees the other's.
    env[RUN_PREFIX_ENV] = "sq" + uuid.uuid4().hex[:3]
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", plugin, "-p", "no:cacheprovider", "-q",
         f"--basetemp={tmp_path / f'{folder}-base'}", *args, str(test)],
        cwd=tmp_path / folder, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_a_planted_file_process_and_namespace_fail_the_run(tmp_path: Path) -> None:
    run = _inner_run(tmp_path, PLANTING.format(prefix_env=RUN_PREFIX_ENV), "-s")
    out = run.stdout + run.stderr
    print(out)
    planted = next(line.split()[1] for line in out.splitlines() if line.startswith("PLANTED "))
    ns = next(
        line.split()[-1] for line in out.splitlines() if "left behind: network namespace" in line
    )
    try:
        assert run.returncode == 1, out
        assert "1 passed" in out, out  # the test passed: the check failed the run
        assert planted.startswith(str(tmp_path / "inner-base" / "tmp")), planted
        assert f"left behind: file {planted}" in out, out
        assert ns.startswith("sq") and ns.endswith("-plant"), out
        assert f"left behind: mount /run/netns/{ns}" in out, out
        sleeper = [line for line in out.splitlines() if "left behind: process" in line]
        assert len(sleeper) == 1 and sleeper[0].endswith("sleep 300"), out
        pid = int(sleeper[0].split("left behind: process ")[1].split()[0])
        # Reported, then killed (and reaped by init).
        wait_until("the planted sleeper to be gone", lambda: not _alive(pid), 5)
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)


def test_a_clean_run_passes_while_another_job_writes_beside_it(tmp_path: Path) -> None:
    tag = uuid.uuid4().hex[:8]
    other_file, other_ns = SYSTEM_TMP / f"another-job-{tag}", f"otherjob{tag[:4]}"
    try:
        run = _inner_run(tmp_path, CLEAN.format(other_file=str(other_file), other_ns=other_ns))
        out = run.stdout + run.stderr
        assert run.returncode == 0, out
        assert "left behind" not in out, out
        assert other_file.exists()  # made during the run, and not the run's
    finally:
        other_file.unlink(missing_ok=True)
        subprocess.run(["ip", "netns", "del", other_ns], capture_output=True, check=False)


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


GROUPED = """\
import os
from pathlib import Path
import pytest

@pytest.mark.xdist_group("g")
@pytest.mark.parametrize("n", range(4))
def test_grouped(n):
    with (Path(__file__).parent / "workers.txt").open("a") as f:
        f.write(os.environ["PYTEST_XDIST_WORKER"] + "\\n")

def test_free():
    pass
"""

# A pytest whose node ids no longer carry our suffix: reset after the plugin named it.
UNNAMED = """\
import pytest

@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items):
    for item in items:
        if "@" in item.nodeid:
            item._id = type(item._id).parse(item.nodeid.rsplit("@", 1)[0])
"""


def test_a_group_stays_on_one_worker_and_a_lost_group_fails_its_tests(tmp_path: Path) -> None:
    args = ("-n", "2", "--dist", "loadgroup")
    run = _inner_run(tmp_path, GROUPED, *args, plugin="spark_dilation.testing.xdist_groups")
    out = run.stdout + run.stderr
    assert run.returncode == 0 and "5 passed" in out, out
    workers = (tmp_path / "inner" / "workers.txt").read_text().split()
    assert len(workers) == 4 and len(set(workers)) == 1, workers  # the group on one worker
    broken = _inner_run(
        tmp_path, GROUPED, *args, plugin="spark_dilation.testing.xdist_groups",
        folder="broken", conftest=UNNAMED,
    )  # fmt: skip
    out = broken.stdout + broken.stderr
    assert broken.returncode == 1 and "1 passed, 4 errors" in out, out  # failed at setup
    assert "4 grouped test(s) lost their xdist group, this one too" in out, out


COSTLY = """\
import os, subprocess, sys, time
from pathlib import Path

# The child forks a grandchild and exits at once: init inherits the grandchild.
ORPHAN = '''
import os, time
if os.fork() == 0:
    while time.process_time() < 1.5:
        pass
    open("burned", "w").close()
'''

def test_orphan_burns():
    done = Path("burned")
    script = ORPHAN
    subprocess.run([sys.executable, "-c", script], check=True)
    deadline = time.monotonic() + 60
    while not done.exists():
        assert time.monotonic() < deadline, "the grandchild never finished"
        time.sleep(0.05)
    time.sleep(0.2)  # its exit

def test_launches_spark():
    import pyspark
    submit = os.path.join(os.path.dirname(pyspark.__file__), "bin", "spark-submit")
    subprocess.run([submit, "--version"], check=True, capture_output=True)

def test_forking_jvm(tmp_path):
    # A "java" (this Python, by that name) whose child lives a while between fork and
    # exec, showing its parent's command line: one JVM, not two.
    java = tmp_path / "java"
    java.symlink_to(sys.executable)
    (tmp_path / "fakejvm.py").write_text(
        "import os, time\\nif os.fork() == 0:\\n"
        "    time.sleep(1.5)\\n    os._exit(0)\\nos.wait()\\n"
    )
    subprocess.run([str(java), "-m", "fakejvm"], cwd=tmp_path, check=True)

def test_idle():
    pass
"""


def test_a_tests_cost_counts_orphans_and_spark_launches(tmp_path: Path) -> None:
    """An orphaned grandchild's 1.5 CPU-s count to its test (a cgroup: this machine runs
    the suite as root, so the meter must be there); ``spark-submit`` counts as one
    application JVM (its launcher JVM is not), a JVM's child before its exec not
    at all; an idle test costs next to nothing."""
    meter = open_meter("spark-dilation-probe")
    assert meter is not None, "no cgroup meter (root with cgroup cpuacct or v2 expected)"
    meter.close()
    junit = tmp_path / "inner.xml"
    run = _inner_run(
        tmp_path, COSTLY, f"--junitxml={junit}", plugin="spark_dilation.testing.cputime"
    )
    assert run.returncode == 0, run.stdout + run.stderr
    props = {
        case.get("name"): {p.get("name"): p.get("value") for p in case.iter("property")}
        for case in ET.parse(junit).iter("testcase")
    }
    assert float(props["test_orphan_burns"]["cpu_s"]) >= 1.4, props
    assert props["test_launches_spark"]["jvms"] == "SparkSubmit:1", props
    assert props["test_forking_jvm"]["jvms"] == "fakejvm:1", props
    assert "jvms" not in props["test_idle"] and "jvms" not in props["test_orphan_burns"], props
    assert float(props["test_idle"]["cpu_s"]) < 0.5, props


def test_liveness_units_are_not_handed_out_first() -> None:
    """Largest unit first, as xdist orders them, but a unit with a liveness-bound test
    only after the first ``hold`` units (the Spark start-up burst)."""
    units = [
        ("a", 1, False),
        ("@g", 3, False),
        ("b", 1, True),
        ("@h", 2, True),
        ("c", 1, False),
        ("d", 1, False),
    ]
    assert order_units(units, hold=2) == ["@g", "a", "@h", "b", "c", "d"]
    assert order_units(units, hold=0) == ["@h", "b", "@g", "a", "c", "d"]
    assert order_units(units, hold=9) == ["@g", "a", "c", "d", "@h", "b"]
