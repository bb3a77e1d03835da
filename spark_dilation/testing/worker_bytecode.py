"""Spark's Python workers in this venv import PySpark from its bytecode, not its zip.

Spark puts ``$SPARK_HOME/python/lib/pyspark.zip`` first on every Python worker's
``PYTHONPATH``; with a pip PySpark that zip sits inside the very package
site-packages holds, source only. Python never caches bytecode for a zip, so
every worker (a daemon, a planner, a streaming source or sink runner, a commit)
compiles PySpark again: measured on 2 cores, importing the streaming source
runner took 1.65 CPU-s from the zip against 0.58 from site-packages. The suite
starts thousands of workers, and a streaming runner or a simple worker that takes
over Spark's fixed 10 s to connect back fails its query ("Python worker failed to
connect back"), which a loaded 2-core run did.

``python -m spark_dilation.testing.worker_bytecode`` (``make test`` runs it)
writes a ``.pth`` file into this interpreter's site-packages that takes that one
zip off ``sys.path`` at start-up, so ``import pyspark`` finds the same PySpark
(same files, same version) with its bytecode. Nothing else changes: another
PySpark's zip, Py4J's zip and every other path stay. Remove the file to undo.
"""

from __future__ import annotations

import os
import sys
import sysconfig
from pathlib import Path

PTH_NAME = "spark-dilation-worker-bytecode.pth"


def shipped_zip(site_packages: Path) -> Path:
    """The zip of the PySpark that ``site_packages`` holds."""
    return site_packages / "pyspark" / "python" / "lib" / "pyspark.zip"


def pth_line(zip_path: Path) -> str:
    """The ``.pth`` line (site runs lines that start with ``import``) that drops the zip."""
    real = os.path.realpath(zip_path)
    return (
        f"import os, sys; sys.path[:] = [p for p in sys.path if os.path.realpath(p) != {real!r}]\n"
    )


def install(site_packages: Path | None = None) -> Path | None:
    """Write the ``.pth`` file; None (and nothing written) without a pip PySpark here."""
    site = Path(site_packages or sysconfig.get_paths()["purelib"])
    zip_path = shipped_zip(site)
    pth = site / PTH_NAME
    if not (zip_path.is_file() and (site / "pyspark" / "__init__.py").is_file()):
        pth.unlink(missing_ok=True)
        return None
    line = pth_line(zip_path)
    if not pth.exists() or pth.read_text() != line:
        pth.write_text(line)
    return pth


if __name__ == "__main__":
    print(install() or "no pip PySpark in this interpreter's site-packages", file=sys.stderr)
