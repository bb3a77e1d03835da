"""``spark_dilation.testing.worker_bytecode``: Spark's Python workers skip PySpark's zip."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Any

from spark_dilation.testing.worker_bytecode import PTH_NAME, install, shipped_zip


def fake_site(tmp_path: Path) -> Path:
    """A site-packages with a pip PySpark's layout: the package and its source zip."""
    site = tmp_path / "site"
    (site / "pyspark").mkdir(parents=True)
    (site / "pyspark" / "__init__.py").write_text("")
    zip_path = shipped_zip(site)
    zip_path.parent.mkdir(parents=True)
    zip_path.write_bytes(b"PK\x05\x06" + bytes(18))  # an empty zip
    return site


def path_after(pth: Path, entries: list[str]) -> list[str]:
    """``sys.path`` of a fresh interpreter with ``entries`` first, after the .pth line ran."""
    code = (
        "import sys, json; sys.path[:0] = json.loads(sys.argv[1]); "
        "exec(open(sys.argv[2]).read()); print(json.dumps(sys.path))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, json.dumps(entries), str(pth)],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return json.loads(out.stdout)


def test_the_pth_drops_only_the_shipped_zip(tmp_path: Path) -> None:
    site = fake_site(tmp_path)
    pth = install(site)
    assert pth == site / PTH_NAME
    zip_path = str(shipped_zip(site))
    link = tmp_path / "via-link"
    link.symlink_to(site)  # Spark may name it through a link
    other_zip = str(tmp_path / "other" / "pyspark.zip")
    py4j = str(shipped_zip(site).parent / "py4j-src.zip")
    after = path_after(
        pth, [zip_path, str(link / "pyspark/python/lib/pyspark.zip"), py4j, other_zip]
    )
    assert zip_path not in after and str(link / "pyspark/python/lib/pyspark.zip") not in after
    assert py4j in after and other_zip in after
    assert install(site) == pth  # idempotent


def test_no_pip_pyspark_no_pth(tmp_path: Path) -> None:
    site = fake_site(tmp_path)
    install(site)
    os.remove(shipped_zip(site))
    assert install(site) is None
    assert not (site / PTH_NAME).exists()  # a stale one goes too


def test_spark_workers_import_pyspark_from_where_the_pth_says(spark: Any) -> None:
    """In this venv: with the .pth (``make test`` writes it) a worker's PySpark is the
    installed package; without it, Spark's zip."""
    installed = (Path(sysconfig.get_paths()["purelib"]) / PTH_NAME).exists()

    def where(batches: Any) -> Any:
        import pyarrow as pa
        import pyspark

        for _ in batches:
            yield pa.RecordBatch.from_pydict({"f": [pyspark.__file__]})

    found = spark.range(1, numPartitions=1).mapInArrow(where, "f string").collect()[0].f
    assert (".zip" not in found) == installed, (found, installed)
