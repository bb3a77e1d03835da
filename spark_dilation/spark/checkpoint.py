"""Where a streaming query's checkpoint lives, read as Spark reads the location.

Spark hands the location to Hadoop's file systems: a location with a scheme
(``dbfs:/x``, ``s3a://b/x``, ``abfss://c@a/x``, ``gs://b/x``, ``hdfs://n/x``)
is on that file system, ``file:`` is local, and a location with no scheme is
on the **default** file system (``fs.defaultFS``: local on a laptop, DBFS on
Databricks, HDFS on many clusters). Only a local checkpoint is a folder this
process can keep files in; anything else is not ours to write.

The driver's Python workers, where a source and a sink plan, see no Spark
configuration: what they know of the file system and the master comes from the
environment, ``spark-defaults.conf`` and the driver JVM's command line.
"""

from __future__ import annotations

import os
import re
import xml.etree.ElementTree as ET
from pathlib import Path

# A URI scheme of two or more characters: "C:" is a Windows drive, not a scheme.
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]+):")
DEFAULT_FS_ENV = "SPARK_DILATION_DEFAULT_FS"


def local_checkpoint(location: str, default_fs: str | None = None) -> Path | None:
    """The checkpoint at ``location`` as a local folder, or None: no location, or one on
    a remote file system. ``default_fs``: Hadoop's ``fs.defaultFS`` (None: local)."""
    location = location.strip()
    if not location:
        return None
    scheme = _SCHEME.match(location)
    if scheme is not None:
        if scheme.group(1).lower() != "file":
            return None
        rest = location[scheme.end() :]
        if rest.startswith("//"):  # file://host/path: only an empty host is this machine
            host, _, path = rest[2:].partition("/")
            if host not in ("", "localhost"):
                return None
            rest = "/" + path
        return Path(rest)
    if not _is_local_fs(default_fs):
        return None
    return Path(location).absolute()  # relative: to the driver's working folder, as Spark


def _is_local_fs(default_fs: str | None) -> bool:
    return not default_fs or default_fs.lower().startswith("file:")


def default_fs() -> str | None:
    """``fs.defaultFS`` as this process can learn it without a JVM: ``$SPARK_DILATION_DEFAULT_FS``;
    on Databricks ``dbfs:/``; else ``spark.hadoop.fs.defaultFS`` in ``spark-defaults.conf``,
    else ``fs.defaultFS`` in ``core-site.xml`` (``$HADOOP_CONF_DIR``); else None (local)."""
    if os.environ.get(DEFAULT_FS_ENV):
        return os.environ[DEFAULT_FS_ENV]
    if os.environ.get("DATABRICKS_RUNTIME_VERSION"):
        return "dbfs:/"
    configured = _spark_default("spark.hadoop.fs.defaultFS")
    if configured:
        return configured
    hadoop = os.environ.get("HADOOP_CONF_DIR")
    if hadoop:
        try:
            root = ET.parse(os.path.join(hadoop, "core-site.xml")).getroot()
        except (OSError, ET.ParseError):
            return None
        for prop in root.iter("property"):
            if (prop.findtext("name") or "").strip() == "fs.defaultFS":
                return (prop.findtext("value") or "").strip() or None
    return None


def _spark_default(key: str) -> str | None:
    """``key`` in ``spark-defaults.conf`` (``$SPARK_CONF_DIR``, else ``$SPARK_HOME/conf``)."""
    conf_dir = os.environ.get("SPARK_CONF_DIR") or (
        os.path.join(os.environ["SPARK_HOME"], "conf") if os.environ.get("SPARK_HOME") else None
    )
    if not conf_dir:
        return None
    try:
        with open(os.path.join(conf_dir, "spark-defaults.conf")) as f:
            for line in f:
                parts = line.split(None, 1)  # Spark's own format: key, whitespace, value
                if len(parts) == 2 and parts[0] == key and parts[1].strip():
                    return parts[1].strip()
    except OSError:
        pass
    return None


def _master_argument(argv: list[str]) -> str | None:
    """The master on a ``spark-submit`` line: ``--master X`` or ``--conf spark.master=X``."""
    for i, arg in enumerate(argv):
        if arg == "--master" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--master="):
            return arg.partition("=")[2]
        if arg.startswith("spark.master="):
            return arg.partition("=")[2]
    return None


def _jvm_argv() -> list[str]:
    """The command line of the JVM this process descends from (a driver's Python worker is
    its child, or a child of its ``pyspark.daemon``), or [] (none, or not Linux)."""
    pid = os.getpid()
    for _ in range(4):
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:  # "pid (comm) state ppid ..."
                pid = int(f.read().rsplit(b")", 1)[1].split()[1])
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
        except (OSError, ValueError, IndexError):
            return []
        if argv and os.path.basename(argv[0]) == "java":
            return argv
        if pid <= 1:
            break
    return []


def cluster_master(jvm_argv: list[str] | None = None) -> str | None:
    """The cluster this driver runs on, as a driver's Python worker can learn it, or None
    (a ``local`` master, or nothing says). Databricks by its runtime's environment; else
    the master given to ``spark-submit`` (the driver JVM's command line), else
    ``spark.master`` in ``spark-defaults.conf``. A master set only in code
    (``SparkSession.builder.master``) is not visible here."""
    if os.environ.get("DATABRICKS_RUNTIME_VERSION"):
        return "Databricks"
    argv = _jvm_argv() if jvm_argv is None else jvm_argv
    master = _master_argument(argv) or _spark_default("spark.master")
    if master and not master.startswith("local"):
        return master
    return None
