"""What can be sent, as partitions: tables, ``pyarrow`` datasets, files and folders."""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.dataset as ds

from ...errors import TransferError

TARGET_PARTITION_BYTES = 64 * 1024 * 1024
_FORMATS = {
    ".parquet": "parquet",
    ".csv": "csv",
    ".json": "json",
    ".jsonl": "json",
    ".ndjson": "json",
    ".arrow": "ipc",
    ".feather": "ipc",
    ".ipc": "ipc",
}

Source = pa.Table | pa.RecordBatch | ds.Dataset | str | Path | Sequence[str | Path]


@dataclass
class Partitions:
    """A source's schema and, per partition, a maker of its batches (read when sent)."""

    schema: pa.Schema
    makers: list[Callable[[], Iterator[pa.RecordBatch]]]


def _data_files(path: Path) -> list[Path]:
    """The data files under a folder, skipping hidden and ``_``-prefixed names (``_SUCCESS``)."""
    return sorted(
        f
        for f in path.rglob("*")
        if f.is_file()
        and f.suffix.lower() in _FORMATS
        and not any(part.startswith((".", "_")) for part in f.relative_to(path).parts)
    )


def _format_of(path: Path) -> str:
    suffix = path.suffix.lower()
    if suffix not in _FORMATS:
        raise TransferError(
            f"cannot tell the format of {path.name}: name it .parquet, .csv, .json/.jsonl "
            "(JSON lines) or .arrow/.feather (Arrow IPC)"
        )
    return _FORMATS[suffix]


def as_dataset(source: Any) -> ds.Dataset:
    """A ``pyarrow.dataset`` over files and folders of one format (folders: Hive partitions)."""
    if isinstance(source, ds.Dataset):
        return source
    paths = [Path(source)] if isinstance(source, str | Path) else [Path(p) for p in source]
    if not paths:
        raise TransferError("nothing to send: no files given")
    files: list[Path] = []
    for p in paths:
        if not p.exists():
            raise TransferError(f"{p} does not exist")
        if p.is_dir():
            found = _data_files(p)
            if not found:
                raise TransferError(f"{p} holds no Parquet, CSV, JSON-lines or Arrow files to send")
            files += found
        else:
            files.append(p)
    formats = {_format_of(f) for f in files}
    if len(formats) > 1:
        raise TransferError(
            f"the files to send mix formats ({', '.join(sorted(formats))}): send one format "
            "at a time"
        )
    (fmt,) = formats
    folder = paths[0] if len(paths) == 1 and paths[0].is_dir() else None
    try:
        if folder is not None:
            return ds.dataset(
                [str(f) for f in files],
                format=fmt,
                partitioning="hive",
                partition_base_dir=str(folder),
            )
        return ds.dataset([str(f) for f in files], format=fmt)
    except (pa.ArrowException, OSError) as e:
        kind = {"parquet": "Parquet", "csv": "CSV", "json": "JSON lines", "ipc": "Arrow IPC"}
        raise TransferError(f"cannot read {files[0]} as {kind[fmt]}: {e}") from e


def total_rows(source: pa.Table | pa.RecordBatch | ds.Dataset) -> int | None:
    """The row count if the source knows it cheaply (tables; Parquet and Arrow metadata)."""
    if isinstance(source, pa.Table | pa.RecordBatch):
        return source.num_rows
    if isinstance(source, ds.FileSystemDataset) and source.format.default_extname in (
        "parquet",
        "arrow",
        "feather",
        "ipc",
    ):
        try:
            return source.count_rows()
        except (pa.ArrowException, OSError):
            return None
    return None


def total_bytes(source: pa.Table | pa.RecordBatch | ds.Dataset) -> int | None:
    """An estimate of the data's size: a table's ``nbytes``, the files' sizes; else None."""
    if isinstance(source, pa.Table | pa.RecordBatch):
        return source.nbytes
    if isinstance(source, ds.FileSystemDataset):
        try:
            return sum(os.path.getsize(f) for f in source.files)
        except OSError:
            return None
    return None


def partitions_of(source: Any, min_partitions: int) -> Partitions:
    """``source`` cut into partitions: a table in slices of about 64 MB (at least
    ``min_partitions``), a dataset one per file fragment."""
    if isinstance(source, pa.RecordBatch):
        source = pa.Table.from_batches([source])
    if isinstance(source, pa.Table):
        table = source
        count = max(min_partitions, math.ceil(table.nbytes / TARGET_PARTITION_BYTES), 1)
        step = max(1, math.ceil(table.num_rows / count)) if table.num_rows else 1
        slices = [table.slice(i, step) for i in range(0, max(table.num_rows, 1), step)]
        return Partitions(table.schema, [(lambda t=t: iter(t.to_batches())) for t in slices])
    dataset = as_dataset(source)
    fragments = list(dataset.get_fragments())
    if not fragments:
        return Partitions(dataset.schema, [lambda: iter(())])
    schema = dataset.schema
    return Partitions(
        schema,
        [(lambda f=f: iter(f.to_batches(schema=schema))) for f in fragments],
    )
