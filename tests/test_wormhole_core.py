"""Unit tests of the sans-IO wormhole core: frames in, events out, no I/O.

Exchanges run against the real mailbox server code through the deterministic
harness in tests/mailbox_harness.py (the real ``wormhole_mailbox_server``
protocol and database in memory, a frame router instead of sockets, a fake
clock). Tests of the core alone feed it hand-made server frames. Interop with
the reference client lives in test_wormhole_interop.py; server scenarios
(crowded claims, the ghost rule, seeded interleavings) in
test_mailbox_harness.py.
"""

from __future__ import annotations

import json

import pytest
from mailbox_harness import UP, Client, Harness

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


def of_type(events: list[core.Event], kind: type) -> list:
    return [e for e in events if isinstance(e, kind)]


def server_msg(mtype: str, **fields) -> bytes:
    return json.dumps({"type": mtype, **fields}).encode()


@pytest.fixture
def h() -> Harness:
    return Harness(appid=APPID, motd="hi")


def sent(client: Client, mtype: str) -> list[dict]:
    """The frames of one type the server received from ``client``."""
    return [m for m in client.sent if m["type"] == mtype]


def replies(client: Client) -> list[str]:
    """The types of the frames the server sent ``client``, acks left out."""
    return [m["type"] for m in client.received if m["type"] != "ack"]


def plaintexts(client: Client, kind: type = core.GotMessage) -> list[bytes]:
    return [m.plaintext for m in client.got(kind)]


def pair(h: Harness) -> tuple[Client, Client]:
    """A allocates a code, B types it; both run until the server is quiet."""
    a = h.client("a")
    a.allocate_code(2)
    h.run_until_quiet()
    (code,) = [e.code for e in a.got(core.GotCode)]
    b = h.client("b")
    b.set_code(code)
    h.run_until_quiet()
    return a, b


def close_all(h: Harness, *clients: Client) -> None:
    for c in clients:
        c.close()
    h.run_until_quiet()
    for c in clients:
        assert c.got(core.Closed)


def intruder(h: Harness, nameplate: str, side: str) -> tuple[Client, str]:
    """A raw client that claims ``nameplate`` and opens its mailbox; returns the mailbox id."""
    x = h.raw_client("x")
    x.send_raw("bind", appid=h.appid, side=side)
    x.send_raw("claim", nameplate=nameplate)
    h.run_until_quiet()
    (claimed,) = [m for m in x.received if m["type"] == "claimed"]
    x.send_raw("open", mailbox=claimed["mailbox"])
    return x, claimed["mailbox"]


def test_bind_is_first_and_carries_appid_side_and_client_version(h):
    assert len(core.WormholeCore(APPID).side) == 10  # the default side
    a = h.client("a")
    a.set_code("1-aa-bb")
    h.run_until_quiet()
    assert a.sent_types()[0] == "bind"
    bind = a.sent[0]
    assert bind["appid"] == APPID
    assert bind["side"] == a.core.side
    assert bind["client_version"][0] == "spark-dilation"
    assert all(len(f["id"]) == 4 for f in a.sent)
    # The server accepted every frame: an ack for each, no error.
    assert not [m for m in a.received if m["type"] == "error"]
    assert [m["id"] for m in a.received if m["type"] == "ack"] == [f["id"] for f in a.sent]


def test_happy_exchange_in_order_with_matching_verifiers(h):
    a, b = pair(h)
    welcome = a.got(core.GotWelcome)[0].welcome
    assert welcome["motd"] == "hi"  # the real server adds "your-address"
    (va,), (vb,) = a.got(core.GotVerifier), b.got(core.GotVerifier)
    assert va.verifier == vb.verifier and len(va.verifier) == 32
    assert a.core.key == b.core.key
    for i in range(3):
        a.send_message(b"a%d" % i)
    b.send_message(b"from b")
    h.run_until_quiet()
    assert plaintexts(b) == [b"a0", b"a1", b"a2"]
    assert plaintexts(a) == [b"from b"]
    assert a.got(core.GotVersions)[0].app_versions == {}
    close_all(h, a, b)
    assert a.closed_result is None and b.closed_result is None
    assert h.empty()


def test_nameplate_released_once_the_peer_arrives(h):
    a, b = pair(h)
    nameplate = a.core.code.split("-")[0]
    for p in (a, b):
        assert [m["nameplate"] for m in sent(p, "release")] == [nameplate]
        assert replies(p).count("released") == 1
    # Both released before either closed: the server already deleted the nameplate.
    assert h.sides_per_nameplate() == {}
    assert not a.got(core.Closed) and not b.got(core.Closed)


def test_versions_and_app_versions_reach_the_peer(h):
    a = h.client("a", versions={"can-dilate": ["ged"], "app_versions": {"x": 1}})
    b = h.client("b")
    a.set_code("5-foo-bar")
    b.set_code("5-foo-bar")
    h.run_until_quiet()
    got = b.got(core.GotVersions)[0]
    assert got.versions["can-dilate"] == ["ged"]
    assert got.app_versions == {"x": 1}


def test_wrong_code_both_sides_learn_and_close_scary(h):
    a, b = h.client("a"), h.client("b")
    a.set_code("3-right-code")
    b.set_code("3-wrong-code")
    h.run_until_quiet()
    for p in (a, b):
        assert isinstance(p.closed_result, WrongCodeError)
        assert "mistyped" in str(p.closed_result)
        assert not p.got(core.GotVerifier)
        assert p.got(core.StopConnection)
        assert [m["mood"] for m in sent(p, "close")] == ["scary"]
        assert not p.connected  # StopConnection closed the WebSocket
    assert h.empty()


def test_messages_sent_before_confirmation_wait_for_it(h):
    a = h.client("a")
    a.set_code("4-aa-bb")
    a.send_message(b"early")
    h.run_until_quiet()
    assert [m["phase"] for m in sent(a, "add")] == ["pake"]  # nothing encrypted yet
    b = h.client("b")
    b.set_code("4-aa-bb")
    h.run_until_quiet()
    assert plaintexts(b) == [b"early"]
    assert [m["phase"] for m in sent(a, "add")] == ["pake", "version", "0"]


def test_reconnect_mid_session_resends_and_deduplicates(h):
    a, b = pair(h)
    # b drops before its message reaches the server; a sends while b is away.
    b.disconnect()
    b.send_message(b"while offline")
    a.send_message(b"to the absent")
    h.run_until_quiet()
    assert not b.got(core.GotMessage)
    b.connect()  # rebinds, reopens, the server replays the mailbox, b resends pending
    h.run_until_quiet()
    assert plaintexts(b) == [b"to the absent"]
    assert plaintexts(a) == [b"while offline"]
    assert len(sent(b, "open")) == 2
    assert not sent(b, "claim")[1:]  # released before the drop: no second claim
    # The server replayed every message on the second open, b's own included.
    replayed = [(m["side"], m["phase"]) for m in b.received if m["type"] == "message"]
    assert replayed.count((a.core.side, "pake")) == 2
    assert replayed.count((a.core.side, "version")) == 2
    # Replayed phases (pake, version) were not processed twice.
    assert len(b.got(core.GotVerifier)) == 1 and len(b.got(core.GotVersions)) == 1
    close_all(h, a, b)
    assert a.closed_result is None and b.closed_result is None
    assert h.empty()


def test_reconnect_before_claim_answer_claims_again(h):
    a = h.client("a")
    a.set_code("9-foo-bar")
    h.deliver_through(a, UP, "claim")  # the claim lands...
    a.disconnect()  # ...and its answer is lost
    assert a.core.mailbox is None
    a.connect()
    h.run_until_quiet()
    assert len(sent(a, "claim")) == 2
    assert replies(a).count("claimed") == 1
    assert a.core.mailbox == "mb1"  # the mailbox the first claim created
    assert h.sides_per_nameplate() == {"9": 1}  # the same side claimed twice: one row
    close_all(h, a)
    assert isinstance(a.closed_result, LonelyError)
    assert h.empty()


def test_allocation_survives_a_reconnect(h):
    a = h.client("a", connect=False)
    a.allocate_code(3)  # not connected yet: allocate on connect
    assert not a.got(core.GotCode)
    a.connect()
    h.run_until_quiet()
    (got,) = a.got(core.GotCode)
    nameplate, *words = got.code.split("-")
    assert nameplate.isdigit() and len(words) == 3
    assert a.sent_types()[:3] == ["bind", "allocate", "claim"]
    assert [m["nameplate"] for m in a.received if m["type"] == "allocated"] == [nameplate]
    assert h.sides_per_nameplate() == {nameplate: 1}  # allocate claimed it for a


def test_out_of_order_phases_are_delivered_in_order(h):
    a, b = pair(h)
    key = b.core.key
    # Hand-made frames: the real server relays a's phases in the order a sent them.
    for phase in ("2", "0", "1"):
        body = encrypt_data(derive_phase_key(key, a.core.side, phase), f"m{phase}".encode())
        b.feed(
            b.core.frame_received(
                server_msg("message", side=a.core.side, phase=phase, body=body.hex())
            )
        )
    assert plaintexts(b) == [b"m0", b"m1", b"m2"]


def test_dilate_phases_have_their_own_order(h):
    a, b = pair(h)
    a.call("send_dilate", b'{"type": "please"}')
    a.send_message(b"app")
    a.call("send_dilate", b'{"type": "connection-hints"}')
    h.run_until_quiet()
    phases = [m["phase"] for m in sent(a, "add")]
    assert phases == ["pake", "version", "dilate-0", "0", "dilate-1"]
    assert plaintexts(b, core.GotDilate) == [
        b'{"type": "please"}',
        b'{"type": "connection-hints"}',
    ]
    assert plaintexts(b) == [b"app"]


def test_tampered_message_is_a_wrong_code(h):
    a, b = pair(h)
    b.feed(
        b.core.frame_received(server_msg("message", side=a.core.side, phase="0", body=("00" * 40)))
    )
    assert not b.got(core.Closed)  # waits for the server to confirm the close
    assert [m["type"] for m in b.queued(UP)] == ["close"]  # released already at pairing
    h.run_until_quiet()
    assert isinstance(b.closed_result, WrongCodeError)
    assert [m["mood"] for m in sent(b, "close")] == ["scary"]
    assert replies(b)[-1] == "closed"
    close_all(h, a)
    assert h.empty()


def test_malformed_pake_is_a_wrong_code(h):
    a = h.client("a")
    a.set_code("6-x-y")
    h.run_until_quiet()
    # A raw client claims the nameplate and adds a malformed PAKE to the mailbox.
    x, mailbox = intruder(h, "6", "eeeeeeeeee")
    bad = json.dumps({"not_pake": "00"}).encode()
    x.send_raw("add", phase="pake", body=bad.hex())
    h.run_until_quiet()
    assert isinstance(a.closed_result, WrongCodeError)
    assert [m["mood"] for m in sent(a, "close")] == ["scary"]
    x.send_raw("release", nameplate="6")
    x.send_raw("close", mailbox=mailbox, mood="scary")
    h.run_until_quiet()
    assert h.empty()


def test_reflected_pake_is_rejected(h):
    a = h.client("a")
    a.set_code("6-x-y")
    h.run_until_quiet()
    (own,) = [m for m in sent(a, "add") if m["phase"] == "pake"]
    # A raw client with another side adds a's own PAKE message back to the mailbox.
    x, mailbox = intruder(h, "6", "ffffffffff")
    x.send_raw("add", phase="pake", body=own["body"])
    h.run_until_quiet()
    assert isinstance(a.closed_result, WrongCodeError)
    assert [m["mood"] for m in sent(a, "close")] == ["scary"]
    x.send_raw("release", nameplate="6")
    x.send_raw("close", mailbox=mailbox, mood="scary")
    h.run_until_quiet()
    assert h.empty()


def holders(h: Harness, code: str) -> tuple[Client, Client]:
    """Two clients that meet on ``code`` and keep their claims (keep_nameplate).

    On the real server a third claim that lands before the holders opened the
    mailbox also robs them (test_mailbox_harness.py, the robbed winner): the
    holders finish their exchange first.
    """
    a, b = h.client("a", keep_nameplate=True), h.client("b", keep_nameplate=True)
    a.set_code(code)
    b.set_code(code)
    h.run_until_quiet()
    assert a.got(core.GotVerifier) and b.got(core.GotVerifier)
    return a, b


def test_crowded_claim_gives_crowded_error(h):
    a, b = holders(h, "8-aa-bb")
    c = h.client("c")
    c.set_code("8-aa-bb")
    h.run_until_quiet()
    assert isinstance(c.closed_result, CrowdedError)
    assert "new code" in str(c.closed_result) and "8" in str(c.closed_result)
    errors = [(m["error"], m["orig"]["type"]) for m in c.received if m["type"] == "error"]
    assert errors == [("crowded", "claim")]
    # The server recorded c's side before refusing it: c gives it back, and has
    # no mailbox to close (tests/test_mailbox_harness.py has the server's side).
    assert c.sent_types() == ["bind", "claim", "release"]
    assert replies(c)[-1] == "released"
    assert not a.got(core.Closed) and not b.got(core.Closed)  # the holders go on


def test_crowded_claim_is_released_even_with_keep_nameplate(h):
    a, b = holders(h, "8-aa-bb")
    c = h.client("c", keep_nameplate=True)
    c.set_code("8-aa-bb")
    h.run_until_quiet()
    assert isinstance(c.closed_result, CrowdedError)
    assert [m["nameplate"] for m in sent(c, "release")] == ["8"]
    close_all(h, a, b)
    assert h.sides_per_nameplate() == {}  # c's release let the holders' free it


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


def test_close_before_a_peer_is_lonely(h):
    a = h.client("a")
    a.set_code("2-aa-bb")
    h.run_until_quiet()
    a.close()
    h.run_until_quiet()
    assert isinstance(a.closed_result, LonelyError)
    assert [m["mood"] for m in sent(a, "close")] == ["lonely"]
    assert replies(a)[-2:] == ["released", "closed"]
    assert h.empty()


def test_close_while_disconnected_finishes_after_reconnect(h):
    a, b = pair(h)
    a.disconnect()
    a.close()
    assert not a.got(core.Closed)
    a.connect()
    h.run_until_quiet()
    assert a.closed_result is None
    assert [m["mood"] for m in sent(a, "close")] == ["happy"]
    assert a.sent_types()[-2:] == ["bind", "close"]  # released before the drop
    close_all(h, b)
    assert h.empty()


def test_close_after_a_reconnect_still_delivers_unechoed_messages(h):
    a, b = pair(h)
    a.disconnect()
    a.send_message(b"last words")  # never reaches the server...
    a.close()  # ...before the close, which waits for a connection
    a.connect()
    h.run_until_quiet()
    assert a.closed_result is None
    assert plaintexts(b) == [b"last words"]
    types = a.sent_types()
    assert types.index("add", types.index("bind", 2)) < types.index("close")
    close_all(h, b)
    assert h.empty()


def test_close_with_nothing_claimed_is_immediate():
    c = core.WormholeCore(APPID)
    events = c.close()
    assert of_type(events, core.Closed) and of_type(events, core.StopConnection)


def test_api_misuse_raises_typed_errors():
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


def test_list_and_ping(h):
    a = h.client("a", connect=False)
    a.call("list_nameplates")  # before connecting: sent on connect
    a.connect()
    a.call("ping", 7)
    h.run_until_quiet()
    assert a.sent_types() == ["bind", "list", "ping"]
    assert a.got(core.GotNameplates)[0].nameplates == ()
    assert a.got(core.GotPong)[0].ping == 7
    # With a nameplate in use, the list names it.
    b = h.client("b")
    b.set_code("5-aa-bb")
    h.run_until_quiet()
    a.call("list_nameplates")
    h.run_until_quiet()
    assert a.got(core.GotNameplates)[-1].nameplates == ("5",)
