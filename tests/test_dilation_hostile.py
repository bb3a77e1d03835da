"""Dilation under attack: strangers on our port, wrong keys, garbage on a live
connection, OPENs nobody listens for. The process and the other subchannels
must carry on, and nothing a peer sends may make us hold unbounded memory.

Real mailbox server and transit relay, loopback only, bodies on the shared
crochet reactor. Helpers come from ``test_dilation_interop``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import pytest
from reactor_helpers import reactor, reactor_test, sleep
from test_dilation_interop import (
    FOLLOWER_SIDE,
    LEADER_SIDE,
    ChanFactory,
    End,
    close_all,
    connect_wormholes,
    digest,
    failure_within,
    messages,
    new_end,
    start_dilation,
    until,
    within,
)
from twisted.internet import defer, endpoints, error, protocol

from spark_dilation.dilation import connection as C
from spark_dilation.dilation import framing
from spark_dilation.dilation.subchannels import DEFAULT_MAX_PENDING_BYTES

SIDES = {"leader": LEADER_SIDE, "follower": FOLLOWER_SIDE}
OTHER_SIDE = {"leader": FOLLOWER_SIDE, "follower": LEADER_SIDE}


@pytest.fixture
def logs(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.INFO, logger="spark_dilation")
    return caplog


def logged(caplog: pytest.LogCaptureFixture, *fragments: str) -> list[str]:
    """Our log lines that contain every fragment."""
    return [
        r.getMessage()
        for r in caplog.records
        if r.name.startswith("spark_dilation") and all(f in r.getMessage() for f in fragments)
    ]


# --- raw TCP clients -------------------------------------------------------------------------


class Raw(protocol.Protocol):
    """Writes ``payload`` on connect and records what comes back."""

    def __init__(self, payload: bytes) -> None:
        self.payload = payload
        self.received = bytearray()
        self.lost: defer.Deferred = defer.Deferred()

    def connectionMade(self) -> None:
        if self.payload:
            self.transport.write(self.payload)

    def dataReceived(self, data: bytes) -> None:
        self.received += data

    def connectionLost(self, reason: Any = None) -> None:
        if not self.lost.called:
            self.lost.callback(None)


class RawL2(protocol.Protocol):
    """A stranger speaking real Dilation L2 (our own sans-IO object) with its own key.

    ``after_failure`` is written when its own L2Connection gives up (a Follower
    with the wrong key cannot read the Leader's msg1; it answers with what a
    wrong-key msg2 looks like to the Leader: 48 bytes it cannot authenticate).
    """

    def __init__(self, conn: C.L2Connection, after_failure: bytes = b"") -> None:
        self.conn = conn
        self.after_failure = after_failure
        self.events: list[C.Event] = []
        self.lost: defer.Deferred = defer.Deferred()

    def connectionMade(self) -> None:
        self._apply(self.conn.connection_made())

    def dataReceived(self, data: bytes) -> None:
        self._apply(self.conn.data_received(data))

    def _apply(self, events: list[C.Event]) -> None:
        for event in events:
            self.events.append(event)
            if isinstance(event, C.Write):
                self.transport.write(bytes(event.data))
            elif isinstance(event, C.Failed) and self.after_failure:
                self.transport.write(self.after_failure)

    def connectionLost(self, reason: Any = None) -> None:
        if not self.lost.called:
            self.lost.callback(None)


async def raw_connect(port: int, proto: protocol.Protocol) -> Any:
    ep = endpoints.TCP4ClientEndpoint(reactor(), "127.0.0.1", port, timeout=10)
    return await ep.connect(protocol.Factory.forProtocol(lambda: proto))


# --- a victim whose hints we hold back -------------------------------------------------------


class HeldHints:
    """Keeps our ``connection-hints`` messages from the peer until :meth:`release`.

    The victim's listening port is up and advertised in ``status().hints_sent``,
    but the peer cannot reach it yet, so strangers get there first.
    """

    def __init__(self, end: End) -> None:
        self.held: list[bytes] = []
        self.released = False
        self._send = end.w.send_dilate
        end.w.send_dilate = self._send_dilate

    def _send_dilate(self, plaintext: bytes) -> None:
        if not self.released and b'"connection-hints"' in plaintext:
            self.held.append(plaintext)
        else:
            self._send(plaintext)

    def release(self) -> None:
        self.released = True
        for plaintext in self.held:
            self._send(plaintext)
        self.held.clear()


async def victim_with_held_hints(
    role: str, sides: Callable[..., None], mailbox_url: str, relay_url: str
) -> tuple[End, End, HeldHints, int]:
    """Ours (the victim, ``role``) and ours (the peer: no_listen, no relay, so it can
    only dial the victim's direct hint). Returns the victim's advertised port."""
    sides(SIDES[role], OTHER_SIDE[role])
    a = new_end("ours", mailbox_url)
    b = new_end("ours", mailbox_url)
    await connect_wormholes(a, b)
    held = HeldHints(a)
    start_dilation(a, relay_url)
    start_dilation(b, None, no_listen=True)
    await until(
        lambda: any(h["type"] == "direct-tcp-v1" for h in a.dw.status().hints_sent),
        "our direct hint",
    )
    st = a.dw.status()
    assert st.state == "CONNECTING" and st.role == role
    port = next(h["port"] for h in st.hints_sent if h["type"] == "direct-tcp-v1")
    return a, b, held, port


async def transfer_works(a: End, b: End, name: str) -> None:
    """A subchannel each way between two dilated ends, content checked."""
    on_a, on_b = ChanFactory(outgoing=messages(11)), ChanFactory(outgoing=messages(12))
    await within(a.dw.listener_for(f"{name}-a").listen(on_a), "listen")
    await within(b.dw.listener_for(f"{name}-b").listen(on_b), "listen")
    out_ab, out_ba = messages(21), messages(22)
    p = await within(a.dw.connector_for(f"{name}-b").connect(ChanFactory(out_ab)), "connect")
    q = await within(b.dw.connector_for(f"{name}-a").connect(ChanFactory(out_ba)), "connect")
    await until(lambda: len(on_a.built) == 1 and len(on_b.built) == 1, "OPENs")
    await until(lambda: len(on_b.built[0].received) == len(out_ab), "a->b data")
    await until(lambda: len(on_a.built[0].received) == len(out_ba), "b->a data")
    await until(lambda: len(p.received) == len(messages(12)), "b's answer")
    await until(lambda: len(q.received) == len(messages(11)), "a's answer")
    assert digest(on_b.built[0].received) == digest(out_ab)
    assert digest(on_a.built[0].received) == digest(out_ba)
    assert [len(m) for m in p.received] == [len(m) for m in messages(12)]
    for proto in (p, q):
        proto.transport.loseConnection()
    for proto in (p, q, on_a.built[0], on_b.built[0]):
        await within(proto.lost, "connectionLost")


# --- strangers on our advertised port ----------------------------------------------------------


@pytest.mark.parametrize("role", ["leader", "follower"])
@reactor_test(timeout=120)
async def test_strangers_on_our_port_are_dropped(role, sides, logs, mailbox_url, relay_url):
    a, b, held, port = await victim_with_held_hints(role, sides, mailbox_url, relay_url)
    try:
        ours_prologue = framing.LEADER_PROLOGUE if role == "leader" else framing.FOLLOWER_PROLOGUE
        theirs = framing.FOLLOWER_PROLOGUE if role == "leader" else framing.LEADER_PROLOGUE
        attacks = {
            "wrong prologue": b"Magic-Wormhole Dilation Handshake v1 Lemon\n\n",
            "same role": ours_prologue,
            "http": b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: keep-alive\r\n\r\n",
            "random": b"\x00" + os.urandom(4096),
            "4 GiB frame": theirs + b"\xff\xff\xff\xff" + os.urandom(1000),
            "frame above the limit": theirs + (framing.DEFAULT_MAX_FRAME + 1).to_bytes(4, "big"),
        }
        clients = {}
        for name, payload in attacks.items():
            clients[name] = await within(raw_connect(port, Raw(payload)), f"connect ({name})")
        # One that speaks the right prologue and then nothing: not an error by
        # itself, so it may stay until the generation picks its connection.
        idle = await within(raw_connect(port, Raw(theirs)), "connect (idle)")

        for name, client in clients.items():
            await within(client.lost, f"the {name} connection to be dropped", timeout=10)
            # We spoke first (our prologue) and said nothing else to a stranger.
            assert bytes(client.received).startswith(ours_prologue[:1]), name
            assert len(client.received) <= len(ours_prologue) + 4 + 48, name
        assert logged(logs, "not a Dilation peer")
        assert logged(logs, "same Dilation role")
        assert logged(logs, "frame of 4294967295 bytes")
        assert logged(logs, f"frame of {framing.DEFAULT_MAX_FRAME + 1} bytes")
        # Dropped connections are forgotten (only the idle one is still held).
        connector = a.manager._connector
        assert connector is not None and not connector.stopped
        # (Our own relay dial may have started meanwhile: count inbound ones only.)
        await until(
            lambda: len([p for p in connector._protocols if not p.is_relay]) == 1,
            "dropped attempts to be forgotten",
        )
        assert not idle.lost.called
        assert a.dw.status().state == "CONNECTING"

        # Now the real peer gets our hints: dilation completes through the same
        # port, which survived all that.
        held.release()
        await within(a.dw.when_dilated(), "our when_dilated()")
        await within(b.dw.when_dilated(), "the peer's when_dilated()")
        st = a.dw.status()
        assert st.state == "CONNECTED" and st.generation == 0
        assert st.connection is not None and st.connection.startswith("direct"), st.connection
        # The idle stranger is dropped once the generation has its connection,
        # and the advertised port is closed: nothing more can get in.
        await within(idle.lost, "the idle stranger to be dropped", timeout=10)
        err = await failure_within(raw_connect(port, Raw(b"")), "a refused connection")
        assert isinstance(err, error.ConnectionRefusedError), repr(err)
        await transfer_works(a, b, "after-strangers")
    finally:
        await close_all(a, b)


@pytest.mark.parametrize("role", ["leader", "follower"])
@reactor_test(timeout=120)
async def test_wrong_dilation_key_is_dropped(role, sides, logs, mailbox_url, relay_url):
    """A stranger that speaks Dilation perfectly but holds another key (another code)."""
    a, b, held, port = await victim_with_held_hints(role, sides, mailbox_url, relay_url)
    try:
        wrong_key = os.urandom(32)
        stranger_is_leader = role == "follower"
        conn = C.L2Connection(wrong_key, leader=stranger_is_leader)
        fake_msg2 = framing.encode_frame(os.urandom(48))
        stranger = RawL2(conn, after_failure=b"" if stranger_is_leader else fake_msg2)
        await within(raw_connect(port, stranger), "connect")
        await within(stranger.lost, "the wrong-key connection to be dropped", timeout=10)
        assert logged(logs, "different code"), [r.getMessage() for r in logs.records]
        # The stranger never got a KCM or any record from us.
        assert not any(isinstance(e, (C.PeerKCM, C.RecordReceived)) for e in stranger.events)
        assert a.dw.status().state == "CONNECTING"

        held.release()
        await within(a.dw.when_dilated(), "our when_dilated()")
        await within(b.dw.when_dilated(), "the peer's when_dilated()")
        await transfer_works(a, b, "after-wrong-key")
    finally:
        await close_all(a, b)


# --- garbage on the live, selected L2 -----------------------------------------------------------


def unknown_tag(l2: Any) -> bytes:
    """A correctly encrypted record with tag 0x09 (no such record type)."""
    return bytes(l2.conn._transport.encrypt_frame(b"\x09surprise"))


def malformed_ack(l2: Any) -> bytes:
    """A correctly encrypted ACK of the wrong length."""
    return bytes(l2.conn._transport.encrypt_frame(b"\x06\x00\x00"))


def forged_frame(l2: Any) -> bytes:
    """A frame that does not decrypt (not from the key holder, or corrupted)."""
    return framing.encode_frame(os.urandom(64))


INJECTIONS = {"unknown-tag": unknown_tag, "malformed-ack": malformed_ack, "forged": forged_frame}


async def streams_survive(a: End, b: End, inject: Callable[[], None]) -> None:
    """Data both ways on one subchannel, ``inject()`` in the middle; each message
    must arrive exactly once, in order, after the reconnection."""
    on_b = ChanFactory()
    await within(b.dw.listener_for("stream").listen(on_b), "listen")
    p = await within(a.dw.connector_for("stream").connect(ChanFactory()), "connect")
    await until(lambda: len(on_b.built) == 1, "the OPEN")
    q = on_b.built[0]
    first_ab = [b"ab-%03d-" % i + os.urandom(3000) for i in range(40)]
    first_ba = [b"ba-%03d-" % i + os.urandom(3000) for i in range(40)]
    second_ab = [b"ab-%03d-" % i + os.urandom(70000) for i in range(40, 50)]
    second_ba = [b"ba-%03d-" % i + os.urandom(70000) for i in range(40, 50)]
    # Same reactor turn: these are still in flight (un-ACKed) when the
    # connection dies, so the new generation must replay them.
    for m_ab, m_ba in zip(first_ab, first_ba, strict=True):
        p.transport.write(m_ab)
        q.transport.write(m_ba)
    inject()
    for m_ab, m_ba in zip(second_ab, second_ba, strict=True):
        p.transport.write(m_ab)
        q.transport.write(m_ba)
    want_ab, want_ba = first_ab + second_ab, first_ba + second_ba
    await until(lambda: len(q.received) >= len(want_ab), "a->b after the reconnection", 60)
    await until(lambda: len(p.received) >= len(want_ba), "b->a after the reconnection", 60)
    await sleep(0.5)  # anything duplicated would show up by now
    assert [m[:7] for m in q.received] == [m[:7] for m in want_ab]
    assert [m[:7] for m in p.received] == [m[:7] for m in want_ba]
    assert digest(q.received) == digest(want_ab)
    assert digest(p.received) == digest(want_ba)
    p.transport.loseConnection()
    await within(p.lost, "connectionLost")
    await within(q.lost, "connectionLost")


@pytest.mark.parametrize("injection", list(INJECTIONS))
@pytest.mark.parametrize("role", ["leader", "follower"])
@reactor_test(timeout=120)
async def test_garbage_on_live_connection_reconnects(
    role, injection, sides, logs, mailbox_url, relay_url
):
    """The peer (ours, acting hostile on its selected L2) sends a record we must
    refuse: we drop that L2, Dilation reconnects, L4 replays, nothing is lost or doubled."""
    sides(SIDES[role], OTHER_SIDE[role])
    a, b = new_end("ours", mailbox_url), new_end("ours", mailbox_url)
    try:
        await connect_wormholes(a, b)
        start_dilation(a, relay_url, ping_interval=1.0)
        start_dilation(b, relay_url, ping_interval=1.0)
        await within(a.dw.when_dilated(), "our when_dilated()")
        await within(b.dw.when_dilated(), "the peer's when_dilated()")
        first_l2 = a.manager._l2
        replayed: list[int] = []
        use_connection = a.manager._outbound.use_connection

        def counting_use_connection() -> Any:
            records = use_connection()
            replayed.append(len(records))
            return records

        a.manager._outbound.use_connection = counting_use_connection

        def inject() -> None:
            l2 = b.manager._l2
            l2.transport.write(INJECTIONS[injection](l2))

        await streams_survive(a, b, inject)
        # Our first batch was in flight when we dropped the connection (its ACKs
        # come after the garbage in the peer's stream), so it was replayed.
        assert replayed and replayed[0] > 0, replayed
        # The victim dropped the connection with a reason, then both reconnected.
        assert a.manager._l2 is not first_l2
        assert a.dw.status().generation >= 1 and b.dw.status().generation >= 1
        assert a.dw.status().state == "CONNECTED"
        reasons = {
            "unknown-tag": "unknown record type 0x09",
            "malformed-ack": "ACK record of 3 bytes",
            "forged": "failed Noise authentication",
        }
        assert logged(logs, "dilation ", reasons[injection])
        # Everything was ACKed in the end: nothing stays queued.
        await until(lambda: a.manager._outbound.queued_records == 0, "our queue to drain")
        await until(lambda: b.manager._outbound.queued_records == 0, "the peer's queue to drain")
        await transfer_works(a, b, "after-garbage")
    finally:
        await close_all(a, b)


@pytest.mark.parametrize("role", ["leader", "follower"])
@reactor_test(timeout=120)
async def test_reference_drops_garbage_and_reconnects_with_us(role, sides, mailbox_url, relay_url):
    """The other way round: we put an unknown record on the wire to the reference.
    It drops the connection (its parse_record raises), and the two of us reconnect
    and replay without loss or duplication."""
    sides(SIDES[role])
    a, b = new_end("ours", mailbox_url), new_end("ref", mailbox_url)
    try:
        await connect_wormholes(a, b)
        start_dilation(a, relay_url, ping_interval=1.0)
        start_dilation(b, relay_url, ping_interval=1.0)
        await within(a.dw.when_dilated(), "our when_dilated()")
        await within(b.dw.when_dilated(), "the reference's when_dilated()")
        first_l2 = a.manager._l2

        def inject() -> None:
            l2 = a.manager._l2
            l2.transport.write(unknown_tag(l2))

        await streams_survive(a, b, inject)
        assert a.manager._l2 is not first_l2
        assert a.dw.status().generation >= 1 and a.dw.status().state == "CONNECTED"
        await until(lambda: a.manager._outbound.queued_records == 0, "our queue to drain")
    finally:
        await close_all(a, b)


# --- OPENs nobody listens for ---------------------------------------------------------------------


@pytest.mark.parametrize("role", ["leader", "follower"])
@reactor_test(timeout=120)
async def test_reference_opens_unknown_subprotocol(role, sides, logs, mailbox_url, relay_url):
    sides(SIDES[role])
    a, b = new_end("ours", mailbox_url), new_end("ref", mailbox_url)
    try:
        await connect_wormholes(a, b)
        start_dilation(a, relay_url)
        start_dilation(b, relay_url)
        on_a = ChanFactory(outgoing=(b"welcome",))
        listening = a.dw.listener_for("echo").listen(on_a)
        await within(a.dw.when_dilated(), "our when_dilated()")
        await within(b.dw.when_dilated(), "the reference's when_dilated()")
        await within(listening, "listen")

        # A working subchannel first.
        good = await within(b.dw.connector_for("echo").connect(ChanFactory((b"one",))), "connect")
        await until(lambda: len(on_a.built) == 1 and on_a.built[0].received == [b"one"], "one")
        await until(lambda: good.received == [b"welcome"], "welcome")

        # The reference opens a name we do not listen for, and writes on it
        # (5 MiB: more than we would ever hold for a listener).
        junk = [os.urandom(1024 * 1024) for _ in range(5)]
        bad_factory = ChanFactory(outgoing=tuple(junk))
        bad = await within(b.dw.connector_for("nobody-listens").connect(bad_factory), "connect")
        await within(bad.lost, "the reference's connectionLost on the refused subchannel")
        lines = logged(logs, "nobody-listens", "no listener")
        assert lines, [r.getMessage() for r in logs.records]
        assert bad.received == []
        # Nothing held for it, and it never became a subchannel of ours.
        assert a.manager._table.status().pending_bytes == 0
        assert len(on_a.built) == 1
        assert "nobody-listens" not in a.dw.status().subchannels

        # The first subchannel still works, both ways, and new ones too.
        good.transport.write(b"two")
        on_a.built[0].transport.write(b"still here")
        await until(lambda: on_a.built[0].received == [b"one", b"two"], "two")
        await until(lambda: good.received == [b"welcome", b"still here"], "still here")
        again = await within(b.dw.connector_for("echo").connect(ChanFactory((b"3",))), "connect")
        await until(lambda: len(on_a.built) == 2 and on_a.built[1].received == [b"3"], "3")
        await until(lambda: again.received == [b"welcome"], "welcome again")
        assert a.dw.status().state == "CONNECTED" and a.dw.status().generation == 0
        for proto in (good, again):
            proto.transport.loseConnection()
        for proto in (good, again, *on_a.built):
            await within(proto.lost, "connectionLost")
    finally:
        await close_all(a, b)


@reactor_test(timeout=120)
async def test_expected_subprotocol_is_held_within_a_bound(sides, logs, mailbox_url, relay_url):
    """An OPEN for an expected name waits for its listener, with its DATA, but only
    up to the bound: a peer that floods a name we never listen for is refused."""
    sides(LEADER_SIDE)
    a, b = new_end("ours", mailbox_url), new_end("ref", mailbox_url)
    try:
        await connect_wormholes(a, b)
        start_dilation(a, relay_url, expected_subprotocols=("later", "flood"))
        start_dilation(b, relay_url)
        await within(a.dw.when_dilated(), "our when_dilated()")
        await within(b.dw.when_dilated(), "the reference's when_dilated()")

        early = await within(
            b.dw.connector_for("later").connect(ChanFactory((b"early-1", b"early-2"))), "connect"
        )
        big = DEFAULT_MAX_PENDING_BYTES // 4
        flood_msgs = tuple(os.urandom(big) for _ in range(5))  # > the bound in total
        flood = await within(b.dw.connector_for("flood").connect(ChanFactory(flood_msgs)), "open")
        await within(flood.lost, "the flood subchannel to be refused")
        assert logged(logs, "flood", "bytes are waiting for listeners")
        await until(lambda: a.manager._table.status().pending_bytes > 0, "the held OPEN")
        assert a.manager._table.status().pending_bytes < DEFAULT_MAX_PENDING_BYTES

        on_a = ChanFactory(outgoing=(b"hello late",))
        await within(a.dw.listener_for("later").listen(on_a), "listen")
        await until(lambda: len(on_a.built) == 1, "the held subchannel")
        assert on_a.built[0].received == [b"early-1", b"early-2"]
        await until(lambda: early.received == [b"hello late"], "the answer")
        assert a.manager._table.status().pending_bytes == 0
        early.transport.loseConnection()
        await within(on_a.built[0].lost, "connectionLost")
    finally:
        await close_all(a, b)
