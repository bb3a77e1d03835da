"""``spark-dilation demo``: everything end to end on one machine.

1. Start the real mailbox server and transit relay (embedded, loopback).
2. Two wormholes exchange a text (code, PAKE, key confirmation).
3. A Parquet file goes over classic Transit (what ``wormhole send`` speaks)
   and its SHA-256 is checked on arrival.
4. Two separate Spark applications (``spark_peer`` processes) move a
   generated dataset of mixed types (1,000,000 rows by default) with
   ``df.write.format("dilation")`` and ``spark.read.format("dilation")``.
   Both compute an order-independent digest of every row; the demo fails
   unless count, schema and digest agree, then prints the sender's report.

Spark's logs go to files (the demo prints where). The reactor runs in a
crochet thread.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, TextIO

import crochet
from twisted.internet import defer

from .errors import DilationError
from .testing.peer_process import PeerError, PeerProcess
from .transit import filetransfer, offers
from .transit.connector import TransitConnector
from .wormhole import Wormhole
from .wormhole.blocking import ensure_reactor

ROWS = 1_000_000
FILE_ROWS = 10_000
PEER_TIMEOUT = 900.0


def _reactor() -> Any:
    from twisted.internet import reactor

    return reactor


@crochet.wait_for(timeout=60)
def _start_servers() -> defer.Deferred:
    from .servers import start_servers

    return start_servers(_reactor())


@crochet.wait_for(timeout=60)
def _stop_servers(servers: Any) -> defer.Deferred:
    return servers.stop()


@crochet.wait_for(timeout=60)
def _text_exchange(mailbox_url: str) -> defer.Deferred:
    async def go() -> tuple[str, str]:
        sender = Wormhole(offers.APPID, mailbox_url, _reactor(), timeout=30)
        sender.allocate_code()
        code = await sender.get_code()
        receiver = Wormhole(offers.APPID, mailbox_url, _reactor(), timeout=30)
        receiver.set_code(code)
        sender.send_message(offers.text_offer("hello from spark-dilation"))
        offer = offers.parse(await receiver.get_message())
        receiver.send_message(offers.text_ack())
        await sender.get_message()
        await defer.gatherResults([sender.close(), receiver.close()])
        assert isinstance(offer, offers.TextOffer)
        return code, offer.message

    return defer.ensureDeferred(go())


@crochet.wait_for(timeout=120)
def _file_exchange(mailbox_url: str, relay_url: str, path: Path, dest: Path) -> defer.Deferred:
    """Send ``path`` over classic Transit to a receiver in this process."""

    async def go() -> tuple[str, str, Any]:
        sender = Wormhole(offers.APPID, mailbox_url, _reactor(), timeout=30)
        sender.allocate_code()
        code = await sender.get_code()
        receiver = Wormhole(offers.APPID, mailbox_url, _reactor(), timeout=30)
        receiver.set_code(code)
        try:
            sent, got = await defer.gatherResults(
                [
                    defer.ensureDeferred(
                        filetransfer.send_path(
                            sender,
                            path,
                            TransitConnector(_reactor(), is_sender=True, relay_url=relay_url),
                        )
                    ),
                    defer.ensureDeferred(
                        filetransfer.receive(
                            receiver,
                            dest,
                            TransitConnector(_reactor(), is_sender=False, relay_url=relay_url),
                        )
                    ),
                ],
                consumeErrors=True,
            )
        except defer.FirstError as e:
            e.subFailure.raiseException()
        finally:
            await defer.gatherResults([sender.close(), receiver.close()], consumeErrors=True)
        return code, sent, got

    return defer.ensureDeferred(go())


def _write_parquet(path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table(
        {
            "id": pa.array(range(FILE_ROWS), pa.int64()),
            "city": pa.array([("Oslo", "Lagos", "Lima", "Pune")[i % 4] for i in range(FILE_ROWS)]),
            "amount": pa.array([round(i * 0.37, 2) for i in range(FILE_ROWS)], pa.float64()),
        }
    )
    pq.write_table(table, path)


def run(out: TextIO = sys.stdout, *, spark: bool = True, rows: int = ROWS) -> int:
    """Run the demo; returns a process exit code."""
    started = time.monotonic()
    ensure_reactor()
    servers = _start_servers()
    try:
        print(f"mailbox server: {servers.mailbox_url}", file=out)
        print(f"transit relay:  {servers.relay_url}", file=out)
        code, message = _text_exchange(servers.mailbox_url)
        print(f"[1/3] text over the wormhole with code {code}: {message!r}", file=out)
        with tempfile.TemporaryDirectory(prefix="spark-dilation-demo-") as tmp:
            source = Path(tmp) / "sales.parquet"
            _write_parquet(source)
            code, sent, got = _file_exchange(
                servers.mailbox_url, servers.relay_url, source, Path(tmp) / "inbox"
            )
            if got.sha256 != sent or got.path.read_bytes() != source.read_bytes():
                raise DilationError("demo failed: the received file differs from the source")
            print(
                f"[2/3] file {source.name} ({got.size:,} bytes) over classic Transit with "
                f"code {code}: SHA-256 verified",
                file=out,
            )
        if not spark:
            print("demo: OK (Spark part skipped)", file=out)
            return 0
        out.flush()
        _spark_to_spark(out, servers, rows)
        print(f"demo: OK ({time.monotonic() - started:.0f} s)", file=out)
        return 0
    finally:
        _stop_servers(servers)


def _peer(side: str, code: str, servers: Any, logs: Path, *args: str) -> PeerProcess:
    """One Spark application (``spark_peer``); its Spark logs go to a file."""
    return PeerProcess(
        side, code, servers.mailbox_url, servers.relay_url, logs / f"{side}.log",
        "--digest", "--option", f"peer_timeout={PEER_TIMEOUT:g}", *args,
        # Loopback, like the embedded servers; Spark's Python workers run this venv.
        env={"PYSPARK_PYTHON": sys.executable, "SPARK_LOCAL_IP": "127.0.0.1"},
    )  # fmt: skip


def _result(peer: PeerProcess, timeout: float) -> dict[str, Any]:
    """The peer's result, or the demo's error naming its log."""
    try:
        result = peer.result(timeout)
    except PeerError as e:
        raise DilationError(f"demo failed: {e}") from None
    if "error" in result or peer.proc.returncode != 0:
        raise DilationError(
            f"demo failed: the Spark {peer.side}er: {result.get('error', 'failed')} "
            f"(its log: {peer.log})"
        )
    return result


def _spark_pair(code: str, servers: Any, logs: Path, rows: int) -> tuple[dict, dict]:
    """Both applications' run, checked: the sender's report and its result."""
    with tempfile.TemporaryDirectory(prefix="spark-dilation-demo-") as tmp:
        staging = f"staging_dir={Path(tmp) / 'staging'}"
        receiver = _peer("receive", code, servers, logs, "--no-show", "--option", staging)
        sender = _peer("send", code, servers, logs, "--rows", str(rows), "--partitions", "4")
        try:
            sent = _result(sender, PEER_TIMEOUT + 120)
            got = _result(receiver, PEER_TIMEOUT + 120)
        finally:
            sender.kill()
            receiver.kill()
    try:
        report = sender.report()
    except PeerError as e:
        raise DilationError(f"demo failed: {e}") from None
    problems = []
    if got["count"] != rows:
        problems.append(f"the receiver counted {got['count']:,} rows, not {rows:,}")
    if json.loads(got["schema"]) != json.loads(sent["schema"]):
        problems.append("the schemas differ")
    if got["digest"] != sent["digest"]:
        problems.append(f"row digests differ: sent {sent['digest']}, received {got['digest']}")
    if report["rows"] != rows:
        problems.append(f"the sender reported {report['rows']:,} rows")
    if problems:
        raise DilationError("demo failed: " + "; ".join(problems))
    return report, sent


def _spark_to_spark(out: TextIO, servers: Any, rows: int) -> None:
    code = "5-demo-spark-to-spark"
    logs = Path(tempfile.mkdtemp(prefix="spark-dilation-demo-logs-"))
    print(
        f"[3/3] Spark -> Spark: {rows:,} rows of 12 column types with code {code}\n"
        f"      two Spark applications, local[2] each (Spark logs: {logs}, kept if it fails)",
        file=out,
    )
    out.flush()
    try:
        report, sent = _spark_pair(code, servers, logs, rows)
    except BaseException:
        print(f"      Spark logs kept in {logs}", file=out)
        raise
    shutil.rmtree(logs, ignore_errors=True)  # it worked: nothing of the demo is left
    rate = report["rows"] / report["seconds"] if report["seconds"] > 0 else 0.0
    print(
        f"      rows {report['rows']:,} | bytes {report['bytes']:,} "
        f"({report['bytes'] / 1e6:,.1f} MB) | {report['seconds']:.1f} s | {rate:,.0f} rows/s",
        file=out,
    )
    print(
        f"      path {report['path']} | connections {report['connections']} | "
        f"reconnects {report['reconnects']} | {report['partitions']} partitions over "
        f"{report['lanes']} lanes",
        file=out,
    )
    print(
        f"      content verified: count, schema and row digest equal on both sides "
        f"(digest {int(sent['digest'][1]) % 10**12:012d}...)",
        file=out,
    )
