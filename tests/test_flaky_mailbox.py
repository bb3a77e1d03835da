"""A mailbox server behind a flaky network: new connections closed on arrival.

Real mailbox server and relay, a loopback proxy in front of the mailbox
(:class:`~spark_dilation.testing._proxy.TcpProxy`) that closes new
connections: the next N, or each with a seeded probability. The product's own
code meets through it: the wormhole client, ``meet()`` at a door, and whole
Python API transfers (the directory link, the sender pool's meetings, the
lanes' doors). Issue 42: a meeting whose first connection failed used to end,
so its door's attempt was skipped (the lane waits on attempt ``a``, the
sender's next meeting on ``a + 1``), a transfer stalled or aborted.
"""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from autobahn.twisted.websocket import WebSocketClientProtocol
from reactor_helpers import failure_of, reactor, reactor_test, sleep
from twisted.internet import threads

from spark_dilation.errors import ServerConnectionError, WrongCodeError
from spark_dilation.testing._proxy import TcpProxy
from spark_dilation.testing.waiting import wait_until
from spark_dilation.transfer import receive_dataset, send_in_background
from spark_dilation.transfer.meet.rendezvous import close_wormhole, meet
from spark_dilation.transfer.rules.directory import Door
from spark_dilation.transfer.rules.options import TransferOptions
from spark_dilation.transfer.rules.protocol import ROLE_LANE, ROLE_SENDER
from spark_dilation.transfer.rules.spec import TransferSpec
from spark_dilation.wormhole import Wormhole
from spark_dilation.wormhole.client import CONNECT_TRIES

APPID = "spark-dilation.test/flaky"


@pytest.fixture
def proxy(wormhole_servers: Any) -> Any:
    with TcpProxy("127.0.0.1", wormhole_servers.mailbox_port) as p:
        yield p


@reactor_test()
async def test_a_wormhole_pair_meets_though_first_connections_are_refused(
    proxy: TcpProxy, mailbox_url: str
) -> None:
    proxy.refuse_next(CONNECT_TRIES - 1)  # one try short of giving up
    a = Wormhole(APPID, proxy.url(), reactor())
    a.allocate_code()
    code = await a.get_code()
    assert a.failed_tries == CONNECT_TRIES - 1 and a.connection_problem is None
    b = Wormhole(APPID, mailbox_url, reactor())
    b.set_code(code)
    assert await a.get_verifier() == await b.get_verifier()
    await a.close()
    await b.close()


@reactor_test()
async def test_tries_used_up_fail_with_the_cause_and_the_count(proxy: TcpProxy) -> None:
    proxy.refuse_new()  # TCP connects, then closes before the WebSocket opens
    w = Wormhole(APPID, proxy.url(), reactor())
    error = await failure_of(w.get_welcome())
    assert isinstance(error, ServerConnectionError), error
    assert f"({CONNECT_TRIES} tries)" in str(error) and "spark-dilation serve" in str(error)
    assert proxy.refused_connections == CONNECT_TRIES  # no try after giving up
    one = Wormhole(APPID, proxy.url(), reactor(), connect_tries=1)  # the reference's habit
    assert isinstance(await failure_of(one.get_welcome()), ServerConnectionError)
    assert proxy.refused_connections == CONNECT_TRIES + 1


def _spec(mailbox_url: str) -> TransferSpec:
    options = TransferOptions(mailbox=mailbox_url)
    return TransferSpec("cd" * 16, b"k" * 32, 1, b"", "none", options)


def test_a_door_meeting_outlives_refused_first_connections(
    proxy: TcpProxy, mailbox_url: str
) -> None:
    """The skipped attempt: the sender's meeting at door attempt 0 loses its first
    connections; it tries again (no error, no next attempt) and pairs with the lane
    that waits at that same door."""
    lane_spec = _spec(mailbox_url)
    sender_spec = replace(lane_spec, options=TransferOptions(mailbox=proxy.url()))
    door = Door(lane=0, epoch=0, sender=0, attempt=0)
    lane: dict[str, Any] = {}

    def lane_side() -> None:
        try:
            lane["w"] = meet(lane_spec, door.code(lane_spec.secret), ROLE_LANE, door)
        except BaseException as e:
            lane["error"] = e

    thread = threading.Thread(target=lane_side, daemon=True)
    thread.start()
    proxy.refuse_next(6)  # more than a user-facing wormhole's CONNECT_TRIES
    w = meet(sender_spec, door.code(sender_spec.secret), ROLE_SENDER, door)
    thread.join(60)
    assert "error" not in lane, lane
    assert proxy.refused_connections == 6
    assert w.failed_tries == 6
    close_wormhole(w)
    close_wormhole(lane["w"])


def _table(rows: int) -> pa.Table:
    return pa.table({"id": pa.array(range(rows), pa.int64()), "s": [f"r{i}" for i in range(rows)]})


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_transfers_through_a_proxy_that_refuses_a_fifth_of_new_connections(
    proxy: TcpProxy, relay_url: str, tmp_path: Path, seed: int
) -> None:
    """Both ends of a Python API transfer (2 lanes) reach the mailbox through a proxy
    that closes each new connection with probability 0.2: exact, every time (the code's
    wormholes try CONNECT_TRIES times: all lost at this rate, 1 in 15,000; the
    meetings at doors try until their deadline)."""
    proxy.refuse_randomly(0.2, seed)
    opts = {"mailbox": proxy.url(), "relay": relay_url, "staging_dir": str(tmp_path / "st")}
    table = _table(40_000)
    sender, thread, box = send_in_background(table, **opts)
    got = receive_dataset(sender.code, lanes=2, peer_timeout=60, **opts)
    thread.join(120)
    assert not thread.is_alive(), "the sender did not finish"
    assert "error" not in box, box
    assert got.table is not None and got.table.equals(table), "rows differ"
    assert got.report.connections == 2  # one per lane: no meeting given up and made again
    assert proxy.refused_connections > 0, "the proxy refused nothing: the test proved nothing"


# --- a restarted server keeps its state ------------------------------------------------


def _free_mailbox_port() -> tuple[int, str]:
    """A free loopback port for ``_serve`` and the mailbox URL on it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return port, f"ws://127.0.0.1:{port}/v1"


def _serve(folder: Path, port: int, *more: str) -> subprocess.Popen[bytes]:
    """``spark-dilation serve`` in ``folder``, listening on ``port`` once this returns."""
    command = [str(Path(sys.executable).parent / "spark-dilation"), "serve"]
    proc = subprocess.Popen(
        [*command, "--mailbox-port", str(port), "--relay-port", "0", *more],
        cwd=folder,
        stdout=subprocess.DEVNULL,
        stderr=(folder / "serve.log").open("ab"),
        start_new_session=True,
    )

    def listening() -> bool:
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", port)) == 0

    def ended() -> str | None:
        return (
            None if proc.poll() is None else f"serve exited: {(folder / 'serve.log').read_text()}"
        )

    wait_until("the mailbox server to listen", listening, 60, interval=0.1, stop_if=ended)
    return proc


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    proc.wait(30)


@reactor_test(timeout=120)
async def test_serve_keeps_its_mailboxes_across_a_restart(tmp_path: Path) -> None:
    """``spark-dilation serve`` keeps its database on disk by default (``mailbox.sqlite``
    in its folder): a code allocated before a restart is claimed after it, and the two
    sides meet (an in-memory server would have lost the nameplate's mailbox)."""
    port, url = _free_mailbox_port()
    server = await threads.deferToThread(_serve, tmp_path, port)
    a = Wormhole(APPID, url, reactor())
    b = None
    try:
        a.allocate_code()
        code = await a.get_code()
        await threads.deferToThread(_stop, server)
        assert (tmp_path / "mailbox.sqlite").is_file()
        server = await threads.deferToThread(_serve, tmp_path, port)
        b = Wormhole(APPID, url, reactor())
        b.set_code(code)
        assert await a.get_verifier() == await b.get_verifier()
        a.send_message(b"after the restart")
        assert await b.get_message() == b"after the restart"
    finally:
        for w in (a, b):
            if w is not None:
                with contextlib.suppress(Exception):
                    await w.close()
        await threads.deferToThread(_stop, server)


def test_a_lonely_door_meets_its_sender_after_a_restart_that_lost_everything(
    tmp_path: Path,
) -> None:
    """The lane waits alone at its door (``meet``, the Twisted client); the server
    restarts on an in-memory database, forgetting the door; the sender comes after:
    they pair, since the lane's wormhole claims its door again on its reconnect (the
    re-claim rule). Before the rule the lane reopened a mailbox no one else would open,
    and both waited until their deadline."""
    port, url = _free_mailbox_port()
    server = _serve(tmp_path, port, "--channel-db", ":memory:")
    spec = _spec(url)
    door = Door(lane=0, epoch=0, sender=0, attempt=0)
    lane: dict[str, Any] = {}

    def lane_side() -> None:
        try:
            lane["w"] = meet(
                spec, door.code(spec.secret), ROLE_LANE, door,
                deadline=time.monotonic() + 90, started=lambda w: lane.update(started=w),
            )  # fmt: skip
        except BaseException as e:
            lane["error"] = e

    thread = threading.Thread(target=lane_side, daemon=True)
    thread.start()
    try:
        wait_until(
            "the lane's claim to land", lambda: "started" in lane and lane["started"]._core.mailbox,
            30, interval=0.05, stop_if=lambda: lane.get("error"),
        )  # fmt: skip
        _stop(server)
        server = _serve(tmp_path, port, "--channel-db", ":memory:")
        w = meet(spec, door.code(spec.secret), ROLE_SENDER, door, deadline=time.monotonic() + 60)
        thread.join(60)
        assert "error" not in lane, lane
        assert lane["w"].server_lost_state, "the lane's re-claim did not see the lost state"
        assert not w.server_lost_state
        close_wormhole(w)
        close_wormhole(lane["w"])
    finally:
        _stop(server)
        thread.join(5)


def test_a_transfer_meets_through_a_restart_that_lost_everything(
    relay_url: str, tmp_path: Path
) -> None:
    """The sender (Python API) has its code and waits alone; the mailbox server restarts
    on an in-memory database, forgetting the code's nameplate; the receiver types the
    code after that: the session, the directory link and every lane's doors meet, and
    the rows arrive exact. Before the re-claim rule the receiver's claim made a new
    mailbox that the waiting sender never opened (its peer timeout ended it)."""
    port, url = _free_mailbox_port()
    server = _serve(tmp_path, port, "--channel-db", ":memory:")
    try:
        opts = {"mailbox": url, "relay": relay_url, "staging_dir": str(tmp_path / "st")}
        table = _table(20_000)
        sender, thread, box = send_in_background(table, **opts)
        _stop(server)
        server = _serve(tmp_path, port, "--channel-db", ":memory:")
        got = receive_dataset(sender.code, lanes=2, peer_timeout=60, **opts)
        thread.join(120)
        assert not thread.is_alive(), "the sender did not finish"
        assert "error" not in box, box
        assert got.table is not None and got.table.equals(table), "rows differ"
    finally:
        _stop(server)


# --- strangers cannot list our doors -----------------------------------------------------


async def _quiet_close(w: Wormhole) -> None:
    with contextlib.suppress(Exception):  # it only listed: nothing to say goodbye to
        await w.close()


@reactor_test(timeout=180)
async def test_list_on_the_public_appid_shows_none_of_a_transfers_doors(
    mailbox_url: str, relay_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While a transfer's lanes keep their doors claimed, ``list`` (which the server
    allows by default) on the public rendezvous appid shows none of them; on the appid
    both ends derived from the secret it does (so the listing would have seen them)."""
    from spark_dilation.transfer.meet import rendezvous
    from spark_dilation.transfer.rules.protocol import RENDEZVOUS_APPID

    derived: set[str] = set()
    appid = rendezvous.rendezvous_appid

    def recorded(secret: bytes, private: bool) -> str:
        value = appid(secret, private)
        derived.add(value)
        return value

    monkeypatch.setattr(rendezvous, "rendezvous_appid", recorded)
    table = _table(20_000)
    # Each first attempt pauses 3 s after its header: the doors stay claimed meanwhile.
    opts = {"mailbox": mailbox_url, "relay": relay_url, "staging_dir": str(tmp_path / "st")}
    sender, thread, box = await threads.deferToThread(
        send_in_background, table, test_fail="sender-pause:3", **opts
    )
    receiving = threads.deferToThread(receive_dataset, sender.code, lanes=2, **opts)
    public = Wormhole(RENDEZVOUS_APPID, mailbox_url, reactor())
    seen_public: set[str] = set()
    seen_private: set[str] = set()
    try:
        while not receiving.called:
            seen_public.update(await public.list_nameplates())
            if derived:
                (private_appid,) = derived
                w = Wormhole(private_appid, mailbox_url, reactor())
                seen_private.update(await w.list_nameplates())
                await _quiet_close(w)
            await sleep(0.2)
        got = await receiving
    finally:
        await _quiet_close(public)
    await threads.deferToThread(thread.join, 60)
    assert "error" not in box, box
    assert got.table is not None and got.table.equals(table)
    assert seen_private, "the transfer's own appid listed no door: the listing proves nothing"
    assert not seen_public, f"a stranger's list shows {len(seen_public)} doors: {seen_public}"
    assert derived != {RENDEZVOUS_APPID}, derived


def test_a_stranger_with_a_bogus_pake_on_a_door_costs_one_attempt(
    mailbox_url: str,
) -> None:
    """A stranger claims a lane's door (a forced collision: it knows the nameplate) and
    sends a PAKE of another password. The lane's meeting ends with DoorSpoiled and keeps
    its claim (the guard rule); the sender, coming after the stranger left, finds the
    door crowded (DoorSpoiled too) instead of waiting alone; both meet on the next
    attempt. Before: the lane failed with "wrong code" (and with it the transfer)."""
    from spark_dilation.transfer.meet.rendezvous import DoorSpoiled

    spec = _spec(mailbox_url)
    first, second = Door(0, 0, 0, 0), Door(0, 0, 0, 1)
    lane: dict[str, Any] = {}

    def lane_side() -> None:
        try:
            meet(spec, first.code(spec.secret), ROLE_LANE, first, deadline=time.monotonic() + 60)
        except BaseException as e:
            lane["error"] = e
        try:
            lane["w"] = meet(
                spec, second.code(spec.secret), ROLE_LANE, second, deadline=time.monotonic() + 60
            )
        except BaseException as e:
            lane["second"] = e

    thread = threading.Thread(target=lane_side, daemon=True)
    thread.start()
    nameplate = first.code(spec.secret).split("-")[0]
    stranger = meet_stranger(spec, f"{nameplate}-not-the-password")
    wait_until("the lane's meeting to end", lambda: "error" in lane, 60, interval=0.05)
    assert isinstance(lane["error"], DoorSpoiled), lane["error"]
    assert isinstance(lane["error"].__cause__, WrongCodeError), lane["error"]
    close_wormhole(stranger)  # the stranger leaves; the lane's claim stays
    with pytest.raises(DoorSpoiled, match="crowded"):
        meet(spec, first.code(spec.secret), ROLE_SENDER, first, deadline=time.monotonic() + 30)
    w = meet(spec, second.code(spec.secret), ROLE_SENDER, second, deadline=time.monotonic() + 60)
    thread.join(60)
    assert "second" not in lane, lane
    close_wormhole(w)
    close_wormhole(lane["w"])


def meet_stranger(spec: TransferSpec, code: str) -> Any:
    """A wormhole on the transfer's doors appid with ``code``: its PAKE reaches the lane."""
    from crochet import EventualResult

    from spark_dilation.transfer.rules.directory import rendezvous_appid
    from spark_dilation.wormhole.blocking import ensure_reactor, run_and_wait

    ensure_reactor()

    def start() -> Any:
        w = Wormhole(
            rendezvous_appid(spec.secret, spec.private_doors),
            spec.options.mailbox_url,
            reactor(),
            dilation=True,
        )
        w.set_code(code)
        return w, EventualResult(w.get_unverified_key(), reactor())

    w, key = run_and_wait(start, timeout=30, on_timeout=lambda: TimeoutError("start"))
    key.wait(30)  # its PAKE went out and the lane's came back: the lane has ours too
    return w


class _SilentStranger(WebSocketClientProtocol):
    """A raw mailbox client that binds, claims a nameplate and opens its mailbox, and
    never sends a PAKE: it hears who comes (``factory.heard``)."""

    def onOpen(self) -> None:
        f = self.factory
        bind = {"type": "bind", "appid": f.appid, "side": "stranger00"}
        self.sendMessage(json.dumps(bind).encode())
        self.sendMessage(json.dumps({"type": "claim", "nameplate": f.nameplate}).encode())

    def onMessage(self, payload: bytes, isBinary: bool) -> None:
        message = json.loads(payload)
        self.factory.heard.append(message)
        if message.get("type") == "claimed":
            opening = {"type": "open", "mailbox": message["mailbox"]}
            self.sendMessage(json.dumps(opening).encode())


@pytest.mark.parametrize("second", ["lane", "sender"])
def test_a_silent_stranger_on_a_door_costs_one_attempt_not_the_transfer(
    mailbox_url: str,
    relay_url: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    second: str,
) -> None:
    """A stranger (a forced collision: it knows the door) claims lane 0's first door for
    the writing end's own sender before either side, opens the mailbox and never sends
    a PAKE. ``second`` (the lane, or the sender) claims next and waits there with it,
    never seeing it; the other side claims third and is crowded. The crowded side
    reports the door through the directory (the sender's hub to the reading end, or
    back), so the side that never saw the stranger gives the door up too, and both
    meet on the next attempt: the rows arrive exact. Before, the second side waited on
    the door for good, and the sender failed at ``lane_start_timeout``."""
    from autobahn.twisted.websocket import WebSocketClientFactory
    from twisted.internet import endpoints

    from spark_dilation.transfer.meet import rendezvous
    from spark_dilation.transfer.receive import lane as lane_module
    from spark_dilation.transfer.send import pool as pool_module

    appid = rendezvous.rendezvous_appid
    port = int(mailbox_url.rsplit(":", 1)[1].split("/")[0])
    factory = WebSocketClientFactory(mailbox_url)
    factory.protocol = _SilentStranger
    factory.heard = []

    def first_use(secret: bytes, private: bool) -> str:
        # The transfer's first meeting (its directory link) starts here, in the reactor:
        # the stranger's claim goes out ahead of every door's.
        value = appid(secret, private)
        if not hasattr(factory, "appid"):
            factory.appid = value
            factory.nameplate = Door(0, 0, 0, 0).code(secret).split("-")[0]
            endpoints.TCP4ClientEndpoint(reactor(), "127.0.0.1", port).connect(factory)
        return value

    def pakes() -> int:
        return sum(m.get("type") == "message" and m.get("phase") == "pake" for m in factory.heard)

    def ordered(role: str, real: Any) -> Any:
        def claim_door(spec: TransferSpec, door: Door, *args: Any, **kwargs: Any) -> Any:
            if door == Door(0, 0, 0, 0):  # the stranger first; then `second`; then us
                wait_until("the stranger's claim", lambda: factory.heard, 30, interval=0.02)
                if role != second:
                    wait_until(f"the {second}'s PAKE", lambda: pakes() >= 1, 30, interval=0.02)
            return real(spec, door, *args, **kwargs)

        return claim_door

    monkeypatch.setattr(rendezvous, "rendezvous_appid", first_use)
    monkeypatch.setattr(lane_module, "claim_door", ordered("lane", lane_module.claim_door))
    monkeypatch.setattr(pool_module, "claim_door", ordered("sender", pool_module.claim_door))
    opts = {"mailbox": mailbox_url, "relay": relay_url, "staging_dir": str(tmp_path / "st")}
    table = _table(20_000)
    sender, thread, box = send_in_background(table, lane_start_timeout=60, **opts)
    got = receive_dataset(sender.code, lanes=1, peer_timeout=120, **opts)
    thread.join(60)
    assert not thread.is_alive(), "the sender did not finish"
    assert "error" not in box, box
    assert got.table is not None and got.table.equals(table), "rows differ"
    # The stranger held the door with the second side only: never crowded itself.
    assert [m["type"] for m in factory.heard if m["type"] == "error"] == [], factory.heard
    assert pakes() == 1, factory.heard
