"""A sender succeeds only when the receiver has the data where it asked (issue 18).

Real servers, real ``spark-dilation`` processes, real full disks: small
tmpfs mounts (root only; unmounted at teardown). Each side gets its own
``TMPDIR``, which holds the receiver's staging root (``<tempdir>/spark-dilation``),
so the tests see what either side leaves behind. Each test logs how long
each side took to end and bounds it generously (the failures are seconds).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_cli import ERROR_PREFIX, Result, Running, ours
from test_cli_dataset import mixed

from spark_dilation.transfer import TransferOptions, receive_dataset, send_in_background
from spark_dilation.transfer.rules.errors import ReceiverFailedError, StagingError
from spark_dilation.transfer.rules.protocol import Offer

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="mounts tmpfs (needs root)"),
    pytest.mark.liveness,  # END_BOUND
]

END_BOUND = 30.0  # seconds each side may take to end after a failure (they take a few)
NO_SPACE = "No space left on device"


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Callable[..., Path]]:
    """``mount(name, size="2m", ro=False)``: a fresh tmpfs under tmp_path."""
    mounted: list[Path] = []

    def mount(name: str, size: str = "2m", ro: bool = False) -> Path:
        where = tmp_path / name
        where.mkdir()
        flags = f"{'ro,' if ro else ''}size={size}"
        subprocess.run(["mount", "-t", "tmpfs", "-o", flags, "tmpfs", str(where)], check=True)
        mounted.append(where)
        return where

    yield mount
    for where in reversed(mounted):
        # lazy: a Spark reader's lane hosts keep their logs open until the application ends
        subprocess.run(["umount", "-l", str(where)], check=False)


@pytest.fixture
def side(
    monkeypatch: pytest.MonkeyPatch, mailbox_url: str, relay_url: str
) -> Iterator[Callable[..., Running]]:
    """``side(tmpdir, "send"|"receive", *args)``: a CLI process with its own TMPDIR."""
    started: list[Running] = []

    def start(tmpdir: Path, command: str, *args: str) -> Running:
        tmpdir.mkdir(parents=True, exist_ok=True)
        monkeypatch.setenv("TMPDIR", str(tmpdir))  # Popen copies the environment now
        started.append(Running(ours(mailbox_url, command, "--relay", relay_url, *args)))
        started[-1].started = time.monotonic()  # type: ignore[attr-defined]
        return started[-1]

    yield start
    for running in started:
        running.kill()


def both_end(*running: Running) -> list[tuple[Result, float]]:
    """Wait for every process to exit; each one's result and seconds since it started."""
    ended: dict[int, float] = {}
    deadline = time.monotonic() + 90
    while len(ended) < len(running) and time.monotonic() < deadline:
        for i, r in enumerate(running):
            if i not in ended and r.proc.poll() is not None:
                ended[i] = time.monotonic() - r.started  # type: ignore[attr-defined]
        time.sleep(0.05)
    return [(r.finish(), ended.get(i, float("inf"))) for i, r in enumerate(running)]


def error_lines(result: Result) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.startswith(ERROR_PREFIX)]


def one_error(result: Result, returncode: int = 1) -> str:
    """Exactly one error line, the last (progress lines may come first); no traceback."""
    assert result.returncode == returncode, result.describe()
    lines = result.stderr.strip().splitlines()
    errors = error_lines(result)
    assert len(errors) == 1 and lines[-1] == errors[0], result.describe()
    assert not any(x in result.stderr for x in ("Traceback", "WARNING")), result.describe()
    return errors[0]


def staged_transfers(tmpdir: Path) -> list[Path]:
    """Whatever a side left under its temporary folder (the staging root itself may stay)."""
    return [p for p in tmpdir.rglob("*") if p != tmpdir / "spark-dilation"]


def compressible(folder: Path, files: int = 2, rows: int = 200_000) -> int:
    """Parquet files of a few KB whose rows take MBs as Arrow (staged) or Arrow files."""
    folder.mkdir(parents=True)
    for i in range(files):
        t = pa.table({"a": pa.array([i] * rows, pa.int64()), "b": pa.array([7] * rows, pa.int64())})
        pq.write_table(t, folder / f"part-{i}.parquet")
    return sum(f.stat().st_size for f in folder.iterdir())


# --- the CLI ------------------------------------------------------------------------------------


def test_full_output_disk_fails_the_sender_with_the_cause(
    side: Callable[..., Running], tmpfs: Callable[..., Path], tmp_path: Path
) -> None:
    offered = compressible(tmp_path / "src")  # KBs offered, 6.4 MB of Arrow files written
    disk = tmpfs("disk")
    sender = side(tmp_path / "tmp-send", "send", str(tmp_path / "src"))
    code = sender.wait_for_code()
    receiver = side(tmp_path / "tmp-recv", "receive", code, "--format", "arrow", "-o",
                    str(disk / "out"))  # fmt: skip
    (sent, sent_s), (received, received_s) = both_end(sender, receiver)
    print(
        f"offered {offered} bytes; sender ended after {sent_s:.1f} s, receiver {received_s:.1f} s"
    )

    assert sent.returncode == 1, sent.describe()
    assert "Dataset sent" not in sent.stderr, sent.describe()
    (line,) = error_lines(sent)
    assert "the receiver could not write part-0000" in line and NO_SPACE in line, sent.describe()
    assert str(disk / "out") in line, sent.describe()
    line = one_error(received)
    assert "could not write part-0000" in line and NO_SPACE in line, received.describe()
    assert list(disk.iterdir()) == [], "no -o and no hidden partial folder may stay"
    assert staged_transfers(tmp_path / "tmp-recv") == []
    assert staged_transfers(tmp_path / "tmp-send") == []
    assert max(sent_s, received_s) < END_BOUND


def test_full_staging_disk_names_the_cause_on_both_sides(
    side: Callable[..., Running], tmpfs: Callable[..., Path], tmp_path: Path
) -> None:
    compressible(tmp_path / "src")  # staged as 6.4 MB of Arrow IPC
    staging_tmp = tmpfs("staging-tmp")
    sender = side(tmp_path / "tmp-send", "send", str(tmp_path / "src"))
    code = sender.wait_for_code()
    receiver = side(staging_tmp, "receive", code, "-o", str(tmp_path / "out"))
    (sent, sent_s), (received, received_s) = both_end(sender, receiver)
    print(f"sender ended after {sent_s:.1f} s, receiver {received_s:.1f} s")

    assert sent.returncode == 1, sent.describe()
    (line,) = error_lines(sent)
    assert "the receiver failed: lane " in line and "could not stage partition" in line, line
    assert f"[Errno 28] {NO_SPACE}" in line, sent.describe()
    line = one_error(received)
    assert "could not stage partition" in line and NO_SPACE in line, received.describe()
    assert "aborted" not in line, received.describe()
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    assert staged_transfers(staging_tmp) == []
    assert staged_transfers(tmp_path / "tmp-send") == []
    assert max(sent_s, received_s) < END_BOUND


def test_unusable_output_is_refused_before_the_code_is_used(
    side: Callable[..., Running], tmpfs: Callable[..., Path], tmp_path: Path
) -> None:
    want = mixed(20_000)
    (tmp_path / "src").mkdir()
    pq.write_table(want, tmp_path / "src" / "a.parquet")
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("mine")
    readonly = tmpfs("ro", size="1m", ro=True)
    sender = side(tmp_path / "tmp-send", "send", str(tmp_path / "src"))
    code = sender.wait_for_code()

    for out, why in ((full, "it exists and is not empty"), (readonly / "out", "is not writable")):
        refused = side(tmp_path / "tmp-recv", "receive", code, "-o", str(out))
        ((result, seconds),) = both_end(refused)
        print(f"receiver into {out} refused after {seconds:.1f} s")
        line = one_error(result, returncode=2)
        assert len(result.stderr.splitlines()) == 1, result.describe()
        assert why in line and "the code was not used" in line, result.describe()
        if out == full:  # the options that would take it
            assert "--overwrite" in line and "--accept-file" in line, line
        assert sender.proc.poll() is None, "the sender must still be waiting"
    assert [p.name for p in full.iterdir()] == ["keep.txt"]

    # The code was never claimed: a receiver with a good -o (an empty folder) uses it.
    out = tmp_path / "out"
    out.mkdir()
    receiver = side(tmp_path / "tmp-recv", "receive", code, "-o", str(out))
    (sent, sent_s), (received, received_s) = both_end(sender, receiver)
    print(f"sender ended after {sent_s:.1f} s, receiver {received_s:.1f} s")
    assert sent.returncode == 0, sent.describe()
    assert received.returncode == 0, received.describe()
    assert "Dataset sent" in sent.stderr
    # Exactly -o with the files; no hidden folder, no staging on either side.
    assert sorted(p.name for p in out.iterdir()) == ["part-00000.parquet"]
    assert pq.read_table(out / "part-00000.parquet").equals(want)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []
    assert staged_transfers(tmp_path / "tmp-recv") == []
    assert staged_transfers(tmp_path / "tmp-send") == []


def test_offer_too_big_for_the_free_space_is_refused(
    side: Callable[..., Running], tmpfs: Callable[..., Path], tmp_path: Path
) -> None:
    (tmp_path / "src").mkdir()
    noise = pa.table({"r": pa.array(list(os.urandom(3_000_000)), pa.uint8())})
    pq.write_table(noise, tmp_path / "src" / "noise.parquet", compression="none")
    disk = tmpfs("disk")
    sender = side(tmp_path / "tmp-send", "send", str(tmp_path / "src"))
    code = sender.wait_for_code()
    receiver = side(tmp_path / "tmp-recv", "receive", code, "-o", str(disk / "out"))
    (sent, sent_s), (received, received_s) = both_end(sender, receiver)
    print(f"sender ended after {sent_s:.1f} s, receiver {received_s:.1f} s")

    line = one_error(received)
    assert "has not enough free space for the dataset" in line and str(disk) in line, line
    assert sent.returncode == 1, sent.describe()
    (sent_line,) = error_lines(sent)
    assert "has not enough free space for the dataset" in sent_line, sent.describe()
    assert list(disk.iterdir()) == []
    assert staged_transfers(tmp_path / "tmp-recv") == []
    assert max(sent_s, received_s) < END_BOUND


# --- the Python API ------------------------------------------------------------------------------


def test_api_refuses_a_big_offer_and_names_a_full_staging_disk(
    mailbox_url: str, relay_url: str, tmpfs: Callable[..., Path], tmp_path: Path
) -> None:
    opts: dict[str, Any] = {"mailbox": mailbox_url, "relay": relay_url}
    table = pa.table({"a": pa.array([1] * 400_000, pa.int64())})  # 3.2 MB offered

    # The staging folder is too small for the offer: refused before anything moves.
    small = tmpfs("small")
    sender, thread, box = send_in_background(table, **opts)
    with pytest.raises(Exception, match="not enough free space") as refused:
        receive_dataset(sender.code, staging_dir=str(small), **opts)
    thread.join(60)
    assert "not enough free space" in str(box["error"]), refused.value

    # Room for the offer, not for what is staged: the lane says why, on both sides.
    files = compressible(tmp_path / "src")
    staging = tmpfs("staging")
    sender, thread, box = send_in_background(tmp_path / "src", **opts)
    started = time.monotonic()
    with pytest.raises(StagingError, match=NO_SPACE):
        receive_dataset(sender.code, tmp_path / "out", staging_dir=str(staging), **opts)
    received_s = time.monotonic() - started
    thread.join(60)
    sent_s = time.monotonic() - started
    print(f"{files} bytes offered; receiver ended after {received_s:.1f} s, sender {sent_s:.1f} s")
    assert isinstance(box.get("error"), ReceiverFailedError), box
    assert "could not stage partition" in str(box["error"]) and NO_SPACE in str(box["error"])
    assert list(staging.iterdir()) == [] and not (tmp_path / "out").exists()
    assert max(received_s, sent_s) < END_BOUND


def test_offer_totals_are_optional_on_the_wire() -> None:
    schema = pa.schema([("a", pa.int64())])
    body = json.loads(Offer("t1", schema, rows=10, bytes=80).encode())["dataset-offer"]
    assert (Offer.decode(body).rows, Offer.decode(body).bytes) == (10, 80)
    bare = json.loads(Offer("t2", schema).encode())["dataset-offer"]
    assert "rows" not in bare and "bytes" not in bare  # what older peers send and expect
    assert (Offer.decode(bare).rows, Offer.decode(bare).bytes) == (None, None)
    assert TransferOptions().staging_root.name == "spark-dilation"


# --- a Spark reader: the cause reaches the reading action -----------------------------------------


def test_spark_reader_with_a_full_staging_disk_names_the_cause(
    side: Callable[..., Running],
    tmpfs: Callable[..., Path],
    tmp_path: Path,
    spark: Any,
    mailbox_url: str,
    relay_url: str,
) -> None:
    compressible(tmp_path / "src")  # staged as 6.4 MB of Arrow IPC
    staging = tmpfs("staging")
    sender = side(tmp_path / "tmp-send", "send", str(tmp_path / "src"))
    code = sender.wait_for_code()
    started = time.monotonic()
    with pytest.raises(Exception) as failed:
        spark.read.format("dilation").option("code", code).option("mailbox", mailbox_url).option(
            "relay", relay_url
        ).option("staging_dir", str(staging)).load().count()
    read_s = time.monotonic() - started
    ((sent, sent_s),) = both_end(sender)
    print(f"the reading action failed after {read_s:.1f} s; the sender ended after {sent_s:.1f} s")
    assert "could not stage partition" in str(failed.value), str(failed.value)[-3000:]
    assert NO_SPACE in str(failed.value)
    (line,) = error_lines(sent)
    assert "the receiver failed: lane " in line and NO_SPACE in line, sent.describe()
    assert max(read_s, sent_s) < END_BOUND + 30  # Spark's own start and task retries
