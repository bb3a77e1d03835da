"""The received dataset as files: checks on the destination and format, and the writing."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from ..machine import existing, os_cause
from ..receive.staging import LaneStaging, read_staged
from ..rules.errors import OutputError
from ..rules.options import RECEIVE_FORMATS
from ..rules.protocol import CommittedPartition
from ..rules.spec import TransferSpec


def format_refusal(schema: pa.Schema, format: str) -> str | None:
    """Why files of ``format`` cannot hold ``schema`` (``None`` if they can)."""
    if format not in RECEIVE_FORMATS:
        return f"format={format!r}: choose {', '.join(RECEIVE_FORMATS)}"
    if format == "csv":
        nested = [
            f"{f.name} ({f.type})"
            for f in schema
            if pa.types.is_nested(f.type) or pa.types.is_dictionary(f.type)
        ]
        if nested:
            return (
                f"CSV cannot hold the nested column(s) {', '.join(nested)}: receive as parquet "
                "or arrow instead"
            )
    return None


def dest_problem(dest: Path, *, must_be_empty: bool = False) -> str | None:
    """Why the dataset cannot be written into ``dest``, or None; checks before a code is used.

    ``dest`` may be absent (made at the end) or a folder (empty, if
    ``must_be_empty``); its parent must be writable for the hidden temporary
    folder the files are written into first.
    """
    if dest.exists() and not dest.is_dir():
        return f"cannot write the dataset into {dest}: it exists and is not a folder"
    if must_be_empty and dest.is_dir() and any(dest.iterdir()):
        return f"cannot write the dataset into {dest}: it exists and is not empty"
    folders = [existing(dest.parent)] + ([dest] if dest.is_dir() else [])
    for folder in folders:
        try:
            os.rmdir(tempfile.mkdtemp(prefix=".spark-dilation-check-", dir=folder))
        except OSError as e:
            return f"cannot write the dataset into {dest}: {folder} is not writable ({os_cause(e)})"
    return None


def _write_part(target: Path, src: Path, schema: pa.Schema, format: str) -> None:
    if format == "arrow":  # the IPC file format (what .arrow/Feather v2 readers take)
        with pa.ipc.new_file(target, schema) as writer:
            for b in read_staged(src):
                writer.write_batch(b)
    elif format == "csv":
        with pacsv.CSVWriter(target, schema) as writer:
            for b in read_staged(src):
                writer.write_batch(b)
    else:
        with pq.ParquetWriter(target, schema) as writer:
            for b in read_staged(src):
                writer.write_batch(b)


def write_files(
    spec: TransferSpec,
    partitions: list[CommittedPartition],
    staging: dict[int, LaneStaging],
    out: Path,
    format: str,
    replace: bool = False,
) -> list[Path]:
    """Write the files into a hidden folder next to ``out``, then move them into ``out``.

    ``out`` appears only complete: renamed from the hidden folder if absent,
    or given the files if it is a folder; with ``replace`` an existing
    ``out`` is swapped for the new folder only then (and removed). On any
    failure the hidden folder goes and the error names the file and the cause.
    """
    partial = out.parent / f".{out.name}.spark-dilation-{spec.transfer_id[:12]}.partial"

    def failed(what: str, e: BaseException) -> OutputError:
        return OutputError(f"the receiver could not write {what} into {out}: {os_cause(e)}")

    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        partial.mkdir()
    except OSError as e:
        raise failed(f"its temporary folder {partial.name}", e) from e
    try:
        names: list[str] = []
        for c in partitions:
            name = f"part-{c.partition:05d}.{format}"
            try:
                _write_part(partial / name, staging[c.lane].complete_path(c.partition),
                            spec.schema, format)  # fmt: skip
            except (OSError, pa.ArrowException) as e:
                raise failed(name, e) from e
            names.append(name)
        try:
            if replace and out.exists():
                old = out.parent / f".{out.name}.spark-dilation-{spec.transfer_id[:12]}.old"
                os.rename(out, old)
                os.rename(partial, out)
                if old.is_dir():
                    shutil.rmtree(old, ignore_errors=True)
                else:
                    old.unlink(missing_ok=True)
            elif out.is_dir():  # an existing folder (empty, for the CLI): the files go in
                for name in names:
                    os.replace(partial / name, out / name)
                partial.rmdir()
            else:
                os.rename(partial, out)
        except OSError as e:
            raise OutputError(
                f"the receiver could not move its files into {out}: {os_cause(e)}"
            ) from e
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return [out / name for name in names]
