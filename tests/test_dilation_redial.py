"""Dilation heals when a reconnect finds no path for a while (the redial fix).

A 30 MiB transfer over the relay path only (``no_listen`` on both sides), on
loopback with the real servers: the transit relay runs in a process of its
own that the tests kill and restart on the same port; the mailbox in another
(restarted with the same database file where a test asks). Every transfer is
checked message by message and by the SHA-256 of the whole stream.

Before the fix every one of these hung forever: each side dialed its one
relay hint once, was refused, and never dialed again (the reference 0.24
still does that, so where it must act, the test accepts the give-up error).

No assertion depends on how fast anything happened; the ``reactor_test``
timeouts only bound a hang.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
from reactor_helpers import reactor_test, sleep
from test_dilation_durability import (  # the transfer harness, shared
    FOLLOWER_SIDE,
    LEADER_SIDE,
    MiB,
    Plan,
    Receiver,
    Sender,
    assert_intact,
    close_all,
    dilated_pair,
    start_transfer,
    wait_until,
)
from twisted.internet import defer, threads

from spark_dilation.dilation import DilationReconnectFailed
from spark_dilation.testing import ServerProcess, start_server_process

SIZE = 30 * MiB


class Restartable:
    """A server process that can be killed and started again on the same ports."""

    def __init__(self, *, extra_args: tuple[str, ...] = ()) -> None:
        self.extra_args = extra_args
        self.proc: ServerProcess | None = None
        self.mailbox_port = self.relay_port = 0

    def start(self) -> ServerProcess:
        self.proc = start_server_process(
            mailbox_port=self.mailbox_port, relay_port=self.relay_port, extra_args=self.extra_args
        )
        self.mailbox_port, self.relay_port = self.proc.mailbox_port, self.proc.relay_port
        return self.proc

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.stderr_path.unlink(missing_ok=True)  # ours: start_server_process made it
            self.proc = None

    async def restart_after(self, outage: float) -> None:
        await threads.deferToThread(self.kill)
        await sleep(outage)
        await threads.deferToThread(self.start)


@pytest.fixture
def relay() -> Any:
    """A transit relay of its own (its process also runs an unused mailbox)."""
    r = Restartable()
    r.start()
    yield r
    r.kill()


def relay_url(r: Restartable) -> str:
    return f"tcp:127.0.0.1:{r.relay_port}"


async def relay_only_pair(mailbox: str, r: Restartable, peer_kind: str, **ours: Any):
    return await dilated_pair(mailbox, peer_kind, relay=relay_url(r), no_listen=True, **ours)


def on_relay(peer: Any) -> bool:
    return peer.kind != "ours" or (peer.dw.status().connection or "").startswith("relay")


# --- 1. relay restarted, or away for 3, 10 and 30 s -------------------------------


@pytest.mark.parametrize("outage", [0.0, 3.0, 10.0, 30.0], ids=lambda s: f"away-{s:g}s")
@reactor_test(timeout=240)
async def test_relay_restart_heals_ours_to_ours(wormhole_servers, relay, sides, outage):
    sides(LEADER_SIDE, FOLLOWER_SIDE)
    a, b = await relay_only_pair(wormhole_servers.mailbox_url, relay, "ours")
    try:
        assert on_relay(a) and on_relay(b)
        plan = Plan(SIZE)
        snd, rcv = Sender(plan), Receiver(plan)
        cut: list[defer.Deferred] = []
        rcv.milestones = [
            (0.3, lambda: cut.append(defer.ensureDeferred(relay.restart_after(outage))))
        ]
        await start_transfer(a, b, snd, rcv)
        await wait_until(lambda: bool(cut))
        if outage >= 3:
            # The status API shows the retries while the relay is away.
            await wait_until(lambda: a.dw.status().retries >= 1 and b.dw.status().retries >= 1)
            assert a.dw.status().connection is None
            assert a.dw.status().last_error is not None
            assert "refused" in a.dw.status().last_error.lower()
        await cut[0]
        await defer.gatherResults([snd.finished, rcv.done], consumeErrors=True)
        assert_intact(snd, rcv)
        assert a.generation >= 2 and on_relay(a) and on_relay(b)  # healed, on the new relay
        assert a.dw.status().retries == 0 and a.dw.status().down_since is None
        # Generations that never connected are not counted: each side counts the
        # connections it selected, at least the first and one after the outage, at
        # most one per generation. (A busy machine can lose a just-selected
        # connection before the Follower reads the Leader's KCM: one more for the
        # Leader only, and one more generation.)
        for peer in (a, b):
            status = peer.dw.status()
            generations = status.generation + 1  # generation 0 was the first
            assert 2 <= status.connections <= generations, status
        if outage >= 3:  # the retries while the relay was away each began a generation
            status = a.dw.status()
            assert status.connections < status.generation + 1, status
    finally:
        await close_all(a, b)


# --- 3. against the reference ------------------------------------------------------


@reactor_test(timeout=180)
async def test_relay_restart_heals_ours_leader_with_reference_follower(
    wormhole_servers, relay, sides
):
    sides(LEADER_SIDE)
    a, b = await relay_only_pair(wormhole_servers.mailbox_url, relay, "reference")
    try:
        assert a.dw.status().role == "leader"
        plan = Plan(SIZE)
        snd, rcv = Sender(plan), Receiver(plan)
        cut: list[defer.Deferred] = []
        rcv.milestones = [(0.3, lambda: cut.append(defer.ensureDeferred(relay.restart_after(1.0))))]
        await start_transfer(b, a, snd, rcv)  # the reference sends
        await wait_until(lambda: bool(cut))
        await cut[0]
        await defer.gatherResults([snd.finished, rcv.done], consumeErrors=True)
        assert_intact(snd, rcv)
        # The reference dialed again only because we started new generations.
        assert a.generation >= 2
    finally:
        await close_all(a, b)


@reactor_test(timeout=180)
async def test_relay_restart_ours_follower_with_reference_leader_heals_or_gives_up(
    wormhole_servers, relay, sides
):
    """A reference Leader never starts a generation on its own after its dials
    failed, and our Follower cannot start one: our redials of the relay find
    no partner. Whatever happens, it must not hang silently on our side."""
    sides(FOLLOWER_SIDE)
    a, b = await relay_only_pair(
        wormhole_servers.mailbox_url, relay, "reference", reconnect_timeout=10.0
    )
    try:
        assert a.dw.status().role == "follower"
        plan = Plan(SIZE)
        snd, rcv = Sender(plan), Receiver(plan)
        cut: list[defer.Deferred] = []
        rcv.milestones = [(0.3, lambda: cut.append(defer.ensureDeferred(relay.restart_after(1.0))))]
        await start_transfer(a, b, snd, rcv)  # we send
        await wait_until(lambda: bool(cut))
        await cut[0]
        failed = a.dw.failure

        await wait_until(lambda: rcv.done.called or failed() is not None)
        if failed() is None:
            await defer.gatherResults([snd.finished, rcv.done], consumeErrors=True)
            assert_intact(snd, rcv)
        else:
            assert isinstance(failed(), DilationReconnectFailed)
            assert "within 10 s (reconnect_timeout)" in str(failed())
            assert a.dw.status().state == "FAILED"
            assert rcv.count < len(plan)  # nothing pretended to finish
    finally:
        await close_all(a, b)


# --- 4. the relay never comes back ------------------------------------------------


@reactor_test(timeout=120)
async def test_relay_gone_for_good_gives_the_typed_error_on_both_sides(
    wormhole_servers, relay, sides
):
    sides(LEADER_SIDE, FOLLOWER_SIDE)
    a, b = await relay_only_pair(wormhole_servers.mailbox_url, relay, "ours", reconnect_timeout=5.0)
    try:
        plan = Plan(SIZE)
        snd, rcv = Sender(plan), Receiver(plan)
        lost: dict[str, Any] = {}

        def record(side: str, proto: Any) -> None:
            original = proto.connectionLost

            def connection_lost(reason: Any = None) -> None:
                lost[side] = reason.value
                original(reason)

            proto.connectionLost = connection_lost

        record("sender", snd)
        record("receiver", rcv)
        rcv.milestones = [(0.3, lambda: relay.kill())]
        await start_transfer(a, b, snd, rcv)
        await wait_until(lambda: len(lost) == 2)
        port = relay.relay_port
        for side, error in lost.items():
            assert isinstance(error, DilationReconnectFailed), (side, error)
            text = str(error)
            assert "could not re-establish it within 5 s (reconnect_timeout)" in text
            assert re.search(rf"relay tcp:127\.0\.0\.1:{port} x\d+ \(last: .*refused", text), text
            assert f"Check that the transit relay (tcp:127.0.0.1:{port})" in text
        for peer in (a, b):
            status = peer.dw.status()
            assert status.state == "FAILED" and status.error == str(peer.dw.failure())
            with pytest.raises(DilationReconnectFailed):
                await peer.dw.connector_for("durability").connect(None)
        # The Leader retried with new generations, the Follower redialed.
        assert a.generation >= 2 and a.manager._redial.retries >= 2
        assert b.manager._redial.retries >= 2
        assert rcv.count < len(plan)
    finally:
        await close_all(a, b)


# --- 2. mailbox restarted while the L2 path is cut too ----------------------------


@pytest.mark.parametrize("peer_kind", ["ours", "reference"])
@reactor_test(timeout=180)
async def test_mailbox_restart_with_l2_cut_heals(tmp_path, relay, sides, peer_kind):
    sides(LEADER_SIDE, FOLLOWER_SIDE)
    mailbox = Restartable(extra_args=("--channel-db", str(tmp_path / "mailbox.sqlite")))
    await threads.deferToThread(mailbox.start)
    try:
        url = f"ws://127.0.0.1:{mailbox.mailbox_port}/v1"
        a, b = await relay_only_pair(url, relay, peer_kind)
        try:
            plan = Plan(SIZE)
            # The sender holds at half the plan until the outage is over, so the
            # transfer cannot end on the first connection however slow the machine.
            snd, rcv = Sender(plan, hold_after=len(plan) // 2), Receiver(plan)
            cut: list[defer.Deferred] = []

            async def outage() -> None:
                await threads.deferToThread(mailbox.kill)
                await relay.restart_after(0.0)  # the L2 path breaks while the mailbox is away
                await sleep(2.0)
                await threads.deferToThread(mailbox.start)

            rcv.milestones = [(0.3, lambda: cut.append(defer.ensureDeferred(outage())))]
            await start_transfer(a, b, snd, rcv)
            await wait_until(lambda: bool(cut))
            await cut[0]
            assert rcv.count < len(plan)
            snd.release()
            await defer.gatherResults([snd.finished, rcv.done], consumeErrors=True)
            assert_intact(snd, rcv)
            assert a.generation >= 1  # the cut cost a reconnect (generation 0 was the first)
        finally:
            await close_all(a, b)
    finally:
        await threads.deferToThread(mailbox.kill)


@reactor_test(timeout=120)
async def test_mailbox_and_relay_gone_gives_the_typed_error_naming_the_mailbox(
    tmp_path, relay, sides
):
    """A mailbox outage longer than the give-up deadline, with the L2 path
    cut too, ends in the same clear error on both sides, never a hang."""
    sides(LEADER_SIDE, FOLLOWER_SIDE)
    mailbox = Restartable(extra_args=("--channel-db", str(tmp_path / "mailbox.sqlite")))
    await threads.deferToThread(mailbox.start)
    try:
        url = f"ws://127.0.0.1:{mailbox.mailbox_port}/v1"
        a, b = await relay_only_pair(url, relay, "ours", reconnect_timeout=5.0)
        try:
            await threads.deferToThread(mailbox.kill)
            await relay.restart_after(0.0)  # L2 cut; the relay itself is back at once
            await wait_until(lambda: a.dw.failure() is not None and b.dw.failure() is not None)
            for peer in (a, b):
                text = str(peer.dw.failure())
                assert "within 5 s (reconnect_timeout)" in text, text
                assert "The mailbox server is unreachable right now" in text, text
                assert "its process may have ended" not in text, text
        finally:
            await threads.deferToThread(mailbox.start)  # so that the wormholes can close
            await close_all(a, b)
    finally:
        await threads.deferToThread(mailbox.kill)


@reactor_test(timeout=120)
async def test_first_connection_waits_for_a_relay_that_starts_late(wormhole_servers, relay, sides):
    """Generation 0 finds no path at first (the relay is down): retried, not stranded."""
    sides(LEADER_SIDE, FOLLOWER_SIDE)
    await threads.deferToThread(relay.kill)
    back: list[defer.Deferred] = []
    reactor_call = defer.ensureDeferred(sleep(3.0))
    reactor_call.addCallback(lambda _: back.append(threads.deferToThread(relay.start)))
    a, b = await relay_only_pair(wormhole_servers.mailbox_url, relay, "ours")
    try:
        assert back, "dilated before the relay was back: the test proves nothing"
        await back[0]
        plan = Plan(4 * MiB)
        snd, rcv = Sender(plan), Receiver(plan)
        await start_transfer(a, b, snd, rcv)
        await defer.gatherResults([snd.finished, rcv.done], consumeErrors=True)
        assert_intact(snd, rcv)
        assert a.generation >= 1  # the Leader started new generations meanwhile
    finally:
        await close_all(a, b)
