"""Hint encodings against the reference's own parser and encoder; the addresses we offer.

The addresses part runs for real: interfaces read with getifaddrs(3) are
checked against iproute2, a network namespace without a default route stands
for a cluster machine, and a Dilation connection whose direct hints cannot
connect shows the relay fallback being logged and counted.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from reactor_helpers import reactor, reactor_test, sleep
from twisted.internet import defer, endpoints, protocol
from wormhole import _hints as ref  # the reference: a test-only oracle

from spark_dilation.dilation.blocking import BlockingDilation
from spark_dilation.dilation.connector import GenerationConnector
from spark_dilation.testing.leftovers import RUN_PREFIX_ENV
from spark_dilation.transfer.rules.report import TransferReport
from spark_dilation.transit import hints as H
from spark_dilation.transit.addresses import (
    default_route_addresses,
    interface_addresses,
    local_addresses,
    unmapped,
    usable_addresses,
)
from spark_dilation.transit.connector import TransitConnector, listen_tcp

ROOT = Path(__file__).resolve().parent.parent


def test_encoding_matches_the_reference():
    direct = H.DirectTCPV1Hint("127.0.0.1", 40563, 0.0)
    relay = H.RelayV1Hint((H.DirectTCPV1Hint("relay.example", 4001, 0.5),))
    assert H.encode_hint(direct) == ref.encode_hint(ref.DirectTCPV1Hint("127.0.0.1", 40563, 0.0))
    assert H.encode_hint(relay) == ref.encode_hint(
        ref.RelayV1Hint([ref.DirectTCPV1Hint("relay.example", 4001, 0.5)])
    )


@pytest.mark.parametrize(
    "hint",
    [
        {"type": "direct-tcp-v1", "priority": 0.0, "hostname": "10.0.0.1", "port": 1234},
        {"type": "direct-tcp-v1", "hostname": "host", "port": 1},  # priority optional
        {"type": "tor-tcp-v1", "priority": 1.0, "hostname": "x.onion", "port": 80},
        {"type": "relay-v1", "hints": [{"type": "direct-tcp-v1", "hostname": "r", "port": 4001}]},
    ],
)
def test_valid_hints_parse_like_the_reference(hint):
    ours = H.parse_hint(hint)
    theirs = ref.parse_hint(hint)
    assert ours is not None
    if isinstance(ours, H.RelayV1Hint):
        assert [(h.hostname, h.port, h.priority) for h in ours.hints] == [
            (h.hostname, h.port, h.priority) for h in theirs.hints
        ]
    else:
        assert (ours.hostname, ours.port, ours.priority) == tuple(theirs)


@pytest.mark.parametrize(
    "hint",
    [
        {"type": "direct-tcp-v2", "hostname": "h", "port": 1},  # unknown type
        {"type": "direct-tcp-v1", "hostname": 5, "port": 1},
        {"type": "direct-tcp-v1", "hostname": "h", "port": "80"},
        {"type": "direct-tcp-v1", "hostname": "h", "port": 70000},
        {"type": "relay-v1", "hints": "nope"},
        {"type": "relay-v1", "hints": [{"type": "unknown"}]},
        "not a dict",
    ],
)
def test_bad_hints_are_dropped_not_fatal(hint):
    assert H.parse_hint(hint) is None
    assert H.parse_hints([hint]) == []


def test_relay_url_parsing_matches_the_reference():
    for text in ("tcp:relay.example:4001", "tcp:127.0.0.1:4001:priority=2.5", "tcp:[::1]:4001"):
        theirs = ref.parse_hint_argv(text)
        assert H.parse_relay_url(text) == H.DirectTCPV1Hint(*theirs)
    for bad in ("relay.example:4001", "tcp:host", "tcp:host:port", "udp:h:1", "tcp:h:0"):
        with pytest.raises(ValueError):
            H.parse_relay_url(bad)


# --- the addresses we offer as direct hints ---------------------------------------------


def test_usable_addresses_order_dedup_and_filters():
    default = ["192.0.2.2", "2001:db8::2"]
    interfaces = [
        "127.0.0.1",  # loopback
        "::1",
        "fd00::5",
        "10.1.2.3",
        "192.0.2.2",  # the default route's again
        "fe80::1%eth0",  # link-local (with a scope id, as some systems print it)
        "fe80::2",
        "169.254.7.7",
        "0.0.0.0",
        "224.0.0.1",  # multicast
        "::ffff:10.1.2.3",  # IPv4-mapped: 10.1.2.3 again
        "2001:DB8::2",  # the default route's, spelled differently
        "not an address",
        "172.17.0.1",
    ]
    # The default route's first, then the rest: IPv4 before IPv6, each in the given order.
    assert usable_addresses(default, interfaces) == [
        "192.0.2.2",
        "2001:db8::2",
        "10.1.2.3",
        "172.17.0.1",
        "fd00::5",
    ]
    # No default route (a cluster machine): every interface still counts.
    assert usable_addresses([], ["127.0.0.1", "10.88.0.2", "fe80::1"]) == ["10.88.0.2"]
    # Loopback only when nothing else is left.
    assert usable_addresses([], ["127.0.0.1", "::1", "fe80::1", "169.254.1.1"]) == ["127.0.0.1"]
    assert usable_addresses([], []) == ["127.0.0.1"]
    assert unmapped("::ffff:10.0.0.1") == "10.0.0.1"
    assert unmapped("::1") == "::1" and unmapped("10.0.0.1") == "10.0.0.1"


def _iproute2_addresses(netns: str | None = None) -> set[str]:
    """Addresses of the interfaces that are up (IFF_UP), as ``ip -j addr`` says."""
    cmd = ["ip", *(["-n", netns] if netns else []), "-j", "addr", "show"]
    links = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    return {
        a["local"]
        for link in links
        if "UP" in link.get("flags", [])
        for a in link.get("addr_info", [])
        if a.get("family") in ("inet", "inet6")
    }


def test_local_addresses_on_this_machine():
    found = interface_addresses()
    assert found is not None, "getifaddrs(3) is there on Linux"
    assert "127.0.0.1" in found  # loopback is read; local_addresses() drops it
    ours = local_addresses()
    assert "127.0.0.1" not in ours  # this machine has a real interface
    assert ours[: len(default_route_addresses())] == default_route_addresses()


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def test_local_addresses_in_a_namespace_without_a_default_route():
    """A cluster machine: no default route, so only enumerating interfaces finds its address.

    The namespace has loopback up, a veth with an IPv4, a global IPv6 and its
    link-local address, and a second veth with an address that is down.
    Before, ``local_addresses()`` answered ``["127.0.0.1"]`` here.
    """
    pid = os.getpid()
    run = os.environ.get(RUN_PREFIX_ENV, "sd")  # the leftover check sees the run's names
    ns, host_end, ns_end = f"{run}hints{pid}", f"{run}{pid}h", f"{run}{pid}n"
    down_a, down_b = f"{run}{pid}a", f"{run}{pid}b"
    subprocess.run(["ip", "netns", "del", ns], capture_output=True)  # a crashed run's
    try:
        _ip("netns", "add", ns)
        _ip("link", "add", host_end, "type", "veth", "peer", "name", ns_end, "netns", ns)
        _ip("link", "set", host_end, "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        _ip("-n", ns, "addr", "add", "10.88.0.2/24", "dev", ns_end)
        _ip("-n", ns, "addr", "add", "fd88::2/64", "dev", ns_end, "nodad")
        _ip("-n", ns, "link", "set", ns_end, "up")
        _ip("-n", ns, "link", "add", down_a, "type", "veth", "peer", "name", down_b)
        _ip("-n", ns, "addr", "add", "10.89.0.2/24", "dev", down_a)  # left down
        for family in ("-4", "-6"):
            routes = subprocess.run(
                ["ip", "-n", ns, family, "route", "show", "default"],
                check=True,
                capture_output=True,
                text=True,
            ).stdout
            assert routes.strip() == "", routes
        assert {"127.0.0.1", "10.88.0.2", "fd88::2"} <= _iproute2_addresses(ns)

        snippet = (
            "import json\n"
            "from spark_dilation.transit import addresses as A\n"
            "from spark_dilation.transit.connector import local_addresses\n"
            "print(json.dumps(\n"
            "    [A.interface_addresses(), A.default_route_addresses(), local_addresses()]\n"
            "))\n"
        )
        run = subprocess.run(
            ["ip", "netns", "exec", ns, sys.executable, "-c", snippet],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=60,
        )
        assert run.returncode == 0, run.stderr
        interfaces, default, found = json.loads(run.stdout)
        # getifaddrs(3) through ctypes reads what iproute2 shows (IPv4, IPv6, link-local).
        assert set(interfaces) == _iproute2_addresses(ns)
        assert "10.89.0.2" not in interfaces  # its interface is down
        assert default == []  # no default route: the old probe found nothing
        assert found == ["10.88.0.2", "fd88::2"]
        assert "127.0.0.1" not in found and "10.89.0.2" not in found
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        subprocess.run(["ip", "link", "del", host_end], capture_output=True)  # gone already


class _Close(protocol.Protocol):
    def connectionMade(self) -> None:
        self.transport.loseConnection()


@reactor_test(timeout=30)
async def test_listener_takes_ipv4_and_ipv6():
    """One listening socket serves IPv4 and IPv6 hints (it was IPv4 only)."""
    peers: list[str] = []

    class Factory(protocol.Factory):
        def buildProtocol(self, addr):
            peers.append(addr.host)
            return _Close()

    port, families = await listen_tcp(reactor(), Factory())
    try:
        assert families == {socket.AF_INET, socket.AF_INET6}
        number = port.getHost().port
        for ep in (
            endpoints.TCP4ClientEndpoint(reactor(), "127.0.0.1", number),
            endpoints.TCP6ClientEndpoint(reactor(), "::1", number),
        ):
            client = await endpoints.connectProtocol(ep, protocol.Protocol())
            client.transport.loseConnection()
        assert [unmapped(p) for p in peers] == ["127.0.0.1", "::1"]
    finally:
        await port.stopListening()


@reactor_test(timeout=30)
async def test_dilation_hints_offer_every_local_address():
    sent: list[dict] = []
    connector = GenerationConnector(
        reactor(),
        dilation_key=b"k" * 32,
        side="0123456789abcdef",
        leader=True,
        send_hints=sent.extend,
        on_selected=lambda p: None,
        relays=[],
    )
    await connector.start()
    try:
        port = connector._port.getHost().port
        hints = H.parse_hints(sent)
        assert [(h.hostname, h.port) for h in hints] == [(a, port) for a in local_addresses()]
    finally:
        connector.stop()


# --- relays wait for direct paths only while one may still work ---------------------------


def test_relay_delay_rule():
    from spark_dilation.dilation.connector import RELAY_DELAY, relay_delay

    assert relay_delay(direct_possible=True, direct_pending=True) == RELAY_DELAY
    assert relay_delay(direct_possible=True, direct_pending=False) == 0.0  # all failed
    assert relay_delay(direct_possible=False, direct_pending=True) == 0.0  # none can exist


@pytest.mark.parametrize("direct", ["fails", "pending"])
@reactor_test(timeout=30)
async def test_relays_are_dialed_at_once_when_every_direct_dial_failed(monkeypatch, direct):
    """With RELAY_DELAY an hour, the relay is reached only if failed direct dials release it."""
    from spark_dilation.dilation import connector as dc

    monkeypatch.setattr(dc, "RELAY_DELAY", 3600.0)
    arrived: defer.Deferred = defer.Deferred()

    class Relay(protocol.Protocol):
        def connectionMade(self) -> None:
            if not arrived.called:
                arrived.callback(None)

    class Silent(protocol.Protocol):  # accepts, never answers: a direct dial still pending
        pass

    relay_port = await endpoints.TCP4ServerEndpoint(reactor(), 0, interface="127.0.0.1").listen(
        protocol.Factory.forProtocol(Relay)
    )
    silent_port = await endpoints.TCP4ServerEndpoint(reactor(), 0, interface="127.0.0.1").listen(
        protocol.Factory.forProtocol(Silent)
    )
    connector = GenerationConnector(
        reactor(),
        dilation_key=b"k" * 32,
        side="0123456789abcdef",
        leader=True,
        send_hints=lambda hints: None,
        on_selected=lambda p: None,
        relays=[H.DirectTCPV1Hint("127.0.0.1", relay_port.getHost().port, 0.0)],
        listen_addresses=["127.0.0.1"],
    )
    await connector.start()
    try:
        if direct == "fails":
            connector.add_hints([{"type": "direct-tcp-v1", "hostname": UNREACHABLE, "port": 9}])
            await arrived  # the reactor_test timeout fails the test if the relay waits
        else:
            peer = {"type": "direct-tcp-v1", "hostname": "127.0.0.1"}
            connector.add_hints([{**peer, "port": silent_port.getHost().port}])
            await sleep(1.0)
            assert not arrived.called  # a direct connection is alive: the relay keeps waiting
    finally:
        connector.stop()
        await relay_port.stopListening()
        await silent_port.stopListening()


# --- the relay used although both sides offered direct hints -------------------------------

UNREACHABLE = "255.255.255.255"  # a TCP connect() to it fails at once (ENETUNREACH)


@pytest.mark.parametrize(
    ("listen", "path", "fallbacks"),
    [
        pytest.param(UNREACHABLE, "relay", 1, id="direct-hints-fail"),
        pytest.param("127.0.0.1", "direct", 0, id="direct-works"),  # no false alarm
    ],
)
def test_relay_fallback_is_logged_and_counted(
    mailbox_url, relay_url, caplog, listen, path, fallbacks
):
    caplog.set_level(logging.WARNING, logger="spark_dilation")
    common = {"relay_url": relay_url, "listen_addresses": [listen], "timeout": 30.0}
    a = BlockingDilation.create("spark-dilation.example/test-hints", mailbox_url, **common)
    b = None
    try:
        b = BlockingDilation.create(
            "spark-dilation.example/test-hints", mailbox_url, code=a.code, **common
        )
        a.wait_dilated()
        b.wait_dilated()
        for end in (a, b):
            status = end.status()
            assert status.connection.startswith(f"{path} "), status.connection
            assert (status.connections, status.relay_fallbacks) == (1, fallbacks)
    finally:
        for end in (b, a):
            if end is not None:
                end.close(timeout=10, linger=0)
    warnings = [
        r.getMessage()
        for r in caplog.records
        if "although both sides offered direct hints" in r.getMessage()
    ]
    assert len(warnings) == 2 * fallbacks, warnings  # one per side
    for message in warnings:
        assert message.startswith("the dilation connection is on the relay (relay tcp:")
        assert f"ours: tcp:{listen}:" in message and f"theirs: tcp:{listen}:" in message


@reactor_test(timeout=60)
async def test_transit_relay_fallback_is_logged(relay_url, caplog):
    """Classic Transit says the same when its winner is relayed despite direct hints."""
    caplog.set_level(logging.WARNING, logger="spark_dilation")
    key = os.urandom(32)
    ends = [
        TransitConnector(
            reactor(), is_sender=sender, relay_url=relay_url, listen_addresses=[UNREACHABLE]
        )
        for sender in (True, False)
    ]
    hints = [await end.get_connection_hints() for end in ends]
    for end, theirs in zip(ends, reversed(hints), strict=True):
        end.add_connection_hints(theirs)
        end.set_transit_key(key)
    connections = await defer.gatherResults([end.connect() for end in ends])
    try:
        assert all(c.describe().startswith("relay ") for c in connections)
    finally:
        for c in connections:
            await c.close()
    warnings = [
        r.getMessage()
        for r in caplog.records
        if r.getMessage().startswith("the transit connection is on the relay")
    ]
    assert len(warnings) == 2, warnings
    assert all(f"ours: tcp:{UNREACHABLE}:" in m for m in warnings)


def test_report_summary_names_relay_fallbacks_only_when_there_are_some():
    report = TransferReport(
        rows=10, bytes=1000, partitions=2, lanes=2, connections=2, reconnects=0,
        path="relay", seconds=1.0,
    )  # fmt: skip
    assert "fallback" not in report.summary()
    assert json.loads(report.to_json())["relay_fallbacks"] == 0
    fell_back = TransferReport(**{**report.__dict__, "relay_fallbacks": 2})
    assert "0 reconnect(s), 2 relay fallback(s) despite direct hints, 1.0 s" in fell_back.summary()
    assert json.loads(fell_back.to_json())["relay_fallbacks"] == 2
