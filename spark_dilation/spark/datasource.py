"""``spark.read.format("dilation")``: the PySpark Python data source.

What runs where (PySpark 4.3; no method runs in the user's own Python process):

- ``DilationDataSource.schema()`` runs once per ``load()``, in a short-lived
  planner worker on the driver machine. It receives the file into a fresh
  staging directory, inspects it and returns the Spark schema. Spark then
  pickles the instance, *with* the staged dataset it remembered, for every
  later step, so the code is used exactly once however many actions follow.
- ``reader()`` and ``StagedFileReader.partitions()`` run in another planner
  worker, once per action. ``partitions()`` splits the staged data into tasks.
- ``StagedFileReader.read()`` runs in task workers (executors), one split
  each, and yields Arrow record batches cast exactly to the declared schema.

Tasks read the staged files by path: fine in local mode and on one machine;
on a real cluster set option ``staging_dir`` to storage every executor sees.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import logging
import os
import shutil
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa
from pyspark.errors import PySparkException
from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition
from pyspark.sql.pandas.types import from_arrow_type, to_arrow_schema
from pyspark.sql.types import ArrayType, DataType, MapType, StructField, StructType

from ..errors import DilationError
from ..transfer.rules.ledger import LEDGER_NAME
from ..transfer.rules.options import TransferOptions
from ..transfer.rules.pairing import PairingError, PairingRecord
from .options import (
    FILE_ONLY_OPTIONS,
    MAILBOX_ENV,
    RELAY_ENV,
    STREAM_READ_OPTIONS,
    OptionError,
    ReadSettings,
)
from .receive import new_staging_dir, receive_file
from .staged import (
    StagedDataError,
    StagedDataset,
    UnsupportedFormatError,
    inspect_staged,
    plan_splits,
    read_split,
    spark_compatible_schema,
)

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

__all__ = [
    "DilationDataSource",
    "NotSupportedYetError",
    "StagedFileReader",
    "read_wormhole_file",
    "to_spark_schema",
]

log = logging.getLogger("spark_dilation.spark")

# Options of df.write.format("dilation"): the transfer's, minus the reader's own.
WRITE_OPTIONS: tuple[str, ...] = (
    "code",
    "path",
    *(n for n in TransferOptions.names() if n not in ("lanes", "staging_dir", "early_lanes")),
)


class NotSupportedYetError(DilationError, NotImplementedError):
    """A feature of the data source that is planned but not implemented."""


# Spark stores its own schema, as JSON, in the metadata of every Parquet file it writes.
_SPARK_PARQUET_SCHEMA_KEY = b"org.apache.spark.sql.parquet.row.metadata"


def _spark_written_types(schema: pa.Schema) -> dict[str, DataType]:
    """Spark's own column types, if Spark wrote these files; else empty.

    They tell what the Parquet types alone cannot: an INT96 or zone-less
    timestamp written by Spark is a TimestampType instant, not a
    TimestampNTZType wall-clock time.
    """
    raw = (schema.metadata or {}).get(_SPARK_PARQUET_SCHEMA_KEY)
    if not raw:
        return {}
    try:
        written = StructType.fromJson(json.loads(raw))
    except (ValueError, KeyError, TypeError):
        return {}  # not ours to fail on: fall back to the Arrow types
    return {f.name: f.dataType for f in written.fields}


def _erase_ntz(data_type: DataType) -> str:
    return data_type.json().replace('"timestamp_ntz"', '"timestamp"')


def _keep_nullability(spark_type: DataType, arrow_type: pa.DataType) -> DataType:
    """``spark_type`` with the nullability of list elements and map values in ``arrow_type``.

    PySpark 4.0's ``from_arrow_type`` makes every element and value nullable;
    4.1+ keeps the Arrow field's flag, which this does on 4.0 too.
    """
    if isinstance(spark_type, ArrayType):
        value = arrow_type.value_field
        element = _keep_nullability(spark_type.elementType, value.type)
        return ArrayType(element, containsNull=value.nullable)
    if isinstance(spark_type, MapType):
        item = arrow_type.item_field
        value_type = _keep_nullability(spark_type.valueType, item.type)
        return MapType(
            _keep_nullability(spark_type.keyType, arrow_type.key_type),
            value_type,
            valueContainsNull=item.nullable,
        )
    if isinstance(spark_type, StructType):
        return StructType(
            [
                StructField(f.name, _keep_nullability(f.dataType, a.type), f.nullable, f.metadata)
                for f, a in zip(spark_type.fields, arrow_type, strict=True)
            ]
        )
    return spark_type


def to_spark_schema(schema: pa.Schema) -> StructType:
    """The Spark schema for data with this Arrow schema (see ``spark_compatible_type``).

    Timestamps in Parquet files written by Spark keep the flavour Spark recorded
    (instant or wall-clock time), which the Parquet types alone do not tell.
    Field metadata is dropped on purpose: Spark's converter parses it as JSON,
    and files written by other tools carry arbitrary bytes there.
    """
    spark_written = _spark_written_types(schema)
    fields = []
    for original, compatible in zip(schema, spark_compatible_schema(schema), strict=True):
        try:
            spark_type = _keep_nullability(
                from_arrow_type(compatible.type, prefer_timestamp_ntz=True), compatible.type
            )
        except (PySparkException, TypeError) as exc:
            raise UnsupportedFormatError(
                f"column {original.name!r} has Arrow type {original.type}, which Spark "
                "cannot hold; convert it before sending"
            ) from exc
        written = spark_written.get(original.name)
        # Take Spark's word only on the timestamp flavour; if anything else
        # differs (files merged with other types, say) the Arrow types decide.
        if written is not None and _erase_ntz(written) == _erase_ntz(spark_type):
            spark_type = written
        fields.append(StructField(original.name, spark_type, nullable=compatible.nullable))
    return StructType(fields)


def spark_arrow_schema(schema: StructType) -> pa.Schema:
    """The Arrow schema Spark checks a Python data source's batches against.

    Instants (``TimestampType``) are UTC timestamps on every PySpark 4, but
    PySpark 4.0 says so with ``timestamp_utc=True`` (its default) and 4.1+
    with ``timezone="UTC"`` (its default is zone-less).
    """
    if "timezone" in _TO_ARROW_PARAMETERS:
        return to_arrow_schema(schema, timezone="UTC")
    return to_arrow_schema(schema)


_TO_ARROW_PARAMETERS = inspect.signature(to_arrow_schema).parameters


class DilationDataSource(DataSource):
    """Read a file sent with the standard ``wormhole send`` straight into a DataFrame.

    ::

        spark.read.format("dilation").option("code", CODE).option("accept", "file").load()

    Parquet, CSV, JSON Lines and Arrow IPC files are read, and directories of
    them (for example a Spark output directory sent with ``wormhole send dir/``).
    Spark finds this class by itself through the top-level ``pyspark_dilation``
    module; no ``spark.dataSource.register`` call is needed.
    """

    def __init__(self, options: Mapping[str, str]) -> None:
        super().__init__(options)  # type: ignore[arg-type]
        # Set by schema() in the planner worker and pickled along with the
        # instance to every later step: the received file's location and
        # shape, or the agreed dataset transfer.
        self._staged: StagedDataset | None = None
        self._spec: Any = None
        self._stream: pa.Schema | None = None  # the code carries a stream (spark/stream.py)

    @classmethod
    def name(cls) -> str:
        return "dilation"

    def schema(self) -> StructType:
        """Open the code once: a dataset transfer, or a file received now. Planner worker."""
        settings = ReadSettings.from_options(self.options)
        if settings.staged_path is not None or settings.accept == "file":
            self._staged = _stage(settings)
            return to_spark_schema(self._staged.arrow_schema)
        from ..transfer.receive import ReceivedFileResult, load_record, receive_session
        from .stream import RECORD_NAME, pairing_dir, stream_schema, warn_driver_state

        # A stream paired before (a restarted receiving query): its record has the
        # schema, and the spent code is not opened again.
        stream_dir = pairing_dir(self.options, "receiver")
        record = load_record(stream_dir / RECORD_NAME)
        if record is not None:
            if not (record.revoked and (stream_dir / LEDGER_NAME).exists()):
                record.next_run()  # a revoked pairing says so here, before Spark plans anything
            # else the receiving query reads what was staged before the revoke, then ends
            warn_driver_state(self.options)
            self._stream = stream_schema(record, stream_dir)
            return to_spark_schema(self._stream)
        if (stream_dir / LEDGER_NAME).exists():
            raise PairingError(
                f"this stream's receiving stage is at {stream_dir} but its pairing record "
                f"({stream_dir / RECORD_NAME}) is gone: it was lost or moved. Restore it, or "
                "start a new stream (a new code and state_dir on both sides)"
            )
        assert settings.code is not None
        options = _transfer_options(self.options, settings)
        dest = new_staging_dir(settings.staging_root)
        try:
            stream_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
            result = receive_session(
                settings.code,
                options,
                file_dest=dest,
                accept_file=settings.accept != "dataset",
                stream_record=stream_dir / RECORD_NAME,
            )
        except BaseException:
            shutil.rmtree(dest, ignore_errors=True)
            with contextlib.suppress(OSError):
                stream_dir.rmdir()  # made for a stream that did not come
            raise
        if isinstance(result, PairingRecord):
            shutil.rmtree(dest, ignore_errors=True)
            log.info("paired as the receiver of stream %s", result.stream)
            warn_driver_state(self.options)
            self._stream = stream_schema(result, stream_dir)
            return to_spark_schema(self._stream)
        with contextlib.suppress(OSError):
            stream_dir.rmdir()
        if isinstance(result, ReceivedFileResult):
            self._staged = _inspect_received(settings, result.received)
            return to_spark_schema(self._staged.arrow_schema)
        shutil.rmtree(dest, ignore_errors=True)
        from ..transfer.receive import start_registry_host

        # Any executor may run any lane in a later action: the registry,
        # alive as long as this application, tells each lane host where its
        # lane is staged (docs/transfer.md, "Where rows live after load()").
        result = start_registry_host(result)
        self._spec = result
        log.info("dataset transfer %s agreed: %d lanes", result.transfer_id, result.lanes)
        if _early_lanes(options.early_lanes):
            # The sender can stream while Spark plans the first action and
            # starts its tasks (seconds on a cold application); the read tasks
            # then follow the staged files.
            from ..transfer.receive import start_lanes

            start_lanes(result)
        return to_spark_schema(result.schema)

    def reader(self, schema: StructType) -> DataSourceReader:
        """A reader for ``schema``: the lanes of a dataset, or the staged file. Per action."""
        if self._stream is not None:
            raise OptionError(
                "this code carries a stream: read it with "
                'spark.readStream.format("dilation").option("code", CODE).load()'
            )
        if self._spec is not None:
            from .dataset import DatasetReader

            return DatasetReader(self._spec, spark_arrow_schema(schema))
        settings = ReadSettings.from_options(self.options)
        staged = self._staged
        if staged is None:
            # schema() was skipped because the user declared one with .schema(...).
            if settings.staged_path is None:
                # Receiving here would happen again for every action (reader()
                # runs per action from the instance pickled before it), and a
                # code works only once.
                raise OptionError(
                    "a declared schema (.schema(...)) cannot be combined with option code: "
                    "the data is received while Spark infers its schema. Drop .schema(...) "
                    "and cast the columns afterwards, or receive_file() first and read it "
                    "with option staged_path"
                )
            staged = _inspect(settings, Path(settings.staged_path))
        return StagedFileReader(staged, spark_arrow_schema(schema))

    def streamReader(self, schema: StructType) -> Any:
        """``readStream``: the stream's source (spark/stream.py). Planner and streaming worker."""
        if self._stream is None:
            raise OptionError(
                "this code carries a dataset or a file, not a stream: read it with "
                'spark.read.format("dilation"), or give readStream the code of a '
                'writeStream.format("dilation")'
            )
        from .stream import stream_reader

        return stream_reader(self.options, spark_arrow_schema(schema))

    def streamWriter(self, schema: StructType, overwrite: bool) -> Any:
        """``writeStream``: the stream's sink (spark/stream.py). Driver workers, per batch.

        ``overwrite`` is Spark's way of saying ``outputMode("complete")``: each micro-batch
        the whole result again. A stream carries appended rows only, so it is refused
        (``update`` Spark refuses by itself)."""
        if overwrite:
            raise OptionError(
                'writeStream.format("dilation") sends appended rows only: outputMode("complete") '
                "would send the whole result again each micro-batch, appended to the last. Use "
                'outputMode("append"), or foreachBatch to send each result as a dataset'
            )
        from .stream import stream_writer

        writer = stream_writer(self.options, spark_arrow_schema(schema))
        writer.prestart()
        return writer

    def writer(self, schema: StructType, overwrite: bool) -> Any:
        """Agree on a transfer over the code (waits for the reader); the task-side sender.

        ``append`` and ``overwrite`` both mean "send"; runs in a planner worker.
        """
        from .dataset import DilationArrowWriter

        opts = {k.lower(): v for k, v in self.options.items()}
        code = (opts.get("code") or "").strip()
        if not code:
            raise OptionError(
                'option "code" is required to send: df.write.format("dilation")'
                '.option("code", "7-guitarist-revenge").mode("append").save(); make one up '
                "(a number, a hyphen, words) and tell the reader"
            )
        unknown = sorted(set(opts) - set(WRITE_OPTIONS))
        if unknown:
            raise OptionError(
                f'unknown option {", ".join(unknown)} for df.write.format("dilation"); '
                f"known options are {', '.join(WRITE_OPTIONS)}"
            )
        options = TransferOptions.from_strings(opts, ignore=("code", "path"))
        arrow_schema = spark_arrow_schema(schema)
        from ..transfer import send

        spec = send.agree(arrow_schema, options, code)
        log.info("dataset transfer %s agreed: %d lanes", spec.transfer_id, spec.lanes)
        return DilationArrowWriter(spec, time.time())


class StagedFileReader(DataSourceReader):
    """Reads a staged dataset. Built in a planner worker; pickled to task workers."""

    def __init__(self, staged: StagedDataset, target: pa.Schema) -> None:
        self.staged = staged
        # Exactly what Spark checks the batches against (spark_arrow_schema).
        self.target = target

    def partitions(self) -> list[InputPartition]:
        """One partition per file; for Parquet, per group of row groups. Planner worker."""
        # Spark pickles this reader for the tasks before it calls partitions(),
        # so everything read() needs travels in the partition, not in self.
        return [InputPartition(split) for split in plan_splits(self.staged)]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        """Record batches of one partition, cast to the declared schema. Task worker."""
        split = partition.value
        if split is None:
            # Spark substitutes one empty InputPartition(None) when a dataset
            # has no splits at all (an empty Parquet file, say).
            return
        yield from read_split(self.staged, split, self.target)


def _early_lanes(setting: str) -> bool:
    if setting == "auto":
        from .locality import tasks_run_here

        return tasks_run_here()
    return setting == "true"


def _transfer_options(options: Mapping[str, str], settings: ReadSettings) -> Any:
    opts = {k.lower(): v for k, v in options.items()}
    transfer = TransferOptions.from_strings(opts, ignore=FILE_ONLY_OPTIONS + STREAM_READ_OPTIONS)
    if settings.timeout is not None and "peer_timeout" not in opts:
        transfer = transfer.with_(peer_timeout=settings.timeout)
    return transfer


def _inspect_received(settings: ReadSettings, received: Any) -> StagedDataset:
    # The code is used up, so say where the file is and how to read it anyway.
    try:
        return _inspect(settings, Path(received.path))
    except (UnsupportedFormatError, StagedDataError) as exc:
        raise type(exc)(
            f"{exc}. The received {received.kind} is kept at {received.path}: read it with "
            f'.option("staged_path", "{received.path}") and .option("format", ...)'
        ) from exc


def _inspect(settings: ReadSettings, path: Path) -> StagedDataset:
    return inspect_staged(path, format=settings.format, csv=settings.csv)


def _stage(settings: ReadSettings) -> StagedDataset:
    """The dataset to read: received now into a fresh staging directory, or staged earlier."""
    if settings.staged_path is not None:
        return _inspect(settings, Path(settings.staged_path))
    assert settings.code is not None  # ReadSettings guarantees code or staged_path
    # receive_file() creates the fresh staging directory itself, so that it
    # can remove it again if the transfer fails.
    received = receive_file(
        settings.code,
        staging_dir=settings.staging_root,
        mailbox=settings.mailbox_url,
        relay=settings.relay,
        timeout=settings.timeout,
        timeout_option='option("timeout", ...)',  # the timeout error names the Spark option
    )
    log.info(
        "received %s %s (%d bytes, sha256 %s)",
        received.kind,
        received.path,
        received.size,
        received.sha256,
    )
    return _inspect_received(settings, received)


def _option_text(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def read_wormhole_file(spark: SparkSession, code: str, **options: object) -> DataFrame:
    """``spark.read.format("dilation")`` for a file sent with ``wormhole send``; runs on the driver.

    The interactive shortcut: ``read_wormhole_file(spark, "7-guitarist-revenge")``
    loads the file into a DataFrame. ``options`` are the data source's options
    (``format="csv"``, ``header=False``, ``timeout=60``, ...); ``None`` values are
    skipped. ``$SPARK_DILATION_MAILBOX`` and ``$SPARK_DILATION_RELAY`` are read
    here, in the caller's process, because the transfer itself runs in a Spark
    worker that may not share the notebook's environment.
    """
    opts: dict[str, str] = {"accept": "file"}
    for key, env in (("mailbox", MAILBOX_ENV), ("relay", RELAY_ENV)):
        if os.environ.get(env):
            opts[key] = os.environ[env]
    opts.update({key: _option_text(v) for key, v in options.items() if v is not None})
    return spark.read.format("dilation").option("code", code).options(**opts).load()
