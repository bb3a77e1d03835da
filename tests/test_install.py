"""The base install (no extras) is the CLI and the Python API: no PySpark.

PySpark is the ``spark`` extra, so ``%pip install spark-dilation`` on a cluster
keeps the cluster's own PySpark. The CLI and ``import spark_dilation`` must
not import it; the Spark features say in one line what they need when it is
missing.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from spark_dilation.spark.register import SparkVersionError, check_pyspark


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.integration  # starts processes of its own
def test_import_and_cli_help_do_not_import_pyspark():
    done = _run(
        """
        import contextlib, io, sys
        import spark_dilation
        import spark_dilation.cli
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            try:
                spark_dilation.cli.main(["--help"])
            except SystemExit:
                pass
            for command in ("send", "receive", "serve"):
                try:
                    spark_dilation.cli.main([command, "--help"])
                except SystemExit:
                    pass
        assert "receive" in out.getvalue(), out.getvalue()
        print(sorted(m for m in sys.modules if m.split(".")[0] in ("pyspark", "py4j", "pandas")))
        """
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


@pytest.mark.integration  # starts processes of its own
def test_spark_features_without_pyspark_say_what_they_need():
    # sys.modules[name] = None makes "import pyspark" fail as if it were not installed.
    done = _run(
        """
        import sys
        sys.modules["pyspark"] = None
        import spark_dilation
        for use in (lambda: spark_dilation.register(object()),
                    lambda: spark_dilation.receive(object(), "1-a-b"),
                    lambda: spark_dilation.spark.read_wormhole_file):
            try:
                use()
            except spark_dilation.spark.SparkVersionError as e:
                print(e)
        try:
            import pyspark_dilation
        except spark_dilation.spark.SparkVersionError as e:
            print(e)
        """
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 4, done.stdout
    for line in lines:
        assert "need PySpark 4.0 or later" in line and "spark-dilation[spark]" in line, line


def test_an_old_pyspark_is_named():
    with pytest.raises(SparkVersionError, match=r"PySpark 4\.0 or later .* PySpark 3\.5\.1"):
        check_pyspark("3.5.1")


@pytest.mark.integration  # starts processes of its own
@pytest.mark.parametrize(
    ("missing", "args", "code", "needs"),
    [
        ("pyspark", ["demo"], 2, "pip install 'spark-dilation[spark,server]'"),
        ("wormhole_mailbox_server", ["demo", "--no-spark"], 1, "[server]'"),
        ("wormhole_mailbox_server", ["serve"], 1, "[server]'"),
    ],
)
def test_demo_and_serve_without_their_extras_say_what_to_install(
    missing: str, args: list[str], code: int, needs: str
) -> None:
    done = _run(
        f"""
        import sys
        sys.modules[{missing!r}] = None  # as in an install without the extra
        import spark_dilation.cli
        sys.exit(spark_dilation.cli.main({args!r}))
        """
    )
    lines = done.stderr.strip().splitlines()
    assert done.returncode == code, done.stderr
    assert len(lines) == 1 and needs in lines[0], done.stderr
    assert lines[0].startswith("spark-dilation"), done.stderr
