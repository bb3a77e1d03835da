"""Hint encodings against the reference's own parser and encoder."""

from __future__ import annotations

import pytest
from wormhole import _hints as ref  # the reference: a test-only oracle

from spark_dilation.transit import hints as H


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
