"""Dilation end to end: ours against the reference 0.24 and against ourselves.

Real mailbox server and transit relay (the session's ``wormhole_servers``),
everything on loopback, every body on the shared crochet reactor. Roles are
forced by patching our Dilation side: "f"*16 is larger than any side the
reference can pick (Leader), "0"*16 smaller (Follower).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import wormhole as ref  # the reference implementation: a test-only interop peer
from reactor_helpers import failure_of, reactor, reactor_test, sleep
from twisted.internet import defer, protocol

from spark_dilation.dilation import DilationFailed, DilationStatus, dilate, l1
from spark_dilation.wormhole import Wormhole

APPID = "spark-dilation.test/dilation-interop"
LEADER_SIDE = "f" * 16
FOLLOWER_SIDE = "0" * 16
LOOPBACK = ["127.0.0.1"]
# The sizes of the messages each end writes on a subchannel: tiny, exactly one
# Noise message, just over it (two pieces in one frame), and several pieces.
SIZES = (1, 100, 65510, 65511, 65519, 65520, 200_000, 7)


# --- bounded waiting --------------------------------------------------------------


async def until(cond: Callable[[], Any], what: str, timeout: float = 30.0) -> None:
    """Poll ``cond`` on the reactor until it is true; fail (not hang) after ``timeout``."""
    step = 0.02
    waited = 0.0
    while not cond():
        if waited >= timeout:
            raise AssertionError(f"timed out waiting for {what}")
        await sleep(step)
        waited += step


async def within(d: Any, what: str, timeout: float = 30.0) -> Any:
    """``await d`` (a Deferred or coroutine) but fail after ``timeout`` seconds, not hang."""
    d = defer.ensureDeferred(d)
    d.addTimeout(timeout, reactor())
    try:
        return await d
    except defer.TimeoutError:
        raise AssertionError(f"timed out waiting for {what}") from None


async def failure_within(d: Any, what: str, timeout: float = 30.0) -> BaseException:
    """The exception ``d`` fails with; fail the test if it succeeds or hangs."""
    d = defer.ensureDeferred(d)
    d.addTimeout(timeout, reactor())
    err = await failure_of(d)
    if isinstance(err, defer.TimeoutError):
        raise AssertionError(f"timed out waiting for {what}")
    return err


# --- subchannel protocols -------------------------------------------------------------


class Chan(protocol.Protocol):
    """Records every ``dataReceived`` call as one message; writes ``outgoing`` on connect."""

    outgoing: tuple[bytes, ...] = ()

    def __init__(self) -> None:
        self.received: list[bytes] = []
        self.lost: defer.Deferred = defer.Deferred()
        self.lost_count = 0

    def connectionMade(self) -> None:
        for message in getattr(self.factory, "outgoing", ()):
            self.transport.write(message)

    def dataReceived(self, data: bytes) -> None:
        self.received.append(bytes(data))

    def connectionLost(self, reason: Any = None) -> None:
        self.lost_count += 1
        self.lost_reason = reason
        if not self.lost.called:
            self.lost.callback(None)


class ChanFactory(protocol.Factory):
    protocol = Chan

    def __init__(self, outgoing: tuple[bytes, ...] = ()) -> None:
        self.outgoing = outgoing
        self.built: list[Chan] = []

    def buildProtocol(self, addr: Any) -> Chan:
        p = super().buildProtocol(addr)
        self.built.append(p)
        return p


def messages(seed: int) -> tuple[bytes, ...]:
    """Distinct random messages (the seed makes them distinct between channels)."""
    return tuple(bytes([seed % 256]) + os.urandom(size - 1) for size in SIZES)


def digest(msgs: list[bytes] | tuple[bytes, ...]) -> str:
    h = hashlib.sha256()
    for m in msgs:
        h.update(len(m).to_bytes(8, "big"))
        h.update(m)
    return h.hexdigest()


# --- the two ends ---------------------------------------------------------------------


@dataclass
class End:
    """One end of a dilated wormhole: ours or the reference's."""

    kind: str  # "ours" or "ref"
    w: Any
    dw: Any = None
    statuses: list[DilationStatus] = field(default_factory=list)

    @property
    def manager(self) -> Any:
        assert self.kind == "ours"
        return self.dw._manager


def new_end(kind: str, mailbox_url: str, *, dilation: bool = True) -> End:
    if kind == "ours":
        return End(kind, Wormhole(APPID, mailbox_url, reactor(), dilation=dilation))
    return End(kind, ref.create(APPID, mailbox_url, reactor(), dilation=dilation))


def start_dilation(
    end: End,
    relay_url: str | None,
    *,
    no_listen: bool = False,
    ping_interval: float | None = None,
    expected_subprotocols: tuple[str, ...] = (),
) -> Any:
    if end.kind == "ours":
        end.dw = dilate(
            end.w,
            relay_url=relay_url,
            no_listen=no_listen,
            listen_addresses=LOOPBACK,
            ping_interval=ping_interval,
            expected_subprotocols=expected_subprotocols,
            on_status=end.statuses.append,
        )
    else:
        end.dw = end.w.dilate(
            transit_relay_location=relay_url, no_listen=no_listen, ping_interval=ping_interval
        )
    return end.dw


async def connect_wormholes(a: End, b: End) -> None:
    """a allocates a code, b uses it."""
    a.w.allocate_code()
    code = await within(a.w.get_code(), "a code")
    b.w.set_code(code)


async def close_all(*ends: End) -> None:
    """Close every wormhole (and with it Dilation); errors are not this test's business."""
    await defer.DeferredList([defer.maybeDeferred(e.w.close) for e in ends], consumeErrors=True)
    # Let aborted connections and cancelled timers settle before the next test.
    await sleep(0.1)


@pytest.fixture
def sides(monkeypatch: pytest.MonkeyPatch) -> Callable[..., None]:
    """``sides("f"*16, ...)``: the Dilation sides our next managers get, in order."""

    def force(*values: str) -> None:
        it: Iterator[str] = iter(values)
        monkeypatch.setattr(l1, "make_side", lambda: next(it))

    return force


# Who is where: (our role, peer kind). "ours-ours" makes a the Leader.
PAIRS = {
    "ours-leader-vs-ref": ("ref", LEADER_SIDE),
    "ours-follower-vs-ref": ("ref", FOLLOWER_SIDE),
    "ours-vs-ours": ("ours", None),
}


async def dilated_pair(
    pair: str,
    sides: Callable[..., None],
    mailbox_url: str,
    relay_url: str | None,
    *,
    ours_no_listen: bool = False,
    peer_no_listen: bool = False,
    listeners: dict[str, tuple[ChanFactory, ChanFactory]] | None = None,
    ping_interval: float | None = None,
) -> tuple[End, End]:
    """Two dilated ends; ``listeners`` maps a name to (factory on ours, factory on peer).

    Listeners are registered before dilation completes (``listen()`` waits for
    it), so a subchannel the peer opens at once always finds them.
    """
    peer_kind, our_side = PAIRS[pair]
    if peer_kind == "ours":
        sides(LEADER_SIDE, FOLLOWER_SIDE)
    else:
        sides(our_side)
    a = new_end("ours", mailbox_url)
    b = new_end(peer_kind, mailbox_url)
    await connect_wormholes(a, b)
    start_dilation(a, relay_url, no_listen=ours_no_listen, ping_interval=ping_interval)
    start_dilation(b, relay_url, no_listen=peer_no_listen, ping_interval=ping_interval)
    listening = []
    for name, (fa, fb) in (listeners or {}).items():
        listening.append(a.dw.listener_for(f"{name}@ours").listen(fa))
        listening.append(b.dw.listener_for(f"{name}@peer").listen(fb))
    await within(a.dw.when_dilated(), "our when_dilated()")
    await within(b.dw.when_dilated(), "the peer's when_dilated()")
    await within(defer.gatherResults(listening, consumeErrors=True), "listeners")
    return a, b


def our_role(pair: str) -> str:
    return "follower" if PAIRS[pair][1] == FOLLOWER_SIDE else "leader"


# --- subchannels ------------------------------------------------------------------------


@pytest.mark.parametrize("pair", list(PAIRS))
@reactor_test(timeout=120)
async def test_subchannels_both_ways(pair, sides, mailbox_url, relay_url):
    """Several subchannels opened from each side at once, data both ways on each,
    boundaries and content intact, closed from either side with connectionLost on both."""
    n = 3
    # Each factory answers every subchannel it accepts with these messages.
    accepted_msgs = {"ours": messages(200), "peer": messages(201)}
    on_ours = ChanFactory(outgoing=accepted_msgs["ours"])
    on_peer = ChanFactory(outgoing=accepted_msgs["peer"])
    a, b = await dilated_pair(
        pair, sides, mailbox_url, relay_url, listeners={"echo": (on_ours, on_peer)}
    )
    try:
        st = a.dw.status()
        assert st.role == our_role(pair)
        assert st.state == "CONNECTED"
        assert st.generation == 0

        # (opener protocol, what it sent, accepter factory, what the accepter sent)
        channels = []
        for i in range(n):
            out = messages(i)
            cf = ChanFactory(outgoing=out)
            p = await within(a.dw.connector_for("echo@peer").connect(cf), "connect to peer")
            channels.append(("ours->peer", p, out, on_peer, accepted_msgs["peer"]))
        for i in range(n):
            out = messages(100 + i)
            cf = ChanFactory(outgoing=out)
            p = await within(b.dw.connector_for("echo@ours").connect(cf), "connect to ours")
            channels.append(("peer->ours", p, out, on_ours, accepted_msgs["ours"]))

        await until(lambda: len(on_peer.built) == n and len(on_ours.built) == n, "all OPENs")
        pairs_of_protocols = []
        for k, (label, opener, sent, factory, answered) in enumerate(channels):
            accepter = factory.built[k % n]
            pairs_of_protocols.append((label, opener, sent, accepter, answered))

        for label, opener, sent, accepter, answered in pairs_of_protocols:
            await until(
                lambda o=opener, s=sent, ac=accepter, an=answered: (
                    len(ac.received) >= len(s) and len(o.received) >= len(an)
                ),
                f"{label} data",
            )
        for label, opener, sent, accepter, answered in pairs_of_protocols:
            # One write() == one dataReceived(), in order, nothing extra.
            assert [len(m) for m in accepter.received] == [len(m) for m in sent], label
            assert digest(accepter.received) == digest(sent), label
            assert accepter.received == list(sent), label
            assert [len(m) for m in opener.received] == [len(m) for m in answered], label
            assert digest(opener.received) == digest(answered), label

        # Close: half of the subchannels from the opener, half from the accepter.
        for k, (_label, opener, _s, accepter, _a) in enumerate(pairs_of_protocols):
            closer = opener if k % 2 == 0 else accepter
            closer.transport.loseConnection()
        for label, opener, _s, accepter, _a in pairs_of_protocols:
            await within(opener.lost, f"{label} opener connectionLost")
            await within(accepter.lost, f"{label} accepter connectionLost")
        await sleep(0.2)
        for label, opener, _s, accepter, _a in pairs_of_protocols:
            assert opener.lost_count == 1 and accepter.lost_count == 1, label

        # The connection carries on: a fresh subchannel after all those closes.
        cf = ChanFactory(outgoing=(b"after", b"the closes"))
        p = await within(a.dw.connector_for("echo@peer").connect(cf), "connect again")
        await until(lambda: len(on_peer.built) == n + 1, "the late OPEN")
        late = on_peer.built[n]
        await until(lambda: late.received == [b"after", b"the closes"], "late data")
        await until(lambda: p.received == list(accepted_msgs["peer"]), "late answer")
        st = a.dw.status()
        assert st.state == "CONNECTED" and st.generation == 0
        # Everything we sent was ACKed: nothing stays queued in L4.
        await until(lambda: a.manager._outbound.queued_records == 0, "our L4 queue to drain")
    finally:
        await close_all(a, b)


# --- paths: direct, relay, both, one side not listening ----------------------------------

PATHS = {
    # name: (relay given, ours no_listen, peer no_listen, expected path or None for either)
    "direct-only": (False, False, False, "direct"),
    "relay-only": (True, True, True, "relay"),
    "both-offered": (True, False, False, None),
    "ours-no-listen": (True, True, False, None),
    "peer-no-listen": (True, False, True, None),
}


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("pair", list(PAIRS))
@reactor_test(timeout=120)
async def test_paths(pair, path, sides, mailbox_url, relay_url):
    with_relay, ours_no_listen, peer_no_listen, expected = PATHS[path]
    on_ours, on_peer = ChanFactory(), ChanFactory()
    a, b = await dilated_pair(
        pair,
        sides,
        mailbox_url,
        relay_url if with_relay else None,
        ours_no_listen=ours_no_listen,
        peer_no_listen=peer_no_listen,
        listeners={"p": (on_ours, on_peer)},
    )
    try:
        st = a.dw.status()
        assert st.state == "CONNECTED"
        assert st.connection is not None
        kind = st.connection.split()[0]
        assert kind in ("direct", "relay"), st.connection
        if expected is not None:
            assert kind == expected, st.connection
        elif our_role(pair) == "leader" and not (ours_no_listen and peer_no_listen):
            # Our Leader prefers a direct path when one exists (DESIGN: past the reference).
            assert kind == "direct", st.connection
        # Every hint of this generation: our direct one unless no_listen, the relay if given.
        types = sorted(h["type"] for h in st.hints_sent)
        want = ([] if ours_no_listen else ["direct-tcp-v1"]) + (["relay-v1"] if with_relay else [])
        assert types == want, st.hints_sent
        for h in st.hints_sent:
            if h["type"] == "direct-tcp-v1":
                assert h["hostname"] == "127.0.0.1" and h["port"] > 0, h

        out, back = messages(1), messages(2)
        p = await within(a.dw.connector_for("p@peer").connect(ChanFactory(out)), "connect")
        q = await within(b.dw.connector_for("p@ours").connect(ChanFactory(back)), "connect")
        await until(lambda: len(on_peer.built) == 1 and len(on_ours.built) == 1, "OPENs")
        await until(lambda: on_peer.built[0].received == list(out), "ours->peer data")
        await until(lambda: on_ours.built[0].received == list(back), "peer->ours data")
        p.transport.loseConnection()
        q.transport.loseConnection()
        for proto in (p, q, on_peer.built[0], on_ours.built[0]):
            await within(proto.lost, "connectionLost")
    finally:
        await close_all(a, b)


# --- a peer that cannot dilate ------------------------------------------------------------


@pytest.mark.parametrize("peer_kind", ["ref", "ours"])
@reactor_test(timeout=60)
async def test_peer_without_dilation_fails_when_dilated(peer_kind, mailbox_url, relay_url):
    a = new_end("ours", mailbox_url)
    b = new_end(peer_kind, mailbox_url, dilation=False)
    try:
        await connect_wormholes(a, b)
        dw = start_dilation(a, relay_url)
        err = await failure_within(dw.when_dilated(), "when_dilated() to fail")
        assert isinstance(err, DilationFailed), repr(err)
        assert "cannot dilate" in str(err)
        # Asking again after the failure must fail too, not hang.
        err2 = await failure_within(dw.when_dilated(), "a second when_dilated() to fail")
        assert isinstance(err2, DilationFailed), repr(err2)
        # So do endpoints, which wait for dilation.
        err3 = await failure_within(
            dw.connector_for("x").connect(ChanFactory()), "connect() to fail"
        )
        assert isinstance(err3, DilationFailed), repr(err3)
        err4 = await failure_within(dw.listener_for("x").listen(ChanFactory()), "listen() to fail")
        assert isinstance(err4, DilationFailed), repr(err4)
        st = dw.status()
        assert st.state != "CONNECTED" and st.connection is None
        # The wormhole itself still works (messages), only Dilation is refused.
        a.w.send_message(b"still here")
        assert await within(b.w.get_message(), "a message") == b"still here"
    finally:
        await close_all(a, b)


@reactor_test(timeout=60)
async def test_reference_that_never_calls_dilate_leaves_us_waiting(mailbox_url, relay_url):
    """The reference says "please" only once its app calls dilate(). Until then
    there is nothing to fail on: when_dilated() stays pending (bounded wait here)."""
    a = new_end("ours", mailbox_url)
    b = new_end("ref", mailbox_url, dilation=True)
    try:
        await connect_wormholes(a, b)
        dw = start_dilation(a, relay_url)
        d = dw.when_dilated()
        await within(b.w.get_verifier(), "the key")
        await sleep(2.0)
        assert not d.called
        st = dw.status()
        assert st.state == "WANTING" and st.generation == -1 and st.role is None
        # Once the peer does dilate, the pending when_dilated() fires.
        start_dilation(b, relay_url)
        await within(d, "when_dilated() after the peer's please")
        assert dw.status().state == "CONNECTED"
    finally:
        await close_all(a, b)


@pytest.mark.parametrize("peer_kind", ["ref", "ours"])
@reactor_test(timeout=60)
async def test_we_dilate_after_the_peer_said_please(peer_kind, mailbox_url, relay_url):
    """Our app calls dilate() only after the peer's "please" has already arrived
    (it waits in the wormhole until then). It must still be used, not dropped."""
    a = new_end("ours", mailbox_url)
    b = new_end(peer_kind, mailbox_url)
    try:
        await connect_wormholes(a, b)
        await within(a.w.get_verifier(), "the key")
        start_dilation(b, relay_url)
        await until(lambda: a.w._dilate_records._items, "the peer's please to be waiting")
        dw = start_dilation(a, relay_url)
        await within(dw.when_dilated(), "our when_dilated()")
        await within(b.dw.when_dilated(), "the peer's when_dilated()")
        assert dw.status().state == "CONNECTED"
    finally:
        await close_all(a, b)


# --- status updates -------------------------------------------------------------------------


@pytest.mark.parametrize("pair", list(PAIRS))
@reactor_test(timeout=60)
async def test_status_updates(pair, sides, mailbox_url, relay_url):
    a, b = await dilated_pair(pair, sides, mailbox_url, relay_url)
    try:
        statuses = list(a.statuses)
        assert statuses, "on_status was never called"
        assert all(isinstance(s, DilationStatus) for s in statuses)
        connected = [s for s in statuses if s.state == "CONNECTED"]
        assert connected, [s.state for s in statuses]
        s = connected[0]
        assert s.role == our_role(pair)
        assert s.generation == 0
        assert s.connection is not None and s.connection.split()[0] in ("direct", "relay")
        # Before: no role, then a role while connecting.
        assert statuses[0].state in ("WAITING", "WANTING")
        assert any(x.state == "CONNECTING" and x.role == our_role(pair) for x in statuses)
        # Snapshots, not one shared mutable object.
        assert statuses[0] is not statuses[-1]
        assert statuses[0].state != "CONNECTED"
        # A subchannel shows up in the status.
        f = ChanFactory()
        b.dw.listener_for("status-proto").listen(f)
        await sleep(0.2)
        await within(a.dw.connector_for("status-proto").connect(ChanFactory()), "connect")
        assert "status-proto" in a.statuses[-1].subchannels
    finally:
        await close_all(a, b)
