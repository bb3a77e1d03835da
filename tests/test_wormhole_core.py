"""Unit tests of the sans-IO wormhole core: frames in, events out, no I/O.

A tiny in-memory stand-in for the mailbox server routes frames between two
cores; it implements only what these tests need. Interop with the real
server and the reference client lives in test_wormhole_interop.py.
"""

from __future__ import annotations

import json

import pytest

from spark_dilation.errors import (
    CodeFormatError,
    CrowdedError,
    LonelyError,
    OnlyOneCodeError,
    ServerError,
    WelcomeError,
    WormholeClosedError,
    WormholeError,
    WrongCodeError,
)
from spark_dilation.wormhole import core
from spark_dilation.wormhole.keys import derive_phase_key, encrypt_data

APPID = "example.com/test"


def frames(events: list[core.Event]) -> list[dict]:
    return [json.loads(e.payload) for e in events if isinstance(e, core.SendFrame)]


def of_type(events: list[core.Event], kind: type) -> list:
    return [e for e in events if isinstance(e, kind)]


def server_msg(mtype: str, **fields) -> bytes:
    return json.dumps({"type": mtype, **fields}).encode()


class FakeMailbox:
    """Routes frames between cores like the real server does (only the parts we use)."""

    def __init__(self) -> None:
        self.nameplates: dict[str, str] = {}
        self.claims: dict[str, set[str]] = {}
        self.mailboxes: dict[str, list[dict]] = {}
        self.listeners: dict[str, list[Peer]] = {}
        self.log: list[tuple[str, dict]] = []

    def handle(self, peer: Peer, msg: dict) -> None:
        self.log.append((peer.core.side, msg))
        t = msg["type"]
        if t == "allocate":
            n = str(len(self.nameplates) + 1)
            self.nameplates[n] = f"mb{n}"
            peer.deliver(server_msg("allocated", nameplate=n))
        elif t == "claim":
            n = msg["nameplate"]
            sides = self.claims.setdefault(n, set())
            sides.add(peer.core.side)
            if len(sides) > 2:
                peer.deliver(server_msg("error", error="crowded", orig=msg))
                return
            mailbox = self.nameplates.setdefault(n, f"mb{n}")
            peer.deliver(server_msg("claimed", mailbox=mailbox))
        elif t == "release":
            peer.deliver(server_msg("released"))
        elif t == "open":
            mb = msg["mailbox"]
            self.listeners.setdefault(mb, []).append(peer)
            peer.mailbox = mb
            for m in list(self.mailboxes.get(mb, [])):
                peer.deliver(server_msg("message", **m))
        elif t == "add":
            m = {"side": peer.core.side, "phase": msg["phase"], "body": msg["body"]}
            self.mailboxes.setdefault(peer.mailbox, []).append(m)
            for listener in self.listeners.get(peer.mailbox, []):
                if listener.connected:
                    listener.deliver(server_msg("message", **m))
        elif t == "close":
            peer.deliver(server_msg("closed"))
        elif t == "list":
            ids = [{"id": n} for n in sorted(self.nameplates)]
            peer.deliver(server_msg("nameplates", nameplates=ids))
        elif t == "ping":
            peer.deliver(server_msg("pong", pong=msg["ping"]))


class Peer:
    def __init__(self, server: FakeMailbox, **kwargs) -> None:
        self.server = server
        self.core = core.WormholeCore(APPID, **kwargs)
        self.events: list[core.Event] = []
        self.inbox: list[bytes] = []
        self.connected = False
        self.mailbox: str | None = None

    def deliver(self, payload: bytes) -> None:
        self.inbox.append(payload)

    def feed(self, events: list[core.Event]) -> None:
        for e in events:
            if isinstance(e, core.SendFrame):
                assert self.connected
                self.server.handle(self, json.loads(e.payload))
            else:
                self.events.append(e)

    def connect(self) -> None:
        self.connected = True
        self.inbox.append(server_msg("welcome", welcome={"motd": "hi"}))
        self.feed(self.core.connection_made())

    def disconnect(self) -> None:
        self.connected = False
        self.inbox.clear()
        for listeners in self.server.listeners.values():
            if self in listeners:
                listeners.remove(self)
        self.feed(self.core.connection_lost())

    def pump(self) -> bool:
        moved = False
        while self.inbox and self.connected:
            moved = True
            self.feed(self.core.frame_received(self.inbox.pop(0)))
        return moved

    def got(self, kind: type) -> list:
        return of_type(self.events, kind)


def run(*peers: Peer) -> None:
    for _ in range(200):
        if not any([p.pump() for p in peers]):
            return
    raise AssertionError("the exchange did not settle")


@pytest.fixture
def server() -> FakeMailbox:
    return FakeMailbox()


def pair(server: FakeMailbox, code_b: str | None = None) -> tuple[Peer, Peer]:
    a, b = Peer(server), Peer(server)
    a.connect()
    a.feed(a.core.allocate_code(2))
    run(a)
    (code,) = [e.code for e in a.got(core.GotCode)]
    b.connect()
    b.feed(b.core.set_code(code_b or code))
    run(a, b)
    return a, b


def test_bind_is_first_and_carries_appid_side_and_client_version(server):
    a = Peer(server)
    sent = frames(a.core.connection_made())
    assert sent[0]["type"] == "bind"
    assert sent[0]["appid"] == APPID
    assert sent[0]["side"] == a.core.side and len(a.core.side) == 10
    assert sent[0]["client_version"][0] == "spark-dilation"
    assert all(len(f["id"]) == 4 for f in sent)


def test_happy_exchange_in_order_with_matching_verifiers(server):
    a, b = pair(server)
    assert a.got(core.GotWelcome)[0].welcome == {"motd": "hi"}
    (va,), (vb,) = a.got(core.GotVerifier), b.got(core.GotVerifier)
    assert va.verifier == vb.verifier and len(va.verifier) == 32
    assert a.core.key == b.core.key
    for i in range(3):
        a.feed(a.core.send_message(b"a%d" % i))
    b.feed(b.core.send_message(b"from b"))
    run(a, b)
    assert [m.plaintext for m in b.got(core.GotMessage)] == [b"a0", b"a1", b"a2"]
    assert [m.plaintext for m in a.got(core.GotMessage)] == [b"from b"]
    assert a.got(core.GotVersions)[0].app_versions == {}


def test_nameplate_released_once_the_peer_arrives(server):
    a, b = pair(server)
    releases = [s for s, m in server.log if m["type"] == "release"]
    assert sorted(releases) == sorted([a.core.side, b.core.side])


def test_versions_and_app_versions_reach_the_peer(server):
    a = Peer(server, versions={"can-dilate": ["ged"], "app_versions": {"x": 1}})
    b = Peer(server)
    a.connect()
    a.feed(a.core.set_code("5-foo-bar"))
    b.connect()
    b.feed(b.core.set_code("5-foo-bar"))
    run(a, b)
    got = b.got(core.GotVersions)[0]
    assert got.versions["can-dilate"] == ["ged"]
    assert got.app_versions == {"x": 1}


def test_wrong_code_both_sides_learn_and_close_scary(server):
    a, b = Peer(server), Peer(server)
    a.connect()
    a.feed(a.core.set_code("3-right-code"))
    b.connect()
    b.feed(b.core.set_code("3-wrong-code"))
    run(a, b)
    for p in (a, b):
        (closed,) = p.got(core.Closed)
        assert isinstance(closed.error, WrongCodeError)
        assert "mistyped" in str(closed.error)
        assert not p.got(core.GotVerifier)
        assert p.got(core.StopConnection)
    moods = [m["mood"] for _, m in server.log if m["type"] == "close"]
    assert moods == ["scary", "scary"]


def test_messages_sent_before_confirmation_wait_for_it(server):
    a = Peer(server)
    a.connect()
    a.feed(a.core.set_code("4-aa-bb"))
    a.feed(a.core.send_message(b"early"))
    run(a)
    added = [m["phase"] for s, m in server.log if m["type"] == "add"]
    assert added == ["pake"]  # nothing encrypted before the key is confirmed
    b = Peer(server)
    b.connect()
    b.feed(b.core.set_code("4-aa-bb"))
    run(a, b)
    assert [m.plaintext for m in b.got(core.GotMessage)] == [b"early"]


def test_reconnect_mid_session_resends_and_deduplicates(server):
    a, b = pair(server)
    # b drops before its message reaches the server; a sends while b is away.
    b.disconnect()
    b.feed(b.core.send_message(b"while offline"))
    a.feed(a.core.send_message(b"to the absent"))
    run(a)
    assert not b.got(core.GotMessage)
    b.connect()  # rebinds, reopens, replays the mailbox, resends pending
    run(a, b)
    assert [m.plaintext for m in b.got(core.GotMessage)] == [b"to the absent"]
    assert [m.plaintext for m in a.got(core.GotMessage)] == [b"while offline"]
    reopen = [m for s, m in server.log if s == b.core.side and m["type"] == "open"]
    assert len(reopen) == 2
    # Replayed phases (pake, version) were not processed twice.
    assert len(b.got(core.GotVerifier)) == 1 and len(b.got(core.GotVersions)) == 1


def test_reconnect_before_claim_answer_claims_again(server):
    a = Peer(server)
    a.connect()
    a.feed(a.core.set_code("9-foo-bar"))
    a.disconnect()  # the claim's answer is lost
    a.connect()
    run(a)
    claims = [m for s, m in server.log if m["type"] == "claim"]
    assert len(claims) == 2
    assert a.core.mailbox == "mb9"


def test_allocation_survives_a_reconnect(server):
    a = Peer(server)
    a.feed(a.core.allocate_code(3))  # not connected yet: allocate on connect
    a.connect()
    run(a)
    (got,) = a.got(core.GotCode)
    nameplate, *words = got.code.split("-")
    assert nameplate.isdigit() and len(words) == 3


def test_out_of_order_phases_are_delivered_in_order(server):
    a, b = pair(server)
    key = b.core.key
    for phase in ("2", "0", "1"):
        body = encrypt_data(derive_phase_key(key, a.core.side, phase), f"m{phase}".encode())
        b.feed(
            b.core.frame_received(
                server_msg("message", side=a.core.side, phase=phase, body=body.hex())
            )
        )
    assert [m.plaintext for m in b.got(core.GotMessage)] == [b"m0", b"m1", b"m2"]


def test_dilate_phases_have_their_own_order(server):
    a, b = pair(server)
    a.feed(a.core.send_dilate(b'{"type": "please"}'))
    a.feed(a.core.send_message(b"app"))
    a.feed(a.core.send_dilate(b'{"type": "connection-hints"}'))
    run(a, b)
    phases = [m["phase"] for s, m in server.log if s == a.core.side and m["type"] == "add"]
    assert phases == ["pake", "version", "dilate-0", "0", "dilate-1"]
    assert [d.plaintext for d in b.got(core.GotDilate)] == [
        b'{"type": "please"}',
        b'{"type": "connection-hints"}',
    ]


def test_tampered_message_is_a_wrong_code(server):
    a, b = pair(server)
    b.feed(
        b.core.frame_received(server_msg("message", side=a.core.side, phase="0", body=("00" * 40)))
    )
    (closed,) = b.got(core.Closed) or [None]
    assert closed is None  # waits for the server to confirm release/close
    run(b)
    (closed,) = b.got(core.Closed)
    assert isinstance(closed.error, WrongCodeError)


def test_malformed_pake_is_a_wrong_code(server):
    a = Peer(server)
    a.connect()
    a.feed(a.core.set_code("6-x-y"))
    run(a)
    bad = json.dumps({"not_pake": "00"}).encode()
    a.feed(
        a.core.frame_received(
            server_msg("message", side="eeeeeeeeee", phase="pake", body=bad.hex())
        )
    )
    run(a)
    assert isinstance(a.got(core.Closed)[0].error, WrongCodeError)


def test_reflected_pake_is_rejected(server):
    a = Peer(server)
    a.connect()
    a.feed(a.core.set_code("6-x-y"))
    run(a)
    own = next(m for s, m in server.log if m["type"] == "add" and m["phase"] == "pake")
    a.feed(
        a.core.frame_received(
            server_msg("message", side="ffffffffff", phase="pake", body=own["body"])
        )
    )
    run(a)
    assert isinstance(a.got(core.Closed)[0].error, WrongCodeError)


def test_crowded_claim_gives_crowded_error(server):
    a, b = Peer(server), Peer(server)
    for p in (a, b):
        p.connect()
        p.feed(p.core.set_code("8-aa-bb"))
    c = Peer(server)
    c.connect()
    c.feed(c.core.set_code("8-aa-bb"))
    run(c)
    (closed,) = c.got(core.Closed)
    assert isinstance(closed.error, CrowdedError)
    assert "new code" in str(closed.error) and "8" in str(closed.error)
    # The server recorded c's side before refusing it: c gives it back, and has
    # no mailbox to close (tests/test_mailbox_harness.py shows it on the real server).
    sent = [m["type"] for s, m in server.log if s == c.core.side]
    assert sent == ["bind", "claim", "release"]


def test_crowded_claim_is_released_even_with_keep_nameplate(server):
    for _ in range(2):
        p = Peer(server)
        p.connect()
        p.feed(p.core.set_code("8-aa-bb"))
    c = Peer(server, keep_nameplate=True)
    c.connect()
    c.feed(c.core.set_code("8-aa-bb"))
    run(c)
    assert isinstance(c.got(core.Closed)[0].error, CrowdedError)
    assert [
        m["nameplate"] for s, m in server.log if s == c.core.side and m["type"] == "release"
    ] == ["8"]


def test_server_error_closes_errory():
    c = core.WormholeCore(APPID)
    c.connection_made()
    events = c.frame_received(server_msg("error", error="must bind first", orig={"type": "x"}))
    (closed,) = of_type(events, core.Closed)
    assert isinstance(closed.error, ServerError)
    assert "must bind first" in str(closed.error)


def test_welcome_error_closes_unwelcome():
    c = core.WormholeCore(APPID)
    c.connection_made()
    events = c.frame_received(server_msg("welcome", welcome={"error": "go away"}))
    (closed,) = of_type(events, core.Closed)
    assert isinstance(closed.error, WelcomeError) and "go away" in str(closed.error)


def test_welcome_is_reported_once_across_reconnects():
    c = core.WormholeCore(APPID)
    c.connection_made()
    first = c.frame_received(server_msg("welcome", welcome={}))
    c.connection_lost()
    c.connection_made()
    second = c.frame_received(server_msg("welcome", welcome={}))
    assert of_type(first, core.GotWelcome) and not of_type(second, core.GotWelcome)


@pytest.mark.parametrize(
    "payload",
    [b"not json", b"[1, 2]", b'{"no": "type"}', b'{"type": "message", "side": "x"}'],
)
def test_malformed_server_frames_fail_with_a_protocol_error(payload):
    c = core.WormholeCore(APPID)
    c.connection_made()
    (closed,) = of_type(c.frame_received(payload), core.Closed)
    assert isinstance(closed.error, WormholeError)
    assert "mailbox server" in str(closed.error)


def test_unknown_server_message_type_is_ignored():
    c = core.WormholeCore(APPID)
    c.connection_made()
    assert c.frame_received(server_msg("future-thing", x=1)) == []
    assert not c.closed


def test_close_before_a_peer_is_lonely(server):
    a = Peer(server)
    a.connect()
    a.feed(a.core.set_code("2-aa-bb"))
    run(a)
    a.feed(a.core.close())
    run(a)
    (closed,) = a.got(core.Closed)
    assert isinstance(closed.error, LonelyError)
    assert [m["mood"] for _, m in server.log if m["type"] == "close"] == ["lonely"]


def test_close_while_disconnected_finishes_after_reconnect(server):
    a, _b = pair(server)
    a.disconnect()
    a.feed(a.core.close())
    assert not a.got(core.Closed)
    a.connect()
    run(a)
    (closed,) = a.got(core.Closed)
    assert closed.error is None
    assert [m["mood"] for s, m in server.log if s == a.core.side and m["type"] == "close"] == [
        "happy"
    ]


def test_close_after_a_reconnect_still_delivers_unechoed_messages(server):
    a, b = pair(server)
    a.disconnect()
    a.feed(a.core.send_message(b"last words"))  # never reaches the server...
    a.feed(a.core.close())  # ...before the close, which waits for a connection
    a.connect()
    run(a, b)
    (closed,) = a.got(core.Closed)
    assert closed.error is None
    assert [m.plaintext for m in b.got(core.GotMessage)] == [b"last words"]
    sent = [m["type"] for s, m in server.log if s == a.core.side]
    assert sent.index("add", sent.index("bind", 2)) < sent.index("close")


def test_close_with_nothing_claimed_is_immediate():
    c = core.WormholeCore(APPID)
    events = c.close()
    assert of_type(events, core.Closed) and of_type(events, core.StopConnection)


def test_api_misuse_raises_typed_errors(server):
    c = core.WormholeCore(APPID)
    c.set_code("1-aa-bb")
    with pytest.raises(OnlyOneCodeError):
        c.allocate_code()
    with pytest.raises(OnlyOneCodeError):
        c.set_code("2-aa-bb")
    with pytest.raises(CodeFormatError):
        core.WormholeCore(APPID).set_code("7 guitarist revenge")
    c.close()
    with pytest.raises(WormholeClosedError):
        c.send_message(b"x")


def test_list_and_ping(server):
    a = Peer(server)
    a.feed(a.core.list_nameplates())  # before connecting: sent on connect
    a.connect()
    a.feed(a.core.ping(7))
    run(a)
    assert a.got(core.GotNameplates)[0].nameplates == ()
    assert a.got(core.GotPong)[0].ping == 7
