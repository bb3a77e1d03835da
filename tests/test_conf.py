"""conf/options.md documents every option, where it applies, and its default."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from spark_dilation.spark.datasource import WRITE_OPTIONS
from spark_dilation.spark.options import KNOWN_OPTIONS
from spark_dilation.transfer.options import TransferOptions

CONF = Path(__file__).resolve().parent.parent / "conf"
NAME = re.compile(r"^`(\w+)`$")
COLUMNS = ("name", "read", "write", "python", "default", "meaning")


def documented() -> dict[str, dict[str, str]]:
    rows = {}
    for line in (CONF / "options.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != len(COLUMNS) or not NAME.match(cells[0]):
            continue
        row = dict(zip(COLUMNS, cells, strict=True))
        row["name"] = NAME.match(cells[0])[1]
        assert row["name"] not in rows, f"{row['name']} is documented twice"
        assert {row["read"], row["write"], row["python"]} <= {"yes", "no"}, line
        rows[row["name"]] = row
    return rows


def where(column: str) -> set[str]:
    return {name for name, row in documented().items() if row[column] == "yes"}


def test_every_option_is_documented_where_it_applies():
    python = {*TransferOptions.names(), "code"}
    assert set(documented()) == {*KNOWN_OPTIONS, *WRITE_OPTIONS, *python}
    assert where("read") == set(KNOWN_OPTIONS)
    assert where("write") == set(WRITE_OPTIONS)
    assert where("python") == python


def test_the_documented_defaults_are_the_code_defaults():
    rows = documented()
    for field in dataclasses.fields(TransferOptions):
        if field.default is None or field.metadata.get("internal"):
            continue  # mailbox, relay, staging_dir: described, not a literal
        expected = '`""`' if field.default == "" else f"`{field.default}`"
        assert rows[field.name]["default"].strip() == expected, field.name


def test_the_spark_defaults_example_names_real_settings():
    text = (CONF / "spark-defaults.conf.example").read_text()
    settings = [line.split()[0] for line in text.splitlines() if line and line[0] != "#"]
    assert "spark.sql.session.timeZone" in settings
    assert all(s.startswith("spark.") for s in settings)
    assert "PYSPARK_PYTHON" in text and "SPARK_DILATION_MAILBOX" in text
