"""Early lanes: finding the driver's master from a planner worker (no Spark needed)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from spark_dilation.spark.locality import (
    driver_master,
    is_local_master,
    master_from_cmdline,
    tasks_run_here,
)
from spark_dilation.transfer.rules.options import TransferOptionError, TransferOptions


@pytest.mark.parametrize(
    ("args", "master"),
    [
        (["java", "-cp", "x", "SparkSubmit", "--conf", "spark.master=local[2]", "pyspark-shell"],
         "local[2]"),
        (["java", "SparkSubmit", "--master", "local-cluster[2,1,1024]", "app.py"],
         "local-cluster[2,1,1024]"),
        (["java", "SparkSubmit", "--master=yarn", "app.py"], "yarn"),
        (["java", "SparkSubmit", "--deploy-mode", "client", "app.py"], None),
    ],
)  # fmt: skip
def test_master_from_a_jvm_command_line(args, master) -> None:
    assert master_from_cmdline(args) == master


@pytest.mark.parametrize(
    ("master", "local"),
    [
        ("local", True),
        ("local[*]", True),
        ("local[2]", True),
        ("local-cluster[2,1,1024]", True),
        ("spark://host:7077", False),
        ("yarn", False),
        ("k8s://https://api:6443", False),
        ("localhost", False),
        (None, False),
    ],
)
def test_which_masters_run_tasks_on_this_machine(master, local) -> None:
    assert is_local_master(master) is local


def test_no_jvm_above_this_process_means_not_known_to_be_local() -> None:
    assert driver_master() is None
    assert tasks_run_here() is False


@pytest.mark.integration  # starts processes of its own
def test_the_nearest_java_ancestor_is_read(tmp_path) -> None:
    """A process named java (a copy of the Python binary) with a Spark-like
    command line starts a child; the child finds the master through it."""
    java = tmp_path / "java"
    shutil.copy(os.path.realpath(sys.executable), java)
    child = (
        "import subprocess, sys; subprocess.run([sys.argv[1], '-c', "
        "'from spark_dilation.spark.locality import driver_master, tasks_run_here; "
        "print(driver_master(), tasks_run_here())'], check=True)"
    )
    out = subprocess.run(
        [str(java), "-c", child, sys.executable, "--conf", "spark.master=local[2]"],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    assert out.stdout.split() == ["local[2]", "True"], out


def test_early_lanes_option_values() -> None:
    assert TransferOptions().early_lanes == "auto"
    assert TransferOptions.from_strings({"early_lanes": "false"}).early_lanes == "false"
    with pytest.raises(TransferOptionError, match="early_lanes='sometimes' is not one of"):
        TransferOptions(early_lanes="sometimes")
