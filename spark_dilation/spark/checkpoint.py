"""Where a streaming query's checkpoint lives, read as Spark reads the location.

Spark hands the location to Hadoop's file systems: a location with a scheme
(``dbfs:/x``, ``s3a://b/x``, ``abfss://c@a/x``, ``gs://b/x``, ``hdfs://n/x``)
is on that file system, ``file:`` is local, and a location with no scheme is
on the **default** file system (``fs.defaultFS``: local on a laptop, DBFS on
Databricks, HDFS on many clusters). Only a local checkpoint is a folder this
process can keep files in; anything else is not ours to write.

The driver's Python workers, where a source and a sink plan, see no Spark
configuration: what they know of the file system comes from the environment and
the configuration files.
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
    configured = spark_default("spark.hadoop.fs.defaultFS")
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


def spark_default(key: str) -> str | None:
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
