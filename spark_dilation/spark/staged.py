"""Staged data: a received file or directory read with plain pyarrow, no Spark.

A file sent with ``wormhole send`` lands on local disk first (the *staged*
copy). This module knows how to look at it: which format it is
(:func:`detect_format`), which files of a directory hold data
(:func:`inspect_staged`), what its Arrow schema is and how to turn that into
types Spark has (:func:`spark_compatible_schema`), how to split it into read
tasks (:func:`plan_splits`) and how to read one split as record batches cast
exactly to a declared schema (:func:`read_split`, :func:`cast_batch`).

Nothing here imports Spark, so all of it is unit-tested on plain files. The
Spark glue in :mod:`spark_dilation.spark.datasource` calls :func:`inspect_staged`
in a planner worker, :func:`plan_splits` in another one and :func:`read_split`
in task workers; every object passed between them is a small picklable
dataclass.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import unquote

import pyarrow as pa
import pyarrow.ipc as pa_ipc
import pyarrow.types as pat

from ..errors import DilationError

if TYPE_CHECKING:
    import pyarrow.csv as pa_csv
    import pyarrow.parquet as pq

# pyarrow.compute, .csv, .json and .parquet are imported where they are used:
# every Spark worker that unpickles our data source or writer imports this
# module, and those four cost ~0.1 CPU-s per process (pyarrow.compute most).

__all__ = [
    "DEFAULT_BATCH_ROWS",
    "DEFAULT_SPLIT_BYTES",
    "SUPPORTED_FORMATS",
    "CsvOptions",
    "DataFile",
    "Split",
    "StagedDataError",
    "StagedDataset",
    "UnsupportedFormatError",
    "cast_batch",
    "detect_format",
    "inspect_staged",
    "is_data_file_name",
    "normalize_format",
    "plan_splits",
    "read_split",
    "spark_compatible_schema",
    "spark_compatible_type",
]

SUPPORTED_FORMATS: tuple[str, ...] = ("parquet", "csv", "json", "arrow")

# File name endings -> format. JSON means JSON Lines (one object per line),
# which is what Spark and pyarrow both read and write.
_EXTENSIONS: dict[str, str] = {
    ".parquet": "parquet",
    ".csv": "csv",
    ".json": "json",
    ".jsonl": "json",
    ".ndjson": "json",
    ".arrow": "arrow",
    ".feather": "arrow",
    ".ipc": "arrow",
}
# Text formats may be compressed; pyarrow decompresses these by file name.
# (Parquet and Arrow compress inside the file, so ".snappy.parquet" simply
# ends in ".parquet".)
_COMPRESSION_SUFFIXES: tuple[str, ...] = (".gz", ".bz2", ".zst")

# Spark's default spark.sql.files.maxPartitionBytes: a read task gets about
# this much uncompressed Parquet, in whole row groups.
DEFAULT_SPLIT_BYTES = 128 * 1024 * 1024
# Rows per record batch handed to Spark; small enough to bound a task's memory.
DEFAULT_BATCH_ROWS = 65_536

# The value Spark (and Hive) write for a null partition value.
_HIVE_NULL = "__HIVE_DEFAULT_PARTITION__"


class UnsupportedFormatError(DilationError, ValueError):
    """The staged file's format is unknown, ambiguous or not readable as data."""


class StagedDataError(DilationError):
    """The staged data is missing, unreadable, or does not fit the declared schema."""


def _supported_list() -> str:
    extensions = ", ".join(_EXTENSIONS)
    return (
        f"supported formats are {', '.join(SUPPORTED_FORMATS)} (file names ending in "
        f'{extensions}); force one with .option("format", "parquet") (or csv, json, arrow)'
    )


@dataclass(frozen=True)
class CsvOptions:
    """How to parse CSV files, with Spark's option names and defaults where they differ."""

    header: bool = True
    delimiter: str = ","


@dataclass(frozen=True)
class DataFile:
    """One data file of a staged dataset.

    ``partition_values`` holds Hive-style ``key=value`` directory parts between
    the dataset root and the file (what ``df.write.partitionBy(...)`` writes),
    already URL-unescaped; ``None`` stands for Spark's null partition.
    """

    path: str
    partition_values: tuple[tuple[str, str | None], ...] = ()


@dataclass(frozen=True)
class StagedDataset:
    """A staged file or directory, inspected: format, data files and Arrow schema.

    ``file_schema`` is the raw Arrow schema of the files' own columns, unified
    over all files; ``partition_schema`` the Hive partition columns that come
    after them. Both are plain pyarrow schemas, so the object pickles cheaply
    from the planner worker that builds it to the task workers that read.
    """

    root: str
    format: str
    files: tuple[DataFile, ...]
    file_schema: pa.Schema
    partition_schema: pa.Schema = field(default_factory=lambda: pa.schema([]))
    csv: CsvOptions = field(default_factory=CsvOptions)

    @property
    def arrow_schema(self) -> pa.Schema:
        """File columns followed by partition columns, with the files' own types.

        The files' schema metadata is kept: it may say how Spark wrote them.
        """
        return pa.schema(
            list(self.file_schema) + list(self.partition_schema),
            metadata=self.file_schema.metadata,
        )


@dataclass(frozen=True)
class Split:
    """One read task: a data file, optionally restricted to some Parquet row groups."""

    file: DataFile
    row_groups: tuple[int, ...] | None = None


# --- format detection and discovery -----------------------------------------


def detect_format(name: str) -> str | None:
    """The format a file name's extension implies, or ``None`` if it implies none.

    Compression suffixes of text formats are looked through: ``data.csv.gz`` is CSV.
    """
    lower = name.lower()
    for suffix in _COMPRESSION_SUFFIXES:
        if lower.endswith(suffix):
            lower = lower[: -len(suffix)]
            break
    return _EXTENSIONS.get(os.path.splitext(lower)[1])


def is_data_file_name(name: str) -> bool:
    """False for the bookkeeping files Spark/Hadoop write next to data.

    Hidden and underscore files (``_SUCCESS``, ``_committed_*``, ``.part-0.crc``,
    ``_metadata``) and checksums are never data: Spark's own file source skips
    them by the same rule.
    """
    return not (name.startswith(("_", ".")) or name.lower().endswith(".crc"))


def normalize_format(fmt: str | None) -> str | None:
    """A format name as given by the user, lower-cased and de-aliased (feather -> arrow)."""
    if fmt is None:
        return None
    normalized = fmt.strip().lower()
    aliases = {"feather": "arrow", "ipc": "arrow", "jsonl": "json", "ndjson": "json"}
    normalized = aliases.get(normalized, normalized)
    if normalized not in SUPPORTED_FORMATS:
        raise UnsupportedFormatError(f"option format={fmt!r} is not supported; {_supported_list()}")
    return normalized


def _list_data_files(root: Path) -> list[tuple[Path, tuple[tuple[str, str | None], ...]]]:
    """Data files under ``root`` in a stable order, with their Hive partition values."""
    found: list[tuple[Path, tuple[tuple[str, str | None], ...]]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Prune in place: os.walk then skips _temporary/, .spark-staging/ and the like.
        dirnames[:] = sorted(d for d in dirnames if is_data_file_name(d))
        rel_parts = Path(dirpath).relative_to(root).parts
        values: list[tuple[str, str | None]] = []
        for part in rel_parts:
            key, sep, raw = part.partition("=")
            if sep and key:
                value = unquote(raw)
                values.append((unquote(key), None if value == _HIVE_NULL else value))
        for name in sorted(filenames):
            if is_data_file_name(name):
                found.append((Path(dirpath, name), tuple(values)))
    return found


def inspect_staged(
    path: str | os.PathLike[str],
    *,
    format: str | None = None,
    csv: CsvOptions | None = None,
) -> StagedDataset:
    """Find the data in a received file or directory and infer its Arrow schema.

    Runs where the data was staged (for Spark: the planner worker that ran
    ``schema()``). ``format`` overrides detection from file name extensions.
    A directory is read as one dataset: every data file in it (recursively,
    with Hive ``key=value`` directories as partition columns) must have the
    same format; bookkeeping files such as ``_SUCCESS`` and ``*.crc`` are ignored.
    """
    root = Path(path)
    csv = csv or CsvOptions()
    forced = normalize_format(format)
    if not root.exists():
        raise StagedDataError(
            f"the staged data {root} does not exist (was it received on another machine, "
            "or cleaned up?)"
        )
    if root.is_dir():
        entries = _list_data_files(root)
        if not entries:
            raise StagedDataError(
                f"the received directory {root} holds no data files (only hidden or "
                "bookkeeping files such as _SUCCESS and .crc, or nothing at all)"
            )
    else:
        entries = [(root, ())]

    fmt = forced or _common_format([p for p, _ in entries], root)
    keys = {tuple(k for k, _ in values) for _, values in entries}
    if len(keys) > 1:
        raise StagedDataError(
            f"the received directory {root} mixes different partition directories "
            f"({' vs '.join('/'.join(k) or '(none)' for k in sorted(keys))}); "
            "send one dataset per transfer"
        )
    files = tuple(DataFile(str(p), values) for p, values in entries)
    file_schema = _unify([_file_schema(Path(f.path), fmt, csv) for f in files], root)
    partition_schema = _partition_schema(files, file_schema)
    return StagedDataset(str(root), fmt, files, file_schema, partition_schema, csv)


def _common_format(paths: Sequence[Path], root: Path) -> str:
    formats = {p: detect_format(p.name) for p in paths}
    unknown = [p.name for p, f in formats.items() if f is None]
    if unknown:
        shown = ", ".join(unknown[:5]) + (
            f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""
        )
        raise UnsupportedFormatError(
            f"cannot tell the format of {shown} from the file name; {_supported_list()}"
        )
    found = sorted({f for f in formats.values() if f is not None})
    if len(found) > 1:
        raise UnsupportedFormatError(
            f"the received directory {root} mixes formats ({', '.join(found)}); "
            'send one format per transfer, or force one with .option("format", ...)'
        )
    return found[0]


def _unify(schemas: Sequence[pa.Schema], root: Path) -> pa.Schema:
    if len(schemas) == 1:
        return schemas[0]
    try:
        # "permissive" widens compatible types across files (int64 + double ->
        # double, null -> anything) the way Spark's schema merging does.
        return pa.unify_schemas(list(schemas), promote_options="permissive")
    except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
        raise StagedDataError(
            f"the files in {root} have schemas that cannot be merged: {exc}"
        ) from exc


def _partition_schema(files: Sequence[DataFile], file_schema: pa.Schema) -> pa.Schema:
    """Infer partition column types from their values, like Spark's partition discovery."""
    if not files or not files[0].partition_values:
        return pa.schema([])
    fields = []
    for index, (name, _) in enumerate(files[0].partition_values):
        if name in file_schema.names:
            continue  # the files carry the column themselves; trust them
        values = [f.partition_values[index][1] for f in files]
        fields.append(pa.field(name, _infer_partition_type(values), nullable=True))
    return pa.schema(fields)


def _infer_partition_type(values: Sequence[str | None]) -> pa.DataType:
    present = [v for v in values if v is not None]
    if not present:
        return pa.string()
    for candidate, parse in ((pa.int32(), int), (pa.int64(), int), (pa.float64(), float)):
        try:
            parsed = [parse(v) for v in present]
        except ValueError:
            continue
        if candidate == pa.int32() and not all(-(2**31) <= p < 2**31 for p in parsed):
            continue
        return candidate
    return pa.string()


# --- reading files ----------------------------------------------------------


def _csv_read_options(csv: CsvOptions) -> pa_csv.ReadOptions:
    import pyarrow.csv as pa_csv

    return pa_csv.ReadOptions(autogenerate_column_names=not csv.header)


def _read_csv(path: Path, csv: CsvOptions, column_types: pa.Schema | None = None) -> pa.Table:
    import pyarrow.csv as pa_csv

    types: dict[str, pa.DataType] | None = None
    if column_types is not None:
        # Without a header pyarrow calls the columns f0, f1, ... until renamed below.
        types = {(f"f{f.name[2:]}" if not csv.header else f.name): f.type for f in column_types}
    convert = pa_csv.ConvertOptions(column_types=types)
    # Whole-file read on purpose: pyarrow's table reader infers each column's
    # type over all blocks (the streaming reader fixes it after the first one).
    table = pa_csv.read_csv(
        path,
        read_options=_csv_read_options(csv),
        parse_options=pa_csv.ParseOptions(delimiter=csv.delimiter),
        convert_options=convert,
    )
    if not csv.header:
        # Spark names headerless CSV columns _c0, _c1, ...; pyarrow says f0, f1.
        table = table.rename_columns([f"_c{i}" for i in range(table.num_columns)])
    return table


def _read_json(path: Path, explicit: pa.Schema | None = None) -> pa.Table:
    import pyarrow.json as pa_json

    parse = pa_json.ParseOptions(
        explicit_schema=explicit,
        unexpected_field_behavior="ignore" if explicit is not None else "infer",
    )
    return pa_json.read_json(path, parse_options=parse)


def _open_ipc(path: Path) -> pa_ipc.RecordBatchFileReader | pa_ipc.RecordBatchStreamReader:
    # ".arrow" is used for both IPC layouts: try the file (Feather v2) layout,
    # then the stream layout.
    source = pa.memory_map(str(path))
    try:
        return pa_ipc.open_file(source)
    except pa.ArrowInvalid:
        source.seek(0)
        return pa_ipc.open_stream(source)


def _parquet_file(path: Path) -> pq.ParquetFile:
    import pyarrow.parquet as pq

    # Spark writes timestamps as INT96 by default; read them in microseconds
    # (Spark's unit), not pyarrow's default nanoseconds, which overflow
    # outside the years 1677-2262.
    return pq.ParquetFile(path, coerce_int96_timestamp_unit="us")


def _file_schema(path: Path, fmt: str, csv: CsvOptions) -> pa.Schema:
    try:
        if fmt == "parquet":
            return _parquet_file(path).schema_arrow
        if fmt == "arrow":
            return _open_ipc(path).schema
        if fmt == "csv":
            return _read_csv(path, csv).schema
        return _read_json(path).schema
    except (pa.ArrowException, OSError) as exc:
        raise StagedDataError(f"cannot read {path.name} as {fmt}: {exc}") from exc


# --- types Spark has --------------------------------------------------------


def spark_compatible_type(t: pa.DataType) -> pa.DataType:
    """The nearest Arrow type that Spark can hold without losing values.

    Spark has no unsigned integers (widened: uint64 becomes decimal(20, 0)),
    no large or view strings/binaries/lists, no half floats, no 64-bit dates,
    and keeps timestamps, times and durations in microseconds (nanoseconds
    for times), with time zone UTC for instants. Decimals wider than Spark's
    38 digits become their exact text. Struct and list fields are renamed and
    nested types converted the way Spark's own Arrow conversion expects.
    """
    if isinstance(t, pa.BaseExtensionType):
        return spark_compatible_type(t.storage_type)
    if pat.is_dictionary(t):
        return spark_compatible_type(t.value_type)
    if pat.is_unsigned_integer(t):
        return {8: pa.int16(), 16: pa.int32(), 32: pa.int64()}.get(
            t.bit_width, pa.decimal128(20, 0)
        )
    if pat.is_float16(t):
        return pa.float32()
    if pat.is_large_string(t) or pat.is_string_view(t):
        return pa.string()
    if pat.is_large_binary(t) or pat.is_binary_view(t) or pat.is_fixed_size_binary(t):
        return pa.binary()
    if pat.is_date64(t):
        return pa.date32()
    if pat.is_time(t):
        return pa.time64("ns")
    if pat.is_timestamp(t):
        # An instant (any zone) is Spark's TimestampType, stored as UTC; a
        # zone-less timestamp is TimestampNTZType (from_arrow_type with
        # prefer_timestamp_ntz=True), exactly how Spark writes them to Parquet.
        return pa.timestamp("us", tz="UTC" if t.tz is not None else None)
    if pat.is_duration(t):
        return pa.duration("us")
    if pat.is_decimal(t):
        if t.precision <= 38:
            return pa.decimal128(t.precision, t.scale)
        return pa.string()
    if pat.is_list(t) or pat.is_large_list(t) or pat.is_fixed_size_list(t) or _is_list_view(t):
        value = t.value_field
        return pa.list_(pa.field("element", spark_compatible_type(value.type), value.nullable))
    if pat.is_map(t):
        return pa.map_(
            pa.field("key", spark_compatible_type(t.key_type), nullable=False),
            pa.field("value", spark_compatible_type(t.item_type), t.item_field.nullable),
        )
    if pat.is_struct(t):
        return pa.struct(
            [pa.field(f.name, spark_compatible_type(f.type), f.nullable, f.metadata) for f in t]
        )
    return t


def _is_list_view(t: pa.DataType) -> bool:
    return bool(
        getattr(pat, "is_list_view", lambda _: False)(t)
        or getattr(pat, "is_large_list_view", lambda _: False)(t)
    )


def _has_list_view(t: pa.DataType) -> bool:
    if _is_list_view(t):
        return True
    if isinstance(t, pa.BaseExtensionType):
        return _has_list_view(t.storage_type)
    if pat.is_dictionary(t):
        return _has_list_view(t.value_type)
    return any(_has_list_view(t.field(i).type) for i in range(t.num_fields))


def spark_compatible_schema(schema: pa.Schema) -> pa.Schema:
    """:func:`spark_compatible_type` applied to every field; names and nullability kept."""
    return pa.schema(
        [pa.field(f.name, spark_compatible_type(f.type), f.nullable, f.metadata) for f in schema],
        metadata=schema.metadata,
    )


# --- splitting and reading --------------------------------------------------


def plan_splits(dataset: StagedDataset, *, split_bytes: int = DEFAULT_SPLIT_BYTES) -> list[Split]:
    """Read tasks for a staged dataset: one per file, Parquet one per group of row groups.

    Consecutive row groups are grouped until they hold ``split_bytes`` of
    uncompressed data, so a file of many small row groups does not become
    thousands of tiny tasks, and a big file is read by several tasks at once.
    Empty row groups, and so empty Parquet files, get no task.
    """
    import pyarrow.parquet as pq

    splits: list[Split] = []
    for data_file in dataset.files:
        if dataset.format != "parquet":
            splits.append(Split(data_file))
            continue
        metadata = pq.read_metadata(data_file.path)
        group: list[int] = []
        group_bytes = 0
        for index in range(metadata.num_row_groups):
            row_group = metadata.row_group(index)
            if row_group.num_rows == 0:
                continue  # pyarrow writes one empty row group for an empty table
            group.append(index)
            group_bytes += row_group.total_byte_size
            if group_bytes >= split_bytes:
                splits.append(Split(data_file, tuple(group)))
                group, group_bytes = [], 0
        if group:
            splits.append(Split(data_file, tuple(group)))
    return splits


def read_split(
    dataset: StagedDataset,
    split: Split,
    target: pa.Schema,
    *,
    batch_rows: int = DEFAULT_BATCH_ROWS,
) -> Iterator[pa.RecordBatch]:
    """Record batches of one split, each cast exactly to ``target`` (see :func:`cast_batch`).

    Runs in a Spark task worker. Columns are matched by name; ``target`` may be
    the inferred schema or one the user declared.
    """
    path = Path(split.file.path)
    if not path.exists():
        raise StagedDataError(
            f"the staged file {path} is not there on this machine. A received file is "
            "staged on the machine that planned the query; for a cluster, point option "
            "staging_dir at storage every executor can read, or use receive_file() and "
            "Spark's own readers on shared storage"
        )
    constants = _partition_constants(dataset, split.file)
    wanted = [f.name for f in target if f.name not in constants]
    try:
        for batch in _raw_batches(dataset, split, path, wanted, batch_rows):
            yield cast_batch(batch, target, constants)
    except pa.ArrowException as exc:
        raise StagedDataError(f"cannot read {path.name} as {dataset.format}: {exc}") from exc


def _partition_constants(dataset: StagedDataset, data_file: DataFile) -> dict[str, pa.Scalar]:
    values = dict(data_file.partition_values)
    return {
        f.name: pa.scalar(values.get(f.name), pa.string()).cast(f.type)
        for f in dataset.partition_schema
    }


def _raw_batches(
    dataset: StagedDataset, split: Split, path: Path, wanted: Sequence[str], batch_rows: int
) -> Iterator[pa.RecordBatch]:
    fmt = dataset.format
    if fmt == "parquet":
        parquet = _parquet_file(path)
        present = set(parquet.schema_arrow.names)
        yield from parquet.iter_batches(
            batch_size=batch_rows,
            row_groups=list(split.row_groups) if split.row_groups is not None else None,
            columns=[name for name in wanted if name in present],
        )
    elif fmt == "arrow":
        reader = _open_ipc(path)
        if isinstance(reader, pa_ipc.RecordBatchFileReader):
            for index in range(reader.num_record_batches):
                yield from _rechunk(reader.get_batch(index), batch_rows)
        else:
            for batch in reader:
                yield from _rechunk(batch, batch_rows)
    elif fmt == "csv":
        # Convert with the dataset's unified types so every file of a
        # directory yields the same columns, whatever its own first rows hold.
        yield from _read_csv(path, dataset.csv, dataset.file_schema).to_batches(batch_rows)
    else:
        yield from _read_json(path, dataset.file_schema).to_batches(batch_rows)


def _rechunk(batch: pa.RecordBatch, batch_rows: int) -> Iterator[pa.RecordBatch]:
    for offset in range(0, batch.num_rows, batch_rows):
        yield batch.slice(offset, batch_rows)


def cast_batch(
    batch: pa.RecordBatch,
    target: pa.Schema,
    constants: Mapping[str, pa.Scalar] | None = None,
) -> pa.RecordBatch:
    """``batch`` with exactly ``target``'s fields: names, order, types and nullability.

    Spark compares a data source's batches with its declared schema exactly,
    so every column is cast (sub-microsecond time is truncated, as Spark keeps
    microseconds; any other lossy cast fails). Columns of ``constants`` (Hive
    partition values) are repeated for every row; a column the batch lacks is
    null, which is an error for a non-nullable field, as is a null in one.
    """
    constants = constants or {}
    arrays: list[pa.Array] = []
    names = batch.schema.names
    for target_field in target:
        name = target_field.name
        if name in constants:
            column = pa.repeat(constants[name], batch.num_rows)
        elif name in names:
            column = batch.column(names.index(name))
        else:
            if not target_field.nullable:
                raise StagedDataError(
                    f"column {name!r} is declared non-nullable but the staged data has no "
                    "such column"
                )
            column = pa.nulls(batch.num_rows, target_field.type)
        column = _cast_column(column, target_field)
        arrays.append(column)
    return pa.RecordBatch.from_arrays(arrays, schema=target)


def _cast_column(column: pa.Array, target_field: pa.Field) -> pa.Array:
    name, target_type = target_field.name, target_field.type
    if isinstance(column.type, pa.BaseExtensionType):
        column = column.storage
    if column.type != target_type:
        try:
            if _has_list_view(column.type):
                # pyarrow's list_view -> list cast builds invalid offsets (seen
                # with 26.0); list views are rare, so go through Python objects.
                column = pa.array(column.to_pylist(), type=target_type)
            else:
                import pyarrow.compute as pc

                column = pc.cast(
                    column, options=pc.CastOptions(target_type, allow_time_truncate=True)
                )
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as exc:
            raise StagedDataError(
                f"column {name!r}: cannot convert {column.type} to {target_type}: {exc}"
            ) from exc
    if not target_field.nullable and column.null_count:
        raise StagedDataError(
            f"column {name!r} is declared non-nullable but holds {column.null_count} nulls"
        )
    return column
