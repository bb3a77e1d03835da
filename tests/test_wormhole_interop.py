"""Our wormhole client against the real mailbox server and the reference 0.24 client."""

from __future__ import annotations

import json

import pytest
import wormhole as ref  # the reference implementation: a test-only interop peer
from autobahn.twisted.websocket import WebSocketClientFactory, WebSocketClientProtocol
from reactor_helpers import failure_of, reactor, reactor_test, sleep
from twisted.internet import defer, endpoints, protocol
from wormhole.errors import WrongPasswordError

from spark_dilation.errors import (
    CrowdedError,
    PeerTimeoutError,
    ServerConnectionError,
    WelcomeError,
    WrongCodeError,
)
from spark_dilation.wormhole import Wormhole
from spark_dilation.wormhole.blocking import BlockingWormhole, WormholeTimeout

APPID = "spark-dilation.test/interop"


def ours(url: str, **kwargs) -> Wormhole:
    return Wormhole(APPID, url, reactor(), **kwargs)


def reference(url: str, **kwargs):
    return ref.create(APPID, url, reactor(), **kwargs)


async def exchange(a, b) -> None:
    """Messages both ways, verifiers and derived keys agree."""
    va, vb = await a.get_verifier(), await b.get_verifier()
    assert va == vb
    a.send_message(b"one from a")
    a.send_message(b"two from a")
    b.send_message(b"from b")
    assert await b.get_message() == b"one from a"
    assert await b.get_message() == b"two from a"
    assert await a.get_message() == b"from b"
    assert a.derive_key("app/transit-key", 32) == b.derive_key("app/transit-key", 32)


@reactor_test()
async def test_reference_allocates_and_we_claim(mailbox_url):
    r = reference(mailbox_url, versions={"ref": "yes"})
    r.allocate_code()
    code = await r.get_code()
    w = ours(mailbox_url, app_versions={"ours": 1})
    w.set_code(code)
    await exchange(w, r)
    assert await w.get_versions() == {"ref": "yes"}
    assert await r.get_versions() == {"ours": 1}
    await defer.gatherResults([w.close(), r.close()])


@reactor_test()
async def test_we_allocate_and_reference_claims(mailbox_url):
    w = ours(mailbox_url)
    w.allocate_code(3)
    code = await w.get_code()
    assert len(code.split("-")) == 4
    r = reference(mailbox_url)
    r.set_code(code)
    await exchange(r, w)
    await defer.gatherResults([w.close(), r.close()])


@reactor_test()
async def test_dilation_capable_version_message_is_read_by_the_reference(mailbox_url):
    versions = {
        "can-dilate": ["ged"],
        "dilation-abilities": [{"type": "direct-tcp-v1"}, {"type": "relay-v1"}],
        "app_versions": {"v": 2},
    }
    w = ours(mailbox_url, versions=versions)
    w.allocate_code()
    r = reference(mailbox_url, dilation=True)
    r.set_code(await w.get_code())
    assert await r.get_versions() == {"v": 2}
    peer = await w.get_peer_versions()
    assert peer["can-dilate"] == ["ged"]
    await defer.gatherResults([w.close(), r.close()])


@pytest.mark.parametrize("wrong_side", ["ours", "reference"])
@reactor_test()
async def test_wrong_code_is_reported_on_both_sides(mailbox_url, wrong_side):
    w = ours(mailbox_url)
    r = reference(mailbox_url)
    if wrong_side == "ours":
        r.allocate_code()
        code = await r.get_code()
        w.set_code(code.split("-")[0] + "-not-it")
    else:
        w.allocate_code()
        code = await w.get_code()
        r.set_code(code.split("-")[0] + "-not-it")
    ours_error = await failure_of(w.get_verifier())
    ref_error = await failure_of(r.get_verifier())
    assert isinstance(ours_error, WrongCodeError)
    assert "mistyped" in str(ours_error)
    assert isinstance(ref_error, WrongPasswordError)
    assert isinstance(await failure_of(w.close()), WrongCodeError)
    assert isinstance(await failure_of(r.close()), WrongPasswordError)


@reactor_test(timeout=120)
async def test_mailbox_connection_dropped_mid_session_still_completes(wormhole_servers, tcp_proxy):
    proxy = tcp_proxy("127.0.0.1", wormhole_servers.mailbox_port)
    w = ours(proxy.url())
    w.allocate_code()
    code = await w.get_code()
    proxy.drop_connections()  # before the peer shows up
    r = reference(wormhole_servers.mailbox_url)
    r.set_code(code)
    r.send_message(b"sent while ours was away")
    assert await w.get_verifier() == await r.get_verifier()
    assert await w.get_message() == b"sent while ours was away"
    proxy.drop_connections()  # between two messages
    w.send_message(b"sent around a drop")
    proxy.drop_connections()
    assert await r.get_message() == b"sent around a drop"
    r.send_message(b"last")
    assert await w.get_message() == b"last"
    await defer.gatherResults([w.close(), r.close()])
    assert proxy.total_connections >= 3  # it really reconnected


@reactor_test(timeout=120)
async def test_mailbox_connection_dropped_during_close_still_closes(wormhole_servers, tcp_proxy):
    proxy = tcp_proxy("127.0.0.1", wormhole_servers.mailbox_port)
    w = ours(proxy.url())
    r = reference(wormhole_servers.mailbox_url)
    r.allocate_code()
    w.set_code(await r.get_code())
    await w.get_verifier()
    connections = proxy.total_connections
    proxy.freeze()  # the close request cannot reach the server...
    closing = w.close()
    await sleep(0.2)
    assert not closing.called  # held by the frozen path
    proxy.drop_connections()  # ...until the connection is replaced
    proxy.thaw()
    await closing
    # It closed over a new connection: ours reconnected and sent its close again.
    assert proxy.total_connections > connections
    # Our version may have been in flight when the proxy froze: it must still
    # reach the reference (resent on the new connection) before it closes,
    # else the reference's close would rightly report LonelyError.
    await r.get_versions()
    await r.close()


class _ClaimOnly(WebSocketClientProtocol):
    """A raw mailbox client that binds and claims a nameplate, nothing more."""

    def onOpen(self) -> None:
        f = self.factory
        self.sendMessage(json.dumps({"type": "bind", "appid": APPID, "side": f.side}).encode())
        self.sendMessage(json.dumps({"type": "claim", "nameplate": f.nameplate}).encode())

    def onMessage(self, payload, isBinary):
        if json.loads(payload)["type"] == "claimed" and not self.factory.claimed.called:
            self.factory.claimed.callback(self)


async def claim_only(port: int, nameplate: str, side: str) -> WebSocketClientProtocol:
    f = WebSocketClientFactory(f"ws://127.0.0.1:{port}/v1")
    f.protocol = _ClaimOnly
    f.side, f.nameplate, f.claimed = side, nameplate, defer.Deferred()
    await endpoints.TCP4ClientEndpoint(reactor(), "127.0.0.1", port).connect(f)
    return await f.claimed


@reactor_test()
async def test_third_client_on_a_nameplate_gets_crowded(wormhole_servers):
    holders = [
        await claim_only(wormhole_servers.mailbox_port, "4242", side)
        for side in ("aaaaaaaaaa", "bbbbbbbbbb")
    ]
    w = ours(wormhole_servers.mailbox_url)
    w.set_code("4242-crowded-out")
    error = await failure_of(w.get_verifier())
    assert isinstance(error, CrowdedError)
    assert "4242" in str(error) and "new code" in str(error)
    assert isinstance(await failure_of(w.close()), CrowdedError)
    for h in holders:
        h.transport.loseConnection()


@reactor_test()
async def test_peer_that_never_comes_times_out(mailbox_url):
    w = ours(mailbox_url, timeout=0.5)
    w.allocate_code()
    code = await w.get_code()
    error = await failure_of(w.get_verifier())
    assert isinstance(error, PeerTimeoutError)
    assert code in str(error)
    assert isinstance(await failure_of(w.close()), PeerTimeoutError)


@reactor_test()
async def test_unreachable_server_fails_fast_with_a_clear_error(tcp_proxy):
    proxy = tcp_proxy("127.0.0.1", 9)  # the proxy's port is free once it is closed
    url = proxy.url()
    proxy.close()
    w = ours(url)
    error = await failure_of(w.get_welcome())
    assert isinstance(error, ServerConnectionError)
    assert url in str(error) and "spark-dilation serve" in str(error)
    assert isinstance(await failure_of(w.get_code()), ServerConnectionError)


class _NotFound(protocol.Protocol):
    """An HTTP server that has no WebSocket to offer."""

    def dataReceived(self, data: bytes) -> None:
        self.transport.write(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")
        self.transport.loseConnection()


@reactor_test()
async def test_server_that_is_not_a_mailbox_fails_with_a_clear_error():
    factory = protocol.ServerFactory.forProtocol(_NotFound)
    port = await endpoints.TCP4ServerEndpoint(reactor(), 0, interface="127.0.0.1").listen(factory)
    try:
        w = ours(f"ws://127.0.0.1:{port.getHost().port}/v1")
        error = await failure_of(w.get_welcome())
        assert isinstance(error, ServerConnectionError)
    finally:
        await port.stopListening()


@pytest.mark.parametrize(
    "fresh_servers", [{"signal_error": "closed for maintenance"}], indirect=True
)
@reactor_test()
async def test_welcome_error_from_the_server(fresh_servers):
    w = ours(fresh_servers.mailbox_url)
    error = await failure_of(w.get_welcome())
    assert isinstance(error, WelcomeError)
    assert "closed for maintenance" in str(error)


@pytest.mark.parametrize("fresh_servers", [{"motd": "be excellent"}], indirect=True)
@reactor_test()
async def test_motd_and_nameplate_listing(fresh_servers):
    w = ours(fresh_servers.mailbox_url)
    assert (await w.get_welcome())["motd"] == "be excellent"
    w.allocate_code()
    nameplate = (await w.get_code()).split("-")[0]
    other = ours(fresh_servers.mailbox_url)
    assert nameplate in await other.list_nameplates()
    await other.ping()
    for x in (w, other):
        assert isinstance(await failure_of(x.close()), Exception)  # lonely


def test_blocking_facade_against_the_reference(mailbox_url):
    import crochet

    @crochet.wait_for(timeout=60)
    def in_reactor(fn):
        return defer.maybeDeferred(fn)

    with BlockingWormhole(APPID, mailbox_url, app_versions={"b": 1}, timeout=60) as w:
        code = w.allocate_code()
        r = in_reactor(lambda: reference(mailbox_url))
        in_reactor(lambda: r.set_code(code))
        assert w.get_verifier() == in_reactor(r.get_verifier)
        assert w.get_versions() == {}
        # A get that times out must not swallow the message that comes later.
        with pytest.raises(WormholeTimeout):
            w.get_message(timeout=0.1)
        in_reactor(lambda: r.send_message(b"to blocking"))
        assert w.get_message() == b"to blocking"
        w.send_message(b"from blocking")
        assert in_reactor(r.get_message) == b"from blocking"
        assert w.derive_key("x", 16) == in_reactor(lambda: r.derive_key("x", 16))
        in_reactor(r.close)
