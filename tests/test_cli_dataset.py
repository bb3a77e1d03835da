"""The dataset CLI end to end: ``spark-dilation send PATH...`` and ``receive`` as processes.

Real mailbox server and relay (the session fixtures), real processes, real
Spark for the reader side. Content is compared exactly, never only counted.
Helpers come from ``test_cli`` (same conventions: bounded waits, one error
line on stderr, no tracebacks).
"""

from __future__ import annotations

import datetime as dt
import decimal
import json
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.feather as feather
import pyarrow.parquet as pq
import pytest
from test_cli import (
    Running,
    assert_failed,
    assert_ok,
    free_port,
    last_error_line,
    new_code,
    only_error_line,
    ours,
    ref,
    run,
)


@pytest.fixture
def procs() -> Iterator[Callable[[Sequence[str]], Running]]:
    """Background processes, killed at teardown if still running (as test_cli's)."""
    started: list[Running] = []

    def start(args: Sequence[str]) -> Running:
        started.append(Running(args))
        return started[-1]

    yield start
    for running in started:
        running.kill()


def mixed(rows: int, start: int = 0) -> pa.Table:
    ids = range(start, start + rows)
    return pa.table(
        {
            "id": pa.array(ids, pa.int64()),
            "x": pa.array([None if i % 7 == 0 else i / 3 for i in ids], pa.float64()),
            "s": pa.array([None if i % 11 == 0 else f"row-{i} ✓" for i in ids]),
            "dec": pa.array([decimal.Decimal(i) / 8 for i in ids], pa.decimal128(18, 3)),
            "day": pa.array([dt.date(2024, 1, 1) + dt.timedelta(days=i % 400) for i in ids]),
            "ts": pa.array(
                [dt.datetime(2024, 1, 1, tzinfo=dt.UTC) + dt.timedelta(seconds=i) for i in ids],
                pa.timestamp("us", tz="UTC"),
            ),
            "tags": pa.array([[i, i + 1] if i % 3 else None for i in ids], pa.list_(pa.int64())),
        }
    )


def flat(rows: int) -> pa.Table:
    return pa.table(
        {
            "id": pa.array(range(rows), pa.int64()),
            "name": pa.array([f"n{i}" for i in range(rows)]),
            "score": pa.array([i * 0.25 for i in range(rows)], pa.float64()),
        }
    )


def parquet_folder(root: Path, parts: int = 3, rows: int = 10_000) -> pa.Table:
    """A Spark-like output folder: part files plus _SUCCESS and a hidden .crc."""
    root.mkdir(parents=True)
    tables = [mixed(rows, start=i * rows) for i in range(parts)]
    for i, t in enumerate(tables):
        pq.write_table(t, root / f"part-{i:05d}.parquet")
    (root / "_SUCCESS").write_text("")
    (root / ".part-00000.parquet.crc").write_bytes(b"\0\1")
    return pa.concat_tables(tables)


def by_id(table: pa.Table) -> pa.Table:
    return table.sort_by("id")


def send_cmd(mailbox: str, relay: str, *args: str) -> list[str]:
    return ours(mailbox, "send", "--relay", relay, *args)


def receive_cmd(mailbox: str, relay: str, *args: str) -> list[str]:
    return ours(mailbox, "receive", "--relay", relay, *args)


def json_lines(stdout: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in stdout.splitlines() if line.strip()]


# --- a Parquet folder, CLI to CLI and CLI to Spark ------------------------------------------


def test_parquet_folder_arrives_identical_through_cli_and_spark(
    mailbox_url: str,
    relay_url: str,
    spark: Any,
    procs: Callable[..., Running],
    tmp_path: Path,
) -> None:
    want = parquet_folder(tmp_path / "src")

    # spark-dilation send -> spark-dilation receive
    sender = procs(send_cmd(mailbox_url, relay_url, str(tmp_path / "src")))
    code = sender.wait_for_code()
    received = run(receive_cmd(mailbox_url, relay_url, code, "-o", str(tmp_path / "out")))
    sent = sender.finish()
    assert_ok(sent)
    assert_ok(received)
    assert "Dataset sent: 30,000 rows" in sent.stderr, sent.describe()
    assert "Dataset received: 30,000 rows" in received.stderr, received.describe()
    assert "connected: direct" in sent.stderr, sent.describe()
    files = sorted((tmp_path / "out").iterdir())
    assert [f.name for f in files] == [f"part-{i:05d}.parquet" for i in range(3)]
    got = pa.concat_tables(pq.read_table(f) for f in files)
    assert got.schema.equals(want.schema)
    assert by_id(got).equals(by_id(want))

    # spark-dilation send -> spark.read.format("dilation")
    sender = procs(send_cmd(mailbox_url, relay_url, str(tmp_path / "src")))
    code = sender.wait_for_code()
    df = (
        spark.read.format("dilation")
        .option("code", code)
        .option("mailbox", mailbox_url)
        .option("relay", relay_url)
        .option("staging_dir", str(tmp_path / "staging"))
        .load()
    )
    rows = df.toArrow()
    assert_ok(sender.finish())
    assert rows.num_rows == want.num_rows
    assert by_id(rows).to_pylist() == by_id(want).to_pylist()


# --- JSON lines and Arrow IPC in; Arrow IPC and CSV out; --json -------------------------------


def test_json_lines_to_arrow_files_with_json_status(
    mailbox_url: str, relay_url: str, procs: Callable[..., Running], tmp_path: Path
) -> None:
    want = flat(5_000)
    src = tmp_path / "events.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in want.to_pylist()))
    sender = procs(send_cmd(mailbox_url, relay_url, "--json", str(src)))
    code = sender.wait_for_code()
    received = run(
        receive_cmd(
            mailbox_url, relay_url, code, "--json", "--format", "arrow",
            "-o", str(tmp_path / "out"),
        )
    )  # fmt: skip
    sent = sender.finish()
    assert_ok(sent)
    assert_ok(received)
    got = pa.concat_tables(feather.read_table(f) for f in sorted((tmp_path / "out").iterdir()))
    assert by_id(got).equals(by_id(want))

    # Scripts read one JSON object per line on stdout.
    sent_events = json_lines(sent.stdout)
    assert sent_events[0] == {"event": "code", "code": code}, sent.describe()
    assert sent_events[-1]["event"] == "done" and sent_events[-1]["rows"] == 5_000
    last = [e for e in sent_events if e["event"] == "progress"][-1]
    assert last["done"] and last["rows"] == 5_000 and last["side"] == "send"
    assert {"event": "connected", "path": "direct"}.items() <= next(
        e for e in sent_events if e["event"] == "connected"
    ).items()
    got_events = json_lines(received.stdout)
    done = got_events[-1]
    assert done["event"] == "done" and done["rows"] == 5_000, received.describe()
    assert len(done["files"]) == done["partitions"] == 1
    assert [e for e in got_events if e["event"] == "progress"][-1]["done"]


def test_arrow_files_to_csv(
    mailbox_url: str, relay_url: str, procs: Callable[..., Running], tmp_path: Path
) -> None:
    want = flat(4_000)
    (tmp_path / "src").mkdir()
    feather.write_feather(want.slice(0, 2_500), tmp_path / "src" / "a.arrow")
    feather.write_feather(want.slice(2_500), tmp_path / "src" / "b.arrow")
    sender = procs(send_cmd(mailbox_url, relay_url, "--quiet", str(tmp_path / "src")))
    code = sender.wait_for_code()
    received = run(
        receive_cmd(mailbox_url, relay_url, code, "--format", "csv", "-o", str(tmp_path / "out"))
    )
    sent = sender.finish()
    assert_ok(sent)
    assert_ok(received)
    assert "connected:" not in sent.stderr, sent.describe()  # --quiet
    got = pa.concat_tables(pacsv.read_csv(f) for f in sorted((tmp_path / "out").iterdir()))
    assert by_id(got).equals(by_id(want))


# --- classic files: `--classic`, and "y" on a non-interactive stdin ---------------------------


@pytest.mark.parametrize(("answer", "accepted"), [("y\n", True), ("n\n", False)])
def test_classic_file_accepted_or_declined_on_stdin(
    mailbox_url: str,
    relay_url: str,
    procs: Callable[..., Running],
    tmp_path: Path,
    answer: str,
    accepted: bool,
) -> None:
    src = tmp_path / "notes.txt"
    src.write_bytes(b"plain bytes, not a dataset\n" * 1000)
    sender = procs(send_cmd(mailbox_url, relay_url, "--classic", str(src)))
    code = sender.wait_for_code()
    received = run(
        receive_cmd(mailbox_url, relay_url, code, "-o", str(tmp_path / "got.txt")), stdin=answer
    )
    sent = sender.finish()
    assert "ok? (Y/n)" in received.stderr, received.describe()
    if accepted:
        assert_ok(received)
        assert_ok(sent)
        assert (tmp_path / "got.txt").read_bytes() == src.read_bytes()
        assert "Sending (direct" in sent.stderr, sent.describe()
    else:
        assert "you declined the transfer" in last_error_line(received), received.describe()
        assert "transfer rejected" in last_error_line(sent), sent.describe()
        assert not (tmp_path / "got.txt").exists()


# --- errors: one line on stderr, non-zero exit -----------------------------------------------


def test_send_bad_paths_and_formats(mailbox_url: str, tmp_path: Path) -> None:
    missing = run(ours(mailbox_url, "send", str(tmp_path / "nope.parquet")))
    assert "nope.parquet does not exist" in only_error_line(missing), missing.describe()

    (tmp_path / "notes.txt").write_text("hi")
    unknown = run(ours(mailbox_url, "send", str(tmp_path / "notes.txt")))
    line = only_error_line(unknown)
    assert "cannot tell the format of notes.txt" in line and "--classic" in line, line

    pq.write_table(flat(10), tmp_path / "a.parquet")
    pacsv.write_csv(flat(10), tmp_path / "b.csv")
    mixed_formats = run(
        ours(mailbox_url, "send", str(tmp_path / "a.parquet"), str(tmp_path / "b.csv"))
    )
    assert "mix formats (csv, parquet)" in only_error_line(mixed_formats)

    (tmp_path / "broken.parquet").write_bytes(b"not parquet at all")
    broken = run(ours(mailbox_url, "send", str(tmp_path / "broken.parquet")))
    assert "cannot read" in only_error_line(broken) and "as Parquet" in broken.stderr

    (tmp_path / "empty").mkdir()
    empty = run(ours(mailbox_url, "send", str(tmp_path / "empty")))
    assert "holds no Parquet, CSV, JSON-lines or Arrow files" in only_error_line(empty)


def test_usage_errors_are_one_line(mailbox_url: str, tmp_path: Path) -> None:
    pq.write_table(flat(10), tmp_path / "a.parquet")
    fmt = run(ours(mailbox_url, "receive", "5-guitarist-revenge", "--format", "xml"))
    assert "--format xml: choose parquet, arrow, csv" in only_error_line(fmt, returncode=2)
    comp = run(ours(mailbox_url, "send", "--compression", "gzip", str(tmp_path / "a.parquet")))
    assert "--compression gzip: choose auto, none, lz4, zstd, parquet" in only_error_line(
        comp, returncode=2
    )
    both = run(ours(mailbox_url, "send", "--text", "x", str(tmp_path / "a.parquet")))
    assert both.returncode == 2 and len(both.stderr.splitlines()) == 1, both.describe()
    classic = run(ours(mailbox_url, "send", "--classic", str(tmp_path), str(tmp_path)))
    assert both.returncode == 2 and "exactly one" in classic.stderr, classic.describe()


@pytest.mark.integration  # starts processes of its own
def test_dataset_send_to_an_unreachable_mailbox(tmp_path: Path) -> None:
    pq.write_table(flat(10), tmp_path / "a.parquet")
    result = run(ours(f"ws://127.0.0.1:{free_port()}/v1", "send", str(tmp_path / "a.parquet")))
    assert "could not connect" in only_error_line(result), result.describe()


def test_dataset_wrong_code_fails_both_sides(
    mailbox_url: str, relay_url: str, procs: Callable[..., Running], tmp_path: Path
) -> None:
    pq.write_table(flat(10), tmp_path / "a.parquet")
    code = new_code()
    sender = procs(send_cmd(mailbox_url, relay_url, "--code", code, str(tmp_path / "a.parquet")))
    assert sender.wait_for_code() == code
    nameplate = code.split("-", 1)[0]
    received = run(receive_cmd(mailbox_url, relay_url, f"{nameplate}-absurd-adroitness"))
    sent = sender.finish()
    assert "mistyped" in only_error_line(received), received.describe()
    assert "mistyped" in last_error_line(sent), sent.describe()
    assert not list(tmp_path.glob("dataset-*"))


def test_reference_wormhole_receive_is_told_how_to_take_a_dataset(
    mailbox_url: str, relay_url: str, procs: Callable[..., Running], tmp_path: Path
) -> None:
    """`wormhole receive` (0.24) given a dataset code prints how to take it and exits."""
    pq.write_table(flat(10), tmp_path / "a.parquet")
    sender = procs(send_cmd(mailbox_url, relay_url, str(tmp_path / "a.parquet")))
    code = sender.wait_for_code()
    started = time.monotonic()
    received = run(
        ref(mailbox_url, "--transit-helper", relay_url, "receive", "--hide-progress", code)
    )
    received_s = time.monotonic() - started
    sent = sender.finish()
    sent_s = time.monotonic() - started
    print(f"wormhole receive ended after {received_s:.1f} s, our sender after {sent_s:.1f} s")
    print(received.describe(), sent.describe(), sep="\n")
    assert_failed(received)
    assert (
        "TransferError: this code carries a spark-dilation dataset, which `wormhole receive` "
        "cannot take" in received.stderr
    ), received.describe()
    assert "`spark-dilation receive CODE`" in received.stderr, received.describe()
    line = last_error_line(sent)
    assert f"the receiver of the code {code} is a plain wormhole client" in line, sent.describe()
    assert "Send again with a new code" in line, sent.describe()
    # Both end as soon as the versions are exchanged (about a second); the
    # bound only tells an end from a hang (run() gives up after TIMEOUT).
    assert received_s < 30 and sent_s < 30, (received_s, sent_s)


def test_receiver_refuses_csv_for_nested_columns_and_a_full_folder(
    mailbox_url: str, relay_url: str, procs: Callable[..., Running], tmp_path: Path
) -> None:
    pq.write_table(mixed(100), tmp_path / "a.parquet")
    sender = procs(send_cmd(mailbox_url, relay_url, str(tmp_path / "a.parquet")))
    code = sender.wait_for_code()
    received = run(
        receive_cmd(mailbox_url, relay_url, code, "--format", "csv", "-o", str(tmp_path / "o"))
    )
    sent = sender.finish()
    assert "CSV cannot hold the nested column(s) tags" in only_error_line(received)
    assert "CSV cannot hold" in last_error_line(sent), sent.describe()
    assert not (tmp_path / "o").exists()

    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    sender = procs(send_cmd(mailbox_url, relay_url, str(tmp_path / "a.parquet")))
    code = sender.wait_for_code()
    received = run(receive_cmd(mailbox_url, relay_url, code, "-o", str(tmp_path / "full")))
    # Refused before the code is used (exit 2): the sender still waits for a receiver
    # (tests/test_receive_errors.py then receives with the same code).
    assert "it exists and is not empty" in only_error_line(received, 2), received.describe()
    assert sender.proc.poll() is None
    assert [p.name for p in (tmp_path / "full").iterdir()] == ["keep.txt"]


# --- what the progress output says, fed with snapshots -----------------------------------------


def test_progress_lines_and_json_events() -> None:
    import io

    from spark_dilation.cli_progress import Reporter
    from spark_dilation.transfer.rules.report import Progress

    def snapshots() -> list[Progress]:
        base = {"side": "send", "seconds": 1.0, "total_rows": 100, "connections": 2}
        return [
            Progress(rows=0, bytes=0, path="unknown", **base),
            Progress(rows=40, bytes=4000, path="direct", **base),
            # Down, being re-established: the count rises only once a path is back.
            Progress(rows=40, bytes=4000, path="unknown", reconnecting=True, **base),
            Progress(rows=40, bytes=4000, path="unknown", reconnecting=True, **base),
            Progress(rows=60, bytes=6000, path="direct", reconnects=1, **base),
            # Connections that end with the transfer are no reconnect.
            Progress(rows=100, bytes=9000, path="unknown", **base),
            Progress(rows=100, bytes=9000, path="direct+relay", reconnects=1, done=True, **base),
        ]

    out, err = io.StringIO(), io.StringIO()
    plain = Reporter("plain", out, err)
    for p in snapshots():
        plain.progress(p)
    assert err.getvalue().splitlines() == [
        "connected: direct (2 connection(s))",
        "connection lost: reconnecting..",
        "connection dropped and came back (direct): 1 reconnect(s) so far",
        "connected: direct+relay (2 connection(s))",
    ]
    assert out.getvalue() == ""

    out, err = io.StringIO(), io.StringIO()
    as_json = Reporter("json", out, err)
    for p in snapshots():
        as_json.progress(p)
    events = json_lines(out.getvalue())
    assert [e["event"] for e in events] == [
        "progress", "connected", "reconnect", "connected", "progress",
    ]  # fmt: skip
    assert events[0]["eta_seconds"] is None
    assert events[2] == {"event": "reconnect", "reconnects": 1, "path": "direct"}
    assert events[-1]["done"] and events[-1]["rows"] == 100 and events[-1]["eta_seconds"] == 0
    assert err.getvalue() == ""

    bar = Reporter("bar", out := io.StringIO(), err := io.StringIO())
    for p in snapshots():
        bar.progress(p)
    drawn = err.getvalue()
    assert "connection lost: reconnecting.." in drawn
    assert "reconnecting, 0 reconnect(s)" in drawn  # the bar while no path is up
    assert "connection dropped and came back (direct): 1 reconnect(s) so far" in drawn
    final = drawn.split("\r")[-1]
    assert "sending: 100%" in final and "100/100" in final, drawn
    assert "direct+relay, 1 reconnect(s)" in final, drawn

    quiet = Reporter("quiet", out := io.StringIO(), err := io.StringIO())
    for p in snapshots():
        quiet.progress(p)
    assert out.getvalue() == err.getvalue() == ""
    # ETA from the average rate so far: 40 of 100 rows in 1 s -> 1.5 s left.
    assert snapshots()[1].eta_seconds == 1.5
