"""Reading received files: format detection, schemas, splits and casts; then real Spark.

Most tests run the data source's logic on plain files with pyarrow alone
(no SparkSession): that is where the rules live. A few tests at the end use
one session-scoped ``local[2]`` SparkSession to prove the parts only Spark can:
auto-registration, the pickling between Spark's processes, and the exact
batch schema Spark checks.
"""

from __future__ import annotations

import datetime as dt
import decimal
import gzip
import pickle
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.csv as pa_csv
import pyarrow.ipc as pa_ipc
import pyarrow.parquet as pq
import pyspark.sql.types as pyspark_types
import pytest
from pyspark.sql.types import (
    ArrayType,
    BinaryType,
    ByteType,
    DateType,
    DecimalType,
    DoubleType,
    IntegerType,
    LongType,
    MapType,
    ShortType,
    StringType,
    StructField,
    StructType,
    TimestampNTZType,
    TimestampType,
)

from spark_dilation.spark import (
    DilationDataSource,
    OptionError,
    StagedDataError,
    UnsupportedFormatError,
)
from spark_dilation.spark.datasource import spark_arrow_schema, to_spark_schema
from spark_dilation.spark.options import ReadSettings, default_staging_root
from spark_dilation.spark.receive import new_staging_dir
from spark_dilation.spark.staged import (
    CsvOptions,
    StagedDataset,
    cast_batch,
    detect_format,
    inspect_staged,
    is_data_file_name,
    normalize_format,
    plan_splits,
    read_split,
)

# --- helpers ------------------------------------------------------------------


def target_for(staged: StagedDataset) -> pa.Schema:
    """The Arrow schema Spark would check batches against, as the data source builds it."""
    return spark_arrow_schema(to_spark_schema(staged.arrow_schema))


def read_all(staged: StagedDataset, target: pa.Schema | None = None, **split_kw) -> pa.Table:
    """Every split read the way Spark tasks read them, concatenated."""
    target = target if target is not None else target_for(staged)
    batches = []
    for split in plan_splits(staged, **split_kw):
        for batch in read_split(staged, split, target):
            assert batch.schema.equals(target)  # what Spark demands of every batch
            batches.append(batch)
    return pa.Table.from_batches(batches, schema=target)


def rows(table: pa.Table, sort_by: str | None = None) -> list[dict]:
    out = table.to_pylist()
    return sorted(out, key=lambda r: r[sort_by]) if sort_by else out


PEOPLE = pa.table(
    {
        "id": pa.array([1, 2, 3, 4, 5, 6, 7], pa.int64()),
        "name": ["ada", "bob", None, "dan", "eve", "fay", "gus"],
        "score": [1.5, 2.0, 3.25, None, 5.0, 6.5, 7.0],
    }
)


# --- format detection -------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("data.parquet", "parquet"),
        ("part-00000-1b2c-c000.snappy.parquet", "parquet"),
        ("DATA.PARQUET", "parquet"),
        ("table.csv", "csv"),
        ("part-00000-1b2c-c000.csv.gz", "csv"),
        ("events.json", "json"),
        ("events.jsonl", "json"),
        ("events.ndjson.bz2", "json"),
        ("frame.arrow", "arrow"),
        ("frame.feather", "arrow"),
        ("frame.ipc", "arrow"),
        ("notes.txt", None),
        ("README", None),
        ("archive.gz", None),
    ],
)
def test_detect_format_from_extension(name: str, expected: str | None) -> None:
    assert detect_format(name) == expected


@pytest.mark.parametrize(
    ("name", "is_data"),
    [
        ("part-00000.parquet", True),
        ("_SUCCESS", False),
        (".part-00000.parquet.crc", False),
        ("part-00000.parquet.crc", False),
        ("_committed_123", False),
        ("_metadata", False),
        (".DS_Store", False),
    ],
)
def test_bookkeeping_files_are_not_data(name: str, is_data: bool) -> None:
    assert is_data_file_name(name) is is_data


def test_format_names_are_normalized_and_unknown_ones_listed() -> None:
    assert normalize_format(" Feather ") == "arrow"
    assert normalize_format("NDJSON") == "json"
    with pytest.raises(UnsupportedFormatError) as info:
        normalize_format("orc")
    message = str(info.value)
    assert "'orc'" in message
    assert "parquet, csv, json, arrow" in message
    assert 'option("format"' in message


def test_unknown_extension_is_a_clear_error_and_format_forces_it(tmp_path: Path) -> None:
    path = tmp_path / "export.txt"
    path.write_text("a,b\n1,x\n2,y\n")
    with pytest.raises(UnsupportedFormatError) as info:
        inspect_staged(path)
    message = str(info.value)
    assert "export.txt" in message
    assert "parquet, csv, json, arrow" in message
    assert '.option("format", "parquet")' in message

    staged = inspect_staged(path, format="csv")
    assert staged.format == "csv"
    assert rows(read_all(staged)) == [{"a": 1, "b": "x"}, {"a": 2, "b": "y"}]


def test_directory_with_unknown_data_file_names_the_files(tmp_path: Path) -> None:
    pq.write_table(PEOPLE, tmp_path / "part-0.parquet")
    (tmp_path / "part-1.orc").write_bytes(b"ORC")
    with pytest.raises(UnsupportedFormatError, match=r"part-1\.orc"):
        inspect_staged(tmp_path)


def test_directory_mixing_formats_is_an_error(tmp_path: Path) -> None:
    pq.write_table(PEOPLE, tmp_path / "a.parquet")
    pa_csv.write_csv(PEOPLE, tmp_path / "b.csv")
    with pytest.raises(UnsupportedFormatError, match=r"mixes formats \(csv, parquet\)"):
        inspect_staged(tmp_path)


def test_directory_without_data_files_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "_SUCCESS").write_text("")
    (tmp_path / ".part-0.parquet.crc").write_bytes(b"\0")
    with pytest.raises(StagedDataError, match="holds no data files"):
        inspect_staged(tmp_path)


def test_missing_staged_path_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(StagedDataError, match="does not exist"):
        inspect_staged(tmp_path / "gone.parquet")


# --- Parquet ------------------------------------------------------------------------


def test_parquet_row_groups_become_splits(tmp_path: Path) -> None:
    path = tmp_path / "people.parquet"
    pq.write_table(PEOPLE, path, row_group_size=2)  # 4 row groups: 2+2+2+1 rows
    staged = inspect_staged(path)
    assert staged.format == "parquet"
    assert [f.path for f in staged.files] == [str(path)]

    # Small files: all row groups in one split (about 128 MiB per split by default).
    assert [s.row_groups for s in plan_splits(staged)] == [(0, 1, 2, 3)]
    # One split per row group once each row group fills a split...
    assert [s.row_groups for s in plan_splits(staged, split_bytes=1)] == [(0,), (1,), (2,), (3,)]
    # ...and consecutive groups share a split until it is full.
    metadata = pq.read_metadata(path)
    two_groups = sum(metadata.row_group(i).total_byte_size for i in (0, 1))
    grouped = plan_splits(staged, split_bytes=two_groups)
    assert [s.row_groups for s in grouped] == [(0, 1), (2, 3)]

    for split_bytes in (1, two_groups, 1 << 30):
        assert rows(read_all(staged, split_bytes=split_bytes)) == PEOPLE.to_pylist()


def test_parquet_required_columns_stay_non_nullable(tmp_path: Path) -> None:
    schema = pa.schema([pa.field("id", pa.int32(), nullable=False), pa.field("v", pa.string())])
    path = tmp_path / "req.parquet"
    pq.write_table(pa.table({"id": [1, 2], "v": ["a", None]}, schema=schema), path)
    staged = inspect_staged(path)
    spark_schema = to_spark_schema(staged.arrow_schema)
    assert spark_schema == StructType(
        [StructField("id", IntegerType(), nullable=False), StructField("v", StringType())]
    )
    table = read_all(staged)
    assert table.schema.field("id").nullable is False
    assert rows(table) == [{"id": 1, "v": "a"}, {"id": 2, "v": None}]


def test_nested_nullability_survives_both_ways() -> None:
    """Element and map value nullability, nested too, on every PySpark 4 (4.0 drops it)."""
    schema = pa.schema(
        [
            pa.field("arr", pa.list_(pa.field("element", pa.int64(), nullable=False))),
            pa.field(
                "m",
                pa.map_(pa.string(), pa.field("value", pa.list_(pa.int32()), nullable=False)),
            ),
            pa.field("st", pa.struct([pa.field("q", pa.list_(pa.field("e", pa.int8(), False)))])),
            pa.field("at", pa.timestamp("us", tz="UTC")),
        ]
    )
    spark_schema = to_spark_schema(schema)
    assert spark_schema["arr"].dataType == ArrayType(LongType(), containsNull=False)
    assert spark_schema["m"].dataType == MapType(
        StringType(), ArrayType(IntegerType(), containsNull=True), valueContainsNull=False
    )
    assert spark_schema["st"].dataType == StructType(
        [StructField("q", ArrayType(ByteType(), containsNull=False))]
    )
    back = spark_arrow_schema(spark_schema)
    assert back.field("arr").type.value_field.nullable is False
    assert back.field("m").type.item_field.nullable is False
    assert back.field("at").type == pa.timestamp("us", tz="UTC")  # instants are UTC


def test_spark_recorded_timestamp_flavour_wins_but_nothing_else(tmp_path: Path) -> None:
    recorded = StructType(
        [StructField("at", TimestampType()), StructField("v", LongType())]  # v: stale
    ).json()
    table = pa.table(
        {
            "at": pa.array([dt.datetime(2024, 1, 2, 3, 4, 5)], pa.timestamp("us")),
            "v": pa.array([1.5]),
        }
    )
    plain, by_spark = tmp_path / "plain.parquet", tmp_path / "by_spark.parquet"
    pq.write_table(table, plain)
    pq.write_table(
        table.replace_schema_metadata({"org.apache.spark.sql.parquet.row.metadata": recorded}),
        by_spark,
    )
    assert to_spark_schema(inspect_staged(plain).arrow_schema)["at"].dataType == (
        TimestampNTZType()
    )
    spark_schema = to_spark_schema(inspect_staged(by_spark).arrow_schema)
    assert spark_schema["at"].dataType == TimestampType()
    assert spark_schema["v"].dataType == DoubleType()
    (row,) = rows(read_all(inspect_staged(by_spark)))
    assert row == {"at": dt.datetime(2024, 1, 2, 3, 4, 5, tzinfo=dt.UTC), "v": 1.5}


def test_empty_parquet_file_has_no_splits(tmp_path: Path) -> None:
    path = tmp_path / "empty.parquet"
    pq.write_table(PEOPLE.slice(0, 0), path)
    staged = inspect_staged(path)
    assert plan_splits(staged) == []
    assert [f.name for f in to_spark_schema(staged.arrow_schema)] == ["id", "name", "score"]


# --- CSV, JSON lines, Arrow IPC ------------------------------------------------------


def test_csv_with_header(tmp_path: Path) -> None:
    path = tmp_path / "people.csv"
    path.write_text("id,name,score\n1,ada,1.5\n2,bob,\n3,,3.25\n")
    staged = inspect_staged(path)
    assert to_spark_schema(staged.arrow_schema) == StructType(
        [
            StructField("id", LongType()),
            StructField("name", StringType()),
            StructField("score", DoubleType()),
        ]
    )
    assert rows(read_all(staged)) == [
        {"id": 1, "name": "ada", "score": 1.5},
        {"id": 2, "name": "bob", "score": None},
        {"id": 3, "name": "", "score": 3.25},
    ]


def test_csv_without_header_with_delimiter_uses_spark_column_names(tmp_path: Path) -> None:
    path = tmp_path / "raw.csv"
    path.write_text("1;x\n2;y\n")
    staged = inspect_staged(path, csv=CsvOptions(header=False, delimiter=";"))
    assert staged.arrow_schema.names == ["_c0", "_c1"]
    assert rows(read_all(staged)) == [{"_c0": 1, "_c1": "x"}, {"_c0": 2, "_c1": "y"}]


def test_csv_files_of_a_directory_get_one_widened_type(tmp_path: Path) -> None:
    (tmp_path / "part-0.csv").write_text("k,v\na,1\nb,2\n")
    with gzip.open(tmp_path / "part-1.csv.gz", "wt") as f:  # compressed parts are read too
        f.write("k,v\nc,2.5\n")
    staged = inspect_staged(tmp_path)
    assert staged.file_schema.field("v").type == pa.float64()
    assert rows(read_all(staged), "k") == [
        {"k": "a", "v": 1.0},
        {"k": "b", "v": 2.0},
        {"k": "c", "v": 2.5},
    ]


def test_json_lines_with_nested_values(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    path.write_text(
        '{"id": 1, "tags": ["a", "b"], "user": {"name": "ada", "age": 36}}\n'
        '{"id": 2, "tags": [], "user": {"name": "bob", "age": null}}\n'
        '{"id": 3, "user": null}\n'
    )
    staged = inspect_staged(path)
    spark_schema = to_spark_schema(staged.arrow_schema)
    assert spark_schema["tags"].dataType == ArrayType(StringType())
    assert spark_schema["user"].dataType == StructType(
        [StructField("name", StringType()), StructField("age", LongType())]
    )
    assert rows(read_all(staged)) == [
        {"id": 1, "tags": ["a", "b"], "user": {"name": "ada", "age": 36}},
        {"id": 2, "tags": [], "user": {"name": "bob", "age": None}},
        {"id": 3, "tags": None, "user": None},
    ]


@pytest.mark.parametrize("layout", ["file", "stream"])
@pytest.mark.parametrize("extension", [".arrow", ".feather", ".ipc"])
def test_arrow_ipc_file_and_stream_layouts(tmp_path: Path, layout: str, extension: str) -> None:
    path = tmp_path / f"frame{extension}"
    opener = pa_ipc.new_file if layout == "file" else pa_ipc.new_stream
    with opener(path, PEOPLE.schema) as writer:
        for batch in PEOPLE.to_batches(max_chunksize=3):
            writer.write_batch(batch)
    staged = inspect_staged(path)
    assert staged.format == "arrow"
    assert rows(read_all(staged)) == PEOPLE.to_pylist()


# --- directories as Spark writes them ------------------------------------------------


def test_spark_output_directory_reads_part_files_only(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    pq.write_table(PEOPLE.slice(0, 4), out / "part-00000-5e1c-c000.snappy.parquet")
    pq.write_table(PEOPLE.slice(4), out / "part-00001-5e1c-c000.snappy.parquet")
    (out / "_SUCCESS").write_text("")
    (out / ".part-00000-5e1c-c000.snappy.parquet.crc").write_bytes(b"crc")
    (out / "._SUCCESS.crc").write_bytes(b"crc")
    (out / "_temporary" / "0").mkdir(parents=True)
    pq.write_table(PEOPLE, out / "_temporary" / "0" / "part-00009.parquet")  # never read

    staged = inspect_staged(out)
    assert [Path(f.path).name for f in staged.files] == [
        "part-00000-5e1c-c000.snappy.parquet",
        "part-00001-5e1c-c000.snappy.parquet",
    ]
    assert len(plan_splits(staged)) == 2  # one per file
    assert rows(read_all(staged), "id") == PEOPLE.to_pylist()


def test_hive_partition_directories_become_columns(tmp_path: Path) -> None:
    for country, year, ids in (("NL", "2024", [1, 2]), ("DE", "2025", [3]), ("a%2Fb", None, [4])):
        year_dir = "__HIVE_DEFAULT_PARTITION__" if year is None else year
        part = tmp_path / f"country={country}" / f"year={year_dir}"
        part.mkdir(parents=True)
        pq.write_table(pa.table({"id": ids}), part / "part-0.parquet")
    staged = inspect_staged(tmp_path)
    spark_schema = to_spark_schema(staged.arrow_schema)
    assert spark_schema.names == ["id", "country", "year"]
    assert spark_schema["year"].dataType == IntegerType()
    assert rows(read_all(staged), "id") == [
        {"id": 1, "country": "NL", "year": 2024},
        {"id": 2, "country": "NL", "year": 2024},
        {"id": 3, "country": "DE", "year": 2025},
        {"id": 4, "country": "a/b", "year": None},
    ]


# --- casting to what Spark has -----------------------------------------------------------


def test_types_spark_lacks_are_cast(tmp_path: Path) -> None:
    paris = dt.timezone(dt.timedelta(hours=1))
    instant = dt.datetime(2024, 1, 2, 3, 4, 5, 123456, tzinfo=paris)
    nested_type = pa.struct([("count", pa.uint16()), ("labels", pa.large_list(pa.large_string()))])
    table = pa.table(
        {
            "u8": pa.array([255], pa.uint8()),
            "u16": pa.array([65535], pa.uint16()),
            "u32": pa.array([2**32 - 1], pa.uint32()),
            "u64": pa.array([2**64 - 1], pa.uint64()),
            "text": pa.array(["ü"], pa.large_string()),
            "blob": pa.array([b"\x00\x01"], pa.large_binary()),
            # 789 ns more than Spark's microseconds can hold: truncated, not an error.
            "at": pa.array([1_704_161_045_123_456_789], pa.timestamp("ns", tz="Europe/Paris")),
            "wall": pa.array([dt.datetime(2024, 1, 2, 3, 4, 5)], pa.timestamp("ms")),
            "day": pa.array([dt.date(2024, 1, 2)], pa.date64()),
            "cat": pa.array(["x"]).dictionary_encode(),
            "nested": pa.array([{"count": 7, "labels": ["p", None]}], nested_type),
            "pairs": pa.array([[("k", 1)]], pa.map_(pa.large_string(), pa.uint32())),
        }
    )
    path = tmp_path / "odd.arrow"
    with pa_ipc.new_file(path, table.schema) as writer:
        writer.write_table(table)

    staged = inspect_staged(path)
    spark_schema = to_spark_schema(staged.arrow_schema)
    assert [(f.name, f.dataType) for f in spark_schema] == [
        ("u8", ShortType()),
        ("u16", IntegerType()),
        ("u32", LongType()),
        ("u64", DecimalType(20, 0)),
        ("text", StringType()),
        ("blob", BinaryType()),
        ("at", TimestampType()),
        ("wall", TimestampNTZType()),
        ("day", DateType()),
        ("cat", StringType()),
        (
            "nested",
            StructType(
                [
                    StructField("count", IntegerType()),
                    StructField("labels", ArrayType(StringType())),
                ]
            ),
        ),
        ("pairs", MapType(StringType(), LongType())),
    ]

    (row,) = rows(read_all(staged))
    assert row == {
        "u8": 255,
        "u16": 65535,
        "u32": 2**32 - 1,
        "u64": decimal.Decimal(2**64 - 1),
        "text": "ü",
        "blob": b"\x00\x01",
        "at": instant.astimezone(dt.UTC),
        "wall": dt.datetime(2024, 1, 2, 3, 4, 5),
        "day": dt.date(2024, 1, 2),
        "cat": "x",
        "nested": {"count": 7, "labels": ["p", None]},
        "pairs": [("k", 1)],
    }


def test_rarer_arrow_types_are_cast() -> None:
    batch = pa.record_batch(
        {
            "fixed": pa.array([b"ab"], pa.binary(2)),
            "clock": pa.array([dt.time(1, 2, 3)], pa.time32("s")),
            "half": pa.array([1.5], pa.float32()).cast(pa.float16()),
            "huge": pa.array([decimal.Decimal("1" * 40)], pa.decimal256(40, 0)),
            "small": pa.array([decimal.Decimal("1.5")], pa.decimal256(10, 1)),
            "wait": pa.array([dt.timedelta(seconds=3)], pa.duration("s")),
            "view": pa.array([[1, 2]], pa.list_view(pa.int64())),
            "inner": pa.array([{"x": [1]}], pa.struct([("x", pa.list_view(pa.uint8()))])),
            "sview": pa.array(["x"], pa.string_view()),
            "pair": pa.array([[1, 2]], pa.list_(pa.int32(), 2)),
            "id": pa.array([b"0123456789abcdef"], pa.uuid()),
            "nothing": pa.nulls(1),
        }
    )
    expected = {
        "fixed": b"ab",
        "clock": dt.time(1, 2, 3),
        "half": 1.5,
        "huge": "1" * 40,  # wider than Spark's 38 digits: exact text
        "small": decimal.Decimal("1.5"),
        "wait": dt.timedelta(seconds=3),
        "view": [1, 2],
        "inner": {"x": [1]},
        "sview": "x",
        "pair": [1, 2],
        "id": b"0123456789abcdef",
        "nothing": None,
    }
    clock = "clock:time(6),"
    if not hasattr(pyspark_types, "TimeType"):
        # PySpark 4.0 has no TIME type (4.1 added it): one clear error, the rest as on 4.1+.
        with pytest.raises(UnsupportedFormatError, match=r"column 'clock' has Arrow type time32"):
            to_spark_schema(batch.schema)
        batch, clock = batch.drop_columns(["clock"]), ""
        del expected["clock"]
    spark_schema = to_spark_schema(batch.schema)
    assert spark_schema.simpleString() == (
        f"struct<fixed:binary,{clock}half:float,huge:string,small:decimal(10,1),"
        "wait:interval day to second,view:array<bigint>,inner:struct<x:array<smallint>>,"
        "sview:string,pair:array<int>,id:binary,nothing:void>"
    )
    target = spark_arrow_schema(spark_schema)
    out = cast_batch(batch, target)
    out.validate(full=True)
    assert out.schema.equals(target)
    assert out.to_pylist() == [expected]


def test_cast_batch_matches_the_target_exactly() -> None:
    batch = pa.record_batch(
        {"b": pa.array(["x", None], pa.large_string()), "a": pa.array([1, 2], pa.uint8())}
    )
    target = pa.schema(
        [
            pa.field("a", pa.int16(), nullable=False),
            pa.field("b", pa.string()),
            pa.field("missing", pa.float64()),
            pa.field("part", pa.int32()),
        ]
    )
    out = cast_batch(batch, target, {"part": pa.scalar(7, pa.int32())})
    assert out.schema.equals(target)
    assert out.to_pylist() == [
        {"a": 1, "b": "x", "missing": None, "part": 7},
        {"a": 2, "b": None, "missing": None, "part": 7},
    ]


def test_cast_batch_refuses_nulls_in_non_nullable_columns() -> None:
    batch = pa.record_batch({"v": pa.array([1, None], pa.int64())})
    with pytest.raises(StagedDataError, match=r"column 'v' is declared non-nullable but holds 1"):
        cast_batch(batch, pa.schema([pa.field("v", pa.int64(), nullable=False)]))
    with pytest.raises(StagedDataError, match=r"column 'w' is declared non-nullable"):
        cast_batch(batch, pa.schema([pa.field("w", pa.int64(), nullable=False)]))


def test_cast_batch_refuses_lossy_casts() -> None:
    batch = pa.record_batch({"v": pa.array([300], pa.int64())})
    with pytest.raises(StagedDataError, match=r"column 'v': cannot convert int64 to int8"):
        cast_batch(batch, pa.schema([pa.field("v", pa.int8())]))


def test_reading_a_split_whose_file_vanished_says_what_to_do(tmp_path: Path) -> None:
    path = tmp_path / "people.parquet"
    pq.write_table(PEOPLE, path)
    staged = inspect_staged(path)
    (split,) = plan_splits(staged)
    path.unlink()
    with pytest.raises(StagedDataError, match="staging_dir"):
        list(read_split(staged, split, target_for(staged)))


# --- options ------------------------------------------------------------------------------


def test_missing_code_names_the_option() -> None:
    with pytest.raises(OptionError, match=r'option "code" is required'):
        ReadSettings.from_options({"accept": "file"})


@pytest.mark.parametrize(
    ("options", "pattern"),
    [
        ({"code": "7-a-b", "accept": "maybe"}, r"accept='maybe' is not one of file, dataset"),
        ({"code": "7-a-b", "staged_path": "/x"}, "code and staged_path exclude each other"),
        ({"code": "7-a-b", "accept": "file", "colour": "red"}, "unknown option colour"),
        ({"code": "7-a-b", "accept": "file", "timeout": "soon"}, "timeout='soon'"),
        ({"code": "7-a-b", "accept": "file", "timeout": "-1"}, "positive number"),
        ({"code": "7-a-b", "accept": "file", "header": "maybe"}, "header='maybe'"),
        ({"code": "7-a-b", "accept": "file", "delimiter": ";;"}, "single character"),
        ({"code": "7-a-b", "accept": "file", "format": "orc"}, "format='orc'"),
    ],
)
def test_bad_options_are_clear_errors(options: dict[str, str], pattern: str) -> None:
    with pytest.raises(OptionError, match=pattern):
        ReadSettings.from_options(options)


def test_option_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SPARK_DILATION_MAILBOX", raising=False)
    monkeypatch.setenv("SPARK_DILATION_RELAY", "tcp:relay.example:4001")
    settings = ReadSettings.from_options({"code": " 7-a-b ", "ACCEPT": "File"})
    assert settings.code == "7-a-b"
    assert settings.accept == "file"
    assert settings.relay == "tcp:relay.example:4001"
    assert settings.timeout is None
    assert settings.format is None
    assert settings.csv == CsvOptions(header=True, delimiter=",")
    assert settings.staging_root == default_staging_root()
    assert default_staging_root().name == "spark-dilation"
    from spark_dilation.wormhole import DEFAULT_MAILBOX_URL

    assert settings.mailbox_url == DEFAULT_MAILBOX_URL
    monkeypatch.setenv("SPARK_DILATION_MAILBOX", "ws://127.0.0.1:4000/v1")
    assert settings.mailbox_url == "ws://127.0.0.1:4000/v1"

    explicit = ReadSettings.from_options(
        {
            "code": "7-a-b",
            "accept": "file",
            "mailbox": "ws://m/v1",
            "relay": "tcp:r:1",
            "timeout": "2.5",
            "format": "JSONL",
            "staging_dir": "/data/stage",
            "header": "false",
            "delimiter": "\\t",
        }
    )
    assert explicit.mailbox_url == "ws://m/v1"
    assert explicit.relay == "tcp:r:1"
    assert explicit.timeout == 2.5
    assert explicit.format == "json"
    assert explicit.staging_root == Path("/data/stage")
    assert explicit.csv == CsvOptions(header=False, delimiter="\t")


def test_staged_path_needs_no_code_and_path_is_its_alias() -> None:
    assert ReadSettings.from_options({"staged_path": "/x"}).staged_path == "/x"
    assert ReadSettings.from_options({"path": "/y"}).staged_path == "/y"


def test_staging_dirs_are_fresh_and_unique(tmp_path: Path) -> None:
    first, second = new_staging_dir(tmp_path / "stage"), new_staging_dir(tmp_path / "stage")
    assert first != second
    assert first.parent == second.parent == tmp_path / "stage"
    assert list(first.iterdir()) == []


def test_failed_receive_leaves_no_staging_dir(mailbox_url: str, tmp_path: Path) -> None:
    from spark_dilation.errors import DilationError
    from spark_dilation.spark import receive_file

    stage = tmp_path / "stage"
    with pytest.raises(DilationError, match="nobody used the code"):
        receive_file("80204-nobody-here", mailbox=mailbox_url, timeout=1, staging_dir=stage)
    assert list(stage.iterdir()) == []


# --- the data source object, driven the way Spark drives it, without Spark ---------------------


def test_data_source_round_trip_through_pickles(tmp_path: Path) -> None:
    path = tmp_path / "people.parquet"
    pq.write_table(PEOPLE, path, row_group_size=2)

    # Planner worker 1: create the source and infer the schema (this is where a
    # code would be used), then Spark pickles the instance.
    source = DilationDataSource({"staged_path": str(path)})
    schema = source.schema()
    source = pickle.loads(pickle.dumps(source))
    # Planner worker 2: the reader and its partitions, pickled to the tasks.
    reader = source.reader(schema)
    partitions = pickle.loads(pickle.dumps(reader.partitions()))
    reader = pickle.loads(pickle.dumps(reader))
    # Task workers: one partition each.
    target = spark_arrow_schema(schema)
    batches = [batch for p in partitions for batch in reader.read(p)]
    assert all(batch.schema.equals(target) for batch in batches)
    assert pa.Table.from_batches(batches).to_pylist() == PEOPLE.to_pylist()


def test_declared_schema_with_staged_path_casts_by_name(tmp_path: Path) -> None:
    path = tmp_path / "people.parquet"
    pq.write_table(PEOPLE, path)
    declared = StructType([StructField("score", StringType()), StructField("id", ByteType())])
    reader = DilationDataSource({"staged_path": str(path)}).reader(declared)
    (partition,) = reader.partitions()
    table = pa.Table.from_batches(list(reader.read(partition)))
    assert table.column("id").to_pylist() == list(range(1, 8))
    assert table.column("score").to_pylist()[:2] == ["1.5", "2"]


def test_declared_schema_with_a_code_is_refused() -> None:
    source = DilationDataSource({"code": "7-a-b", "accept": "file"})
    with pytest.raises(
        OptionError, match=r"declared schema .* cannot be combined with option code"
    ):
        source.reader(StructType([StructField("id", LongType())]))


def test_writer_needs_a_code_and_known_options() -> None:
    with pytest.raises(OptionError, match=r'option "code" is required to send'):
        DilationDataSource({}).writer(StructType([]), overwrite=False)
    with pytest.raises(OptionError, match="unknown option lanez"):
        DilationDataSource({"code": "7-a-b", "lanez": "2"}).writer(StructType([]), overwrite=False)


# --- real Spark ---------------------------------------------------------------------------------


def test_spark_finds_dilation_without_register(spark, tmp_path: Path) -> None:
    """(a) Spark discovers top-level ``pyspark_*`` modules exporting ``DefaultSource``.

    Nothing in this module calls ``spark.dataSource.register``. Spark's
    Python workers import ``pyspark_dilation`` from wherever it is importable
    for them: site-packages for a normal install; the repository root for an
    editable install (the pytest run's working directory, inherited by the
    workers, or a static .pth entry).
    """
    path = tmp_path / "people.parquet"
    pq.write_table(PEOPLE, path)
    df = spark.read.format("dilation").option("staged_path", str(path)).load()
    assert df.schema == StructType(
        [
            StructField("id", LongType()),
            StructField("name", StringType()),
            StructField("score", DoubleType()),
        ]
    )


def test_spark_loads_a_spark_output_directory(spark, tmp_path: Path) -> None:
    """(b) A directory as Spark writes it, loaded from its staged path, row for row."""
    out = tmp_path / "out"
    source = spark.sql(
        """
        SELECT id,
               CAST(id * 1.5 AS DECIMAL(10, 2)) AS amount,
               DATE'2024-01-01' + CAST(id AS INT) AS day,
               TIMESTAMP'2024-01-01 12:00:00' + make_interval(0, 0, 0, 0, 0, 0, id) AS at,
               IF(id % 3 = 0, NULL, CONCAT('n', id)) AS name,
               ARRAY(id, id + 1) AS pair,
               IF(id % 2 = 0, 'even', 'odd') AS parity
        FROM range(0, 50, 1, 3)
        """
    )
    source.write.partitionBy("parity").parquet(str(out))
    assert (out / "_SUCCESS").exists()

    df = spark.read.format("dilation").option("staged_path", str(out)).load()
    # Spark's recorded types win over what the Parquet footer alone says
    # (its INT96 timestamps are instants, not wall-clock times).
    assert df.schema["at"].dataType == TimestampType()
    assert df.schema["parity"].dataType == StringType()
    assert df.rdd.getNumPartitions() == len(list(out.glob("parity=*/part-*.parquet")))
    assert df.count() == 50
    expected = source.orderBy("id").collect()
    assert df.select(*source.columns).orderBy("id").collect() == expected


def test_spark_passes_csv_options_through(spark, tmp_path: Path) -> None:
    path = tmp_path / "raw.data"
    path.write_text("1|ada\n2|bob\n")
    df = (
        spark.read.format("dilation")
        .options(staged_path=str(path), format="csv", header="false", delimiter="|")
        .load()
    )
    assert [tuple(r) for r in df.orderBy("_c0").collect()] == [(1, "ada"), (2, "bob")]


def test_spark_missing_code_is_a_clear_error(spark) -> None:
    """(c) The planner worker's OptionError reaches the user with its sentence intact."""
    with pytest.raises(Exception, match=r'option "code" is required'):
        spark.read.format("dilation").option("accept", "file").load()


# --- end to end with a real peer --------------------------------------------------------------


def _reference_send(servers, path: Path, code: str) -> subprocess.Popen:
    """`wormhole send PATH` with the reference CLI, on the local servers only."""
    wormhole_cli = Path(sys.executable).parent / "wormhole"
    return subprocess.Popen(
        [
            str(wormhole_cli),
            "--relay-url",
            servers.mailbox_url,
            "--transit-helper",
            servers.relay_url,
            "send",
            "--code",
            code,
            str(path),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=path.parent,
    )


def test_spark_loads_a_file_sent_with_the_reference_cli(spark, wormhole_servers, tmp_path):
    table = pa.table(
        {
            "id": pa.array(range(1000), pa.int64()),
            "name": pa.array([f"row-{i}" for i in range(1000)]),
            "score": pa.array([i / 7 for i in range(1000)], pa.float64()),
        }
    )
    source = tmp_path / "sent" / "data.parquet"
    source.parent.mkdir()
    pq.write_table(table, source, row_group_size=300)
    code = "3141-spark-parquet"
    sender = _reference_send(wormhole_servers, source, code)
    try:
        df = (
            spark.read.format("dilation")
            .option("code", code)
            .option("accept", "file")
            .option("mailbox", wormhole_servers.mailbox_url)
            .option("relay", wormhole_servers.relay_url)
            .option("staging_dir", str(tmp_path / "staging"))
            .option("timeout", "60")
            .load()
        )
        rows = sorted(tuple(r) for r in df.collect())
        _out, err = sender.communicate(timeout=90)
    finally:
        if sender.poll() is None:
            sender.kill()
    assert sender.returncode == 0, err.decode()
    assert rows == sorted(zip(*[table[c].to_pylist() for c in table.column_names], strict=True))
    assert df.count() == 1000  # a second action reads the staged copy: the code is spent


def test_spark_loads_a_spark_output_directory_sent_with_the_reference_cli(
    spark, wormhole_servers, tmp_path
):
    out_dir = tmp_path / "sent" / "events"
    spark.range(0, 500, numPartitions=3).selectExpr("id", "id % 7 AS bucket").write.parquet(
        str(out_dir)
    )
    code = "2718-spark-directory"
    sender = _reference_send(wormhole_servers, out_dir, code)
    try:
        df = (
            spark.read.format("dilation")
            .options(code=code, accept="file", timeout="60")
            .option("mailbox", wormhole_servers.mailbox_url)
            .option("relay", wormhole_servers.relay_url)
            .option("staging_dir", str(tmp_path / "staging"))
            .load()
        )
        got = sorted((r.id, r.bucket) for r in df.collect())
        sender.communicate(timeout=90)
    finally:
        if sender.poll() is None:
            sender.kill()
    assert sender.returncode == 0
    assert got == [(i, i % 7) for i in range(500)]
    assert df.filter("bucket = 3").count() == len([i for i in range(500) if i % 7 == 3])


def test_the_session_jvm_starts_on_the_class_data_archive(spark) -> None:
    """Under make test (SPARK_DILATION_JVM_ARCHIVE) the session's JVM maps the archive:
    anything that changes the JVMs' class path (a conf folder, a jar) silently turns it
    off and doubles every JVM's start-up CPU. Without it, no JVM is pointed at one."""
    import os

    from pyspark import SparkContext

    from spark_dilation.testing import jvm_archive

    gateway = SparkContext._gateway
    assert gateway is not None and gateway.proc is not None
    maps = Path(f"/proc/{gateway.proc.pid}/maps").read_text()
    folder = os.environ.get(jvm_archive.ENV)
    if folder:
        archive = jvm_archive.archive_path(Path(folder))
        assert archive.exists(), f"make test builds {archive} before the Spark tests"
        assert str(archive) in maps, f"the session's JVM does not use {archive}"
    else:
        assert "SharedArchiveFile" not in os.environ.get("JAVA_TOOL_OPTIONS", "")
        assert ".jsa" not in maps.replace("/classes.jsa", ""), "an archive other than the JDK's"
