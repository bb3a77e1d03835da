"""The Python dataset API end to end on the real mailbox server and transit relay."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest

from spark_dilation.errors import PeerTimeoutError, WrongCodeError
from spark_dilation.testing.waiting import wait_until
from spark_dilation.transfer import (
    TransferOptions,
    receive_dataset,
    send_in_background,
)
from spark_dilation.transfer.meet.session import SenderSession, receive_session
from spark_dilation.transfer.receive.lane import TransferAbortedError
from spark_dilation.transfer.rules.errors import LaneIdleError
from spark_dilation.transfer.send.pool import LaneNotStartedError


def mixed(rows: int) -> pa.Table:
    return pa.table(
        {
            "id": pa.array(range(rows), pa.int64()),
            "x": pa.array([None if i % 7 == 0 else i / 3 for i in range(rows)]),
            "s": pa.array([f"row-{i:011d}" for i in range(rows)]),
            "tags": pa.array([[i, i + 1] if i % 3 else None for i in range(rows)]),
        }
    )


@pytest.fixture
def opts(mailbox_url: str, relay_url: str, tmp_path: Path) -> dict[str, Any]:
    return {"mailbox": mailbox_url, "relay": relay_url, "staging_dir": str(tmp_path / "staging")}


def join(thread: threading.Thread, box: dict[str, Any], timeout: float = 120) -> Any:
    thread.join(timeout)
    assert not thread.is_alive(), "the sender did not finish"
    if "error" in box:
        raise box["error"]
    return box["report"]


@pytest.mark.parametrize(("lanes", "compression"), [(1, "none"), (3, "zstd"), (2, "lz4")])
def test_table_to_table_exact(
    opts: dict[str, Any], lanes: int, compression: str, tmp_path: Path
) -> None:
    t = mixed(250_000)
    sender, thread, box = send_in_background(t, compression=compression, **opts)
    got = receive_dataset(sender.code, lanes=lanes, **opts)
    report = join(thread, box)
    assert got.table is not None and got.table.equals(t)
    assert got.schema.equals(t.schema)
    assert report.rows == got.report.rows == t.num_rows
    assert report.lanes == lanes and report.compression == compression
    # One connection per lane, whatever the number of partitions, which also carries
    # the manifest (no new meeting at the end): what the receiver counts too.
    assert report.connections == lanes == got.report.connections
    assert report.partitions >= lanes and report.path in ("direct", "relay", "direct+relay")
    # Staging is removed once the table is built.
    assert not any((tmp_path / "staging").rglob("*.arrow"))


def test_files_to_parquet_folder(opts: dict[str, Any], tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    t = mixed(30_000)
    for i in range(3):
        pq.write_table(t.slice(i * 10_000, 10_000), src / f"part-{i}.parquet")
    sender, thread, box = send_in_background(src, **opts)
    got = receive_dataset(sender.code, tmp_path / "out", lanes=2, **opts)
    report = join(thread, box)
    assert report.partitions == 3 and len(got.files) == 3
    back = pa.concat_tables(pq.read_table(f) for f in sorted(got.files))
    assert back.equals(t)


def test_csv_file_to_table(opts: dict[str, Any], tmp_path: Path) -> None:
    path = tmp_path / "data.csv"
    t = pa.table({"a": pa.array(range(1000)), "b": pa.array([f"v{i}" for i in range(1000)])})
    pacsv.write_csv(t, path)
    sender, thread, box = send_in_background([str(path)], **opts)
    got = receive_dataset(sender.code, **opts)
    join(thread, box)
    assert got.table is not None and got.table.equals(pacsv.read_csv(path))


def test_bad_source_paths(opts: dict[str, Any], tmp_path: Path) -> None:
    from spark_dilation.errors import TransferError

    with pytest.raises(TransferError, match="does not exist"):
        send_in_background(tmp_path / "nope.parquet", **opts)
    (tmp_path / "x.txt").write_text("hi")
    with pytest.raises(TransferError, match=r"cannot tell the format of x\.txt"):
        send_in_background(tmp_path / "x.txt", **opts)


def test_wrong_code_fails_both_sides(opts: dict[str, Any]) -> None:
    sender, thread, box = send_in_background(mixed(10), peer_timeout=30, **opts)
    nameplate = sender.code.split("-")[0]
    with pytest.raises(WrongCodeError, match="key confirmation failed"):
        receive_dataset(f"{nameplate}-wrong-words", peer_timeout=30, **opts)
    thread.join(30)
    assert isinstance(box.get("error"), WrongCodeError)


def test_reader_never_comes(opts: dict[str, Any]) -> None:
    started = time.monotonic()
    _sender, thread, box = send_in_background(mixed(10), peer_timeout=2, **opts)
    thread.join(30)
    assert isinstance(box.get("error"), PeerTimeoutError)
    assert "nobody used the code" in str(box["error"])
    assert time.monotonic() - started < 30


def test_writer_never_comes(opts: dict[str, Any]) -> None:
    with pytest.raises(
        PeerTimeoutError, match="nobody used the code 4242-never-comes within 2 seconds"
    ):
        receive_dataset("4242-never-comes", peer_timeout=2, **opts)


def test_lane_that_never_starts(opts: dict[str, Any]) -> None:
    # The receiver agrees on 2 lanes but never runs them (a reader that never
    # calls an action): the sender says which lane and which option to change.
    o = TransferOptions(**opts, lane_start_timeout=3, peer_timeout=30)
    session = SenderSession.open(mixed(10).schema, o)
    result: dict[str, Any] = {}
    t = threading.Thread(target=lambda: result.setdefault("spec", session.wait()))
    t.start()
    receive_session(session.code, o.with_(lanes=2))
    t.join(30)
    from spark_dilation.transfer.meet.hub import SenderHub
    from spark_dilation.transfer.send.pool import send_partition

    hub = SenderHub(result["spec"])  # the writing end: no lane epoch ever comes
    started = time.monotonic()
    try:
        with pytest.raises(LaneNotStartedError, match=r"lane 1 of 2 did not start within 3 s"):
            send_partition(result["spec"], 1, 0, iter(mixed(10).to_batches()))
    finally:
        hub.close()
    assert time.monotonic() - started < 20


def test_sender_failure_aborts_the_receiver(opts: dict[str, Any]) -> None:
    def batches() -> Any:
        yield from mixed(100).to_batches()
        raise RuntimeError("source broke")

    from spark_dilation.transfer.api import send as api_send

    # A dataset whose second partition fails while being read.
    t = mixed(200)
    sender = api_send.DatasetSender(t, options=TransferOptions(**opts))
    original = api_send.partitions_of

    def partitions(source: Any, n: int) -> Any:
        parts = original(source, n)
        parts.makers[1] = batches
        return parts

    box: dict[str, Any] = {}
    api_send.partitions_of = partitions
    try:
        thread = threading.Thread(
            target=lambda: box.setdefault("error", _catch(sender.wait)), daemon=True
        )
        thread.start()
        with pytest.raises(TransferAbortedError, match="source broke"):
            receive_dataset(sender.code, lanes=2, **opts)
        thread.join(60)
    finally:
        api_send.partitions_of = original
    assert isinstance(box["error"], RuntimeError)


def _catch(fn: Any) -> Any:
    try:
        return fn()
    except BaseException as e:
        return e


_KILLED_SENDER = """
import sys
import pyarrow as pa
from spark_dilation.transfer import send_dataset
table = pa.table({"id": pa.array(range(200_000), pa.int64())})
send_dataset(table, code=sys.argv[1], mailbox=sys.argv[2], relay=sys.argv[3],
             staging_dir=sys.argv[4], test_fail="sender-pause:120")
"""


@pytest.mark.liveness
def test_a_sender_killed_without_a_word_ends_the_receiver_after_reconnect_timeout(
    opts: dict[str, Any], tmp_path: Path
) -> None:
    """SIGKILL of the sending process mid-partition: nothing tells the receiver, whose
    lane ends once Dilation gave up on the connection (reconnect_timeout, 5 s here)
    instead of after idle_timeout (600 s), naming the option; nothing of it is left."""
    code = "80007-killed-sender"  # high: low nameplates are allocated to other tests
    sender = subprocess.Popen(
        [sys.executable, "-c", _KILLED_SENDER, code, opts["mailbox"], opts["relay"],
         str(tmp_path / "sender")],
        stderr=(tmp_path / "sender.log").open("wb"),
    )  # fmt: skip
    box: dict[str, Any] = {}

    def receive() -> None:
        try:
            box["got"] = receive_dataset(code, reconnect_timeout=5, peer_timeout=60, **opts)
        except Exception as e:
            box["error"] = e

    thread = threading.Thread(target=receive, daemon=True)
    thread.start()
    staging = Path(opts["staging_dir"])

    def in_flight_on_both_lanes() -> bool:
        # Both lanes connected and mid-partition: a lane still dilating when the sender
        # dies ends with "could not connect", not the "lost the connection" asserted here
        # (seen on a loaded machine when the wait was for one partial only).
        return len({p.parent.name for p in staging.glob("*/lane-*/.p*.partial")}) == 2

    try:
        wait_until("a partition in flight on both lanes", in_flight_on_both_lanes, 60)
    finally:
        sender.kill()
    killed = time.monotonic()
    thread.join(120)
    took = time.monotonic() - killed
    print(f"the receiver ended {took:.1f} s after the sender was killed: {box}")
    assert isinstance(box.get("error"), LaneIdleError), box
    # Redial's give-up text, reconnect_timeout named once and spelled for this API.
    message = str(box["error"])
    assert "lost the sender: Dilation lost the connection" in message, message
    assert "within 5 s (reconnect_timeout=)" in message, message
    assert message.count("reconnect_timeout") == 2, message  # "(...)" and "raise ..."
    assert took < 60, took  # 5 s reconnect_timeout, then the lane ends (idle_timeout: 600 s)
    assert not list(staging.glob("*/lane-*")), list(staging.rglob("*"))
