"""A class-data-sharing archive of Spark's classes, for the suite's many short JVMs.

Every Spark JVM of a test run (drivers, local-cluster executors, Spark Connect
servers) loads and verifies the same ten thousand classes from Spark's jars.
A dynamic CDS archive (JDK 13+) holds them already parsed and verified: a
driver's start-up takes about half the CPU (measured on 2 cores: 13 -> 7 CPU-s
for a session and its first job). It changes nothing the JVM does after start-up.

``make test`` names a folder in ``SPARK_DILATION_JVM_ARCHIVE``; ``tests/conftest.py``
then points every JVM at the archive for this JDK, PySpark and interpreter
(:func:`java_options`) and, if it is missing, builds it in the background
(:func:`start_build`, about a minute). JVMs that start before it exists, and
JVMs whose class path differs from the archive's (Spark's launcher, the
namespace clusters with their own conf folder), run as before: the flags
silence the JVM's note that it could not use the archive. By hand::

    python -m spark_dilation.testing.jvm_archive build/jvm
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from spark_dilation.testing.waiting import wait_until

BASE = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"
"""Every test JVM's flags: short-lived and small, the C1 compiler alone and the serial
collector cut its start-up CPU (a two-application transfer test took 65 s -> 50 s)."""
QUIET = "-Xlog:cds=off -Xlog:cds+dynamic=off"
ENV = "SPARK_DILATION_JVM_ARCHIVE"
"""The folder ``make test`` keeps the archive in (unset: no archive)."""

_JAVA_ENV = {"JAVA_TOOL_OPTIONS", "_JAVA_OPTIONS", "JDK_JAVA_OPTIONS"}

# The dump's workload: a session, Arrow and Python workers, Parquet, a Python data
# source read and write: the classes every test's JVM loads.
_WORKLOAD = """\
import sys
from pyspark.sql import SparkSession
from pyspark.sql.datasource import DataSource, DataSourceReader, DataSourceWriter
from pyspark.sql.datasource import WriterCommitMessage

class _Reader(DataSourceReader):
    def read(self, partition):
        yield (1, "a")

class _Writer(DataSourceWriter):
    def write(self, rows):
        return WriterCommitMessage()

class _Source(DataSource):
    @classmethod
    def name(cls):
        return "jvmarchive"
    def schema(self):
        return "id long, s string"
    def reader(self, schema):
        return _Reader()
    def writer(self, schema, overwrite):
        return _Writer()

spark = (SparkSession.builder.master("local[2]").appName("jvm-archive")
         .config("spark.ui.enabled", "false").config("spark.local.dir", sys.argv[1])
         .getOrCreate())
spark.dataSource.register(_Source)
df = spark.range(0, 1000, numPartitions=2).selectExpr("id", "CAST(id AS STRING) AS s")
df.write.mode("overwrite").parquet(sys.argv[1] + "/p")
spark.read.parquet(sys.argv[1] + "/p").mapInArrow(lambda it: it, df.schema).count()
spark.read.format("jvmarchive").load().collect()
df.write.format("jvmarchive").mode("append").save()
df.toArrow() if hasattr(df, "toArrow") else df.toPandas()
print("jvm-pid", spark.sparkContext._jvm.ProcessHandle.current().pid(), flush=True)
spark.stop()
"""


def _java_version() -> str:
    """The JDK's version and home (not the notes JAVA_TOOL_OPTIONS adds to the output)."""
    env = {k: v for k, v in os.environ.items() if k not in _JAVA_ENV}
    done = subprocess.run(["java", "-version"], capture_output=True, text=True, env=env)
    return f"{done.stderr.splitlines()[:1]}|{os.path.realpath(shutil.which('java') or 'java')}"


def archive_path(folder: Path) -> Path:
    """The archive for this JDK, PySpark and interpreter in ``folder``."""
    import pyspark

    key = f"{_java_version()}|{pyspark.__version__}|{pyspark.__file__}|{sys.executable}"
    return folder.resolve() / f"spark-{hashlib.sha256(key.encode()).hexdigest()[:16]}.jsa"


def build(folder: Path) -> Path:
    """The archive in ``folder``, dumped by one small Spark application if missing."""
    path = archive_path(folder)
    if path.exists():
        return path
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("spark-*.jsa"):  # another JDK's or PySpark's
        old.unlink()
    for old in folder.glob("tmp*"):  # a build that was killed
        shutil.rmtree(old, ignore_errors=True)
    with tempfile.TemporaryDirectory(dir=folder) as scratch:
        partial = Path(scratch) / "spark.jsa"
        env = {
            **os.environ,
            "TMPDIR": scratch,
            "PYSPARK_PYTHON": sys.executable,
            "SPARK_LOCAL_IP": "127.0.0.1",
            # The driver JVM dumps; Spark's launcher JVM (another class path) must not.
            "SPARK_SUBMIT_OPTS": f"-XX:ArchiveClassesAtExit={partial} {QUIET}",
            "JAVA_TOOL_OPTIONS": f"{BASE} -Djava.io.tmpdir={scratch}",
        }
        log = folder / "build.log"
        with log.open("w") as out:
            code = subprocess.call(
                [sys.executable, "-c", _WORKLOAD, scratch], env=env, stdout=out, stderr=out
            )
        # The JVM dumps as it exits, which it does after this interpreter has.
        pid = next(
            (int(ln.split()[1]) for ln in log.read_text().splitlines() if ln.startswith("jvm-pid")),
            None,
        )
        if pid is not None:
            wait_until("the archive's JVM to exit", lambda: not Path(f"/proc/{pid}").exists(), 120)
        if code != 0 or not partial.exists():
            raise SystemExit(f"could not build the JVM archive (exit {code}); see {log}")
        shutil.move(partial, path)
    return path


def java_options(path: Path | None) -> str:
    """The JVM flags that use the archive at ``path`` once it exists ("" for none)."""
    return f"-XX:SharedArchiveFile={path} {QUIET}" if path else ""


def start_build(folder: Path) -> subprocess.Popen[bytes] | None:
    """Build the archive in a process of its own, unless it exists already."""
    if archive_path(folder).exists():
        return None
    folder.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(
        [sys.executable, "-m", __name__, str(folder)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=(folder / "build.err").open("wb"),
        start_new_session=True,
    )


if __name__ == "__main__":
    print(build(Path(sys.argv[1] if len(sys.argv) > 1 else "build/jvm")))
