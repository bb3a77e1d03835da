"""Classic Transit when things go wrong: the sans-IO core, then whole transfers.

Part 1 drives :mod:`spark_dilation.transit.protocol` with bytes only (no I/O),
against the reference implementation (``wormhole.transit`` 0.24) as an
oracle: handshakes, record keys, the nonce, and every way a peer can send the
wrong bytes. Hypothesis checks framing under arbitrary splits and arbitrary
garbage.

Part 2 runs both peers of a file transfer in this process (our ``Wormhole``
+ ``TransitConnector`` + ``filetransfer.send_path``/``receive``) against the
real mailbox server and transit relay, breaks the transit connection in one
precise way, and checks that BOTH sides fail with a clear error and that the
receiver's directory holds nothing afterwards (not even a ``.partial``).
Hangs are bounded (``HANG``) so they fail the test; nothing asserts timing.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from nacl.secret import SecretBox
from reactor_helpers import failure_of, reactor, reactor_test
from twisted.internet import defer, endpoints, protocol
from twisted.internet.testing import StringTransport
from wormhole import transit as ref  # the reference implementation: a test-only oracle
from wormhole.util import HKDF

from spark_dilation.errors import DilationError, TransferError
from spark_dilation.transit import filetransfer, offers
from spark_dilation.transit import protocol as P
from spark_dilation.transit.connector import SEND_CHUNK, TransitConnection, TransitConnector
from spark_dilation.wormhole import Wormhole

KEY = bytes(range(32))
OTHER_KEY = bytes(range(1, 33))
SIDE = "0123456789abcdef"


# =====================================================================================
# Part 1: the sans-IO core
# =====================================================================================


class OurPeer:
    """A :class:`P.TransitConnectionCore` with an outbox, as a socket would see it."""

    def __init__(self, core: P.TransitConnectionCore, *, go: bool = True) -> None:
        self.core = core
        self.go = go
        self.events: list[P.Event] = []
        self._out = bytearray()
        self._handle(core.connection_made())

    def _handle(self, events: list[P.Event]) -> None:
        for event in events:
            if isinstance(event, P.Send):
                self._out += event.data
            else:
                self.events.append(event)
                if isinstance(event, P.ReadyForDecision):
                    self._handle(self.core.decide(self.go))

    def feed(self, data: bytes) -> None:
        self._handle(self.core.data_received(data))

    def take_output(self) -> bytes:
        out = bytes(self._out)
        self._out.clear()
        return out

    def send(self, record: bytes) -> None:
        self._out += self.core.encode_record(record)

    @property
    def records(self) -> list[bytes]:
        return [e.record for e in self.events if isinstance(e, P.RecordReceived)]

    @property
    def failures(self) -> list[P.TransitError]:
        return [e.error for e in self.events if isinstance(e, P.Failed)]

    @property
    def negotiated(self) -> bool:
        return any(isinstance(e, P.Negotiated) for e in self.events)


class _RefOwner:
    """Just enough of the reference's ``transit.Common`` to drive its ``Connection``."""

    _send_this = ref.Common._send_this
    _expect_this = ref.Common._expect_this
    _sender_record_key = ref.Common._sender_record_key
    _receiver_record_key = ref.Common._receiver_record_key

    def __init__(self, key: bytes, is_sender: bool, go: bool) -> None:
        self._transit_key = key
        self.is_sender = is_sender
        self._go = go

    def connection_ready(self, conn: Any) -> str:
        if not self.is_sender:
            return "wait-for-decision"
        return "go" if self._go else "nevermind"


class RefPeer:
    """The reference's ``transit.Connection`` on an in-memory transport."""

    def __init__(self, key: bytes, *, is_sender: bool, go: bool = True) -> None:
        self.conn = ref.Connection(_RefOwner(key, is_sender, go), None, 0, "reference")
        self.transport = StringTransport()
        self.conn.transport = self.transport
        self.conn.connected = 1
        self.records: list[bytes] = []
        self.negotiation = self.conn.startNegotiation()
        self.negotiation.addErrback(lambda f: None)

    def feed(self, data: bytes) -> None:
        self.conn.dataReceived(data)
        while self.conn._inbound_records:
            self.records.append(self.conn._inbound_records.popleft())

    def take_output(self) -> bytes:
        out = self.transport.value()
        self.transport.clear()
        return out

    def send(self, record: bytes) -> None:
        self.conn.send_record(record)

    @property
    def negotiated(self) -> bool:
        return self.conn.state == "records"


def pump(a: Any, b: Any) -> None:
    """Deliver bytes both ways until neither side has anything more to say."""
    while True:
        moved = False
        for src, dst in ((a, b), (b, a)):
            data = src.take_output()
            if data:
                dst.feed(data)
                moved = True
        if not moved:
            return


def core(key: bytes = KEY, *, is_sender: bool, **kwargs: Any) -> P.TransitConnectionCore:
    return P.TransitConnectionCore(key, is_sender=is_sender, **kwargs)


def negotiated_pair() -> tuple[OurPeer, OurPeer]:
    sender, receiver = OurPeer(core(is_sender=True)), OurPeer(core(is_sender=False))
    pump(sender, receiver)
    assert sender.negotiated and receiver.negotiated
    return sender, receiver


def records_stream(key: bytes, records: list[bytes]) -> bytes:
    encoder = P.RecordEncoder(key)
    return b"".join(encoder.encode(r) for r in records)


# --- wire format against the reference ---------------------------------------------------


@pytest.mark.parametrize("key", [KEY, os.urandom(32)], ids=["fixed-key", "random-key"])
def test_handshakes_match_the_reference(key: bytes) -> None:
    assert P.sender_handshake(key) == ref.build_sender_handshake(key)
    assert P.receiver_handshake(key) == ref.build_receiver_handshake(key)
    assert P.relay_handshake(key, SIDE) == ref.build_sided_relay_handshake(key, SIDE)
    assert P.sender_handshake(key) != P.receiver_handshake(key)


def test_the_core_opens_with_the_reference_handshakes() -> None:
    assert core(is_sender=True).connection_made() == [P.Send(ref.build_sender_handshake(KEY))]
    assert core(is_sender=False).connection_made() == [P.Send(ref.build_receiver_handshake(KEY))]
    via_relay = core(is_sender=False, relay_side=SIDE)
    assert via_relay.connection_made() == [P.Send(ref.build_sided_relay_handshake(KEY, SIDE))]
    # The peer handshake only after the relay's "ok".
    assert via_relay.data_received(b"o") == []
    assert via_relay.data_received(b"k\n") == [P.Send(ref.build_receiver_handshake(KEY))]


@pytest.mark.parametrize("is_sender", [True, False], ids=["sender", "receiver"])
def test_record_keys_match_the_reference_derivation(is_sender: bool) -> None:
    sender_key = HKDF(KEY, SecretBox.KEY_SIZE, CTXinfo=b"transit_record_sender_key")
    receiver_key = HKDF(KEY, SecretBox.KEY_SIZE, CTXinfo=b"transit_record_receiver_key")
    out_key, in_key = P.record_keys(KEY, is_sender)
    if is_sender:
        assert (out_key, in_key) == (sender_key, receiver_key)
    else:
        assert (out_key, in_key) == (receiver_key, sender_key)

    # Our encoder's output opens with the reference's key: [len][nonce|ciphertext].
    encoder = P.RecordEncoder(out_key)
    for n, record in enumerate([b"first", b"", b"x" * 70_000]):
        wire = encoder.encode(record)
        length = int.from_bytes(wire[:4], "big")
        assert length == len(wire) - 4 == len(record) + P.RECORD_OVERHEAD
        box = SecretBox(sender_key if is_sender else receiver_key)
        assert box.decrypt(wire[4:]) == record
        assert wire[4 : 4 + P.NONCE_SIZE] == n.to_bytes(P.NONCE_SIZE, "big")


def test_the_nonce_is_a_big_endian_counter_from_zero() -> None:
    encoder = P.RecordEncoder(KEY)
    nonces = [encoder.encode(b"r")[4 : 4 + P.NONCE_SIZE] for _ in range(258)]
    assert nonces[0] == bytes(24)
    assert nonces[1] == bytes(23) + b"\x01"
    assert nonces[256] == bytes(22) + b"\x01\x00"  # big-endian, not little-endian
    assert nonces[257] == bytes(22) + b"\x01\x01"


def test_the_decoder_reads_reference_style_records() -> None:
    box = SecretBox(KEY)
    wire = b""
    for n, record in enumerate([b"a", b"bb", b""]):
        encrypted = bytes(box.encrypt(record, bytes.fromhex(f"{n:048x}")))
        wire += bytes.fromhex(f"{len(encrypted):08x}") + encrypted
    assert P.RecordDecoder(KEY).feed(wire) == [b"a", b"bb", b""]


@pytest.mark.parametrize("ref_is_sender", [True, False], ids=["ref-sender", "ref-receiver"])
def test_a_whole_session_with_the_reference_connection(ref_is_sender: bool) -> None:
    """Handshake, go, records both ways: our core against the reference's Connection."""
    theirs = RefPeer(KEY, is_sender=ref_is_sender)
    ours = OurPeer(core(is_sender=not ref_is_sender))
    pump(ours, theirs)
    assert ours.negotiated and theirs.negotiated
    assert ours.failures == []

    payloads = [b"one", os.urandom(100_000), b"", b"last"]
    for p in payloads:
        ours.send(p)
        theirs.send(p[::-1])
    pump(ours, theirs)
    assert theirs.records == payloads
    assert ours.records == [p[::-1] for p in payloads]
    assert ours.failures == []


# --- bad peers ---------------------------------------------------------------------------


def test_a_reordered_record_kills_the_connection() -> None:
    sender, receiver = negotiated_pair()
    first, second = sender.core.encode_record(b"0"), sender.core.encode_record(b"1")
    receiver.feed(second + first)
    assert receiver.records == []
    [error] = receiver.failures
    assert isinstance(error, P.BadRecord)
    assert "out-of-order" in str(error) and "nonce 1, expected 0" in str(error)
    assert receiver.core.state == "failed"
    receiver.feed(first)  # nothing more is emitted once failed
    assert receiver.records == [] and len(receiver.failures) == 1


def test_a_replayed_record_kills_the_connection() -> None:
    sender, receiver = negotiated_pair()
    first = sender.core.encode_record(b"pay me once")
    receiver.feed(first)
    receiver.feed(first)
    assert receiver.records == [b"pay me once"]
    [error] = receiver.failures
    assert isinstance(error, P.BadRecord)
    assert "nonce 0, expected 1" in str(error)


@pytest.mark.parametrize(
    "position",
    [4 + P.NONCE_SIZE, -1, 4 + P.NONCE_SIZE + 5],
    ids=["first-mac-byte", "last-byte", "ciphertext-byte"],
)
def test_a_corrupted_byte_fails_authentication(position: int) -> None:
    sender, receiver = negotiated_pair()
    wire = bytearray(sender.core.encode_record(b"important payload"))
    wire[position] ^= 0x40
    receiver.feed(bytes(wire))
    assert receiver.records == []
    [error] = receiver.failures
    assert isinstance(error, P.BadRecord)
    assert "authentication" in str(error) and "corrupted" in str(error)


def test_a_corrupted_nonce_is_an_out_of_order_record() -> None:
    sender, receiver = negotiated_pair()
    wire = bytearray(sender.core.encode_record(b"x"))
    wire[4 + P.NONCE_SIZE - 1] ^= 0x01
    receiver.feed(bytes(wire))
    [error] = receiver.failures
    assert isinstance(error, P.BadRecord) and "out-of-order" in str(error)


@pytest.mark.parametrize("length", [2**32 - 1, P.DEFAULT_MAX_RECORD + P.RECORD_OVERHEAD + 1])
def test_an_oversized_length_prefix_fails_fast_without_buffering(length: int) -> None:
    decoder = P.RecordDecoder(KEY)
    with pytest.raises(P.BadRecord, match="limit"):
        decoder.feed(length.to_bytes(4, "big"))  # nothing but the prefix: no waiting for it
    assert decoder.buffered <= 4

    _, receiver = negotiated_pair()
    receiver.feed(length.to_bytes(4, "big") + b"\x00" * 100)
    [error] = receiver.failures
    assert isinstance(error, P.BadRecord)
    assert str(length) in str(error)
    assert receiver.core._decoder.buffered <= 4 + 100


def test_the_largest_allowed_record_passes_and_one_more_byte_does_not() -> None:
    limit = 1000
    encoder, decoder = P.RecordEncoder(KEY), P.RecordDecoder(KEY, max_record=limit)
    assert decoder.feed(encoder.encode(b"m" * limit)) == [b"m" * limit]
    with pytest.raises(P.BadRecord):
        decoder.feed(encoder.encode(b"m" * (limit + 1)))


@pytest.mark.parametrize("length", [0, 1, P.RECORD_OVERHEAD - 1])
def test_a_record_shorter_than_its_overhead_is_refused(length: int) -> None:
    with pytest.raises(P.BadRecord):
        P.RecordDecoder(KEY).feed(length.to_bytes(4, "big"))


def test_a_truncated_stream_emits_nothing_and_does_not_fail() -> None:
    sender, receiver = negotiated_pair()
    whole = sender.core.encode_record(b"complete") + sender.core.encode_record(b"cut short")
    cut = len(whole) - 1
    receiver.feed(whole[:cut])
    assert receiver.records == [b"complete"]
    assert receiver.failures == []
    assert receiver.core.state == "records"
    receiver.feed(whole[cut:])  # the rest still completes it
    assert receiver.records == [b"complete", b"cut short"]


@pytest.mark.parametrize("cut", [1, 20, 40])
def test_a_truncated_handshake_emits_nothing(cut: int) -> None:
    receiver = OurPeer(core(is_sender=False))
    receiver.feed(P.sender_handshake(KEY)[:cut])
    assert receiver.events == []
    assert receiver.core.state == "handshake"


def test_a_peer_with_another_key_fails_the_handshake_on_both_sides() -> None:
    sender = OurPeer(core(KEY, is_sender=True))
    receiver = OurPeer(core(OTHER_KEY, is_sender=False))
    pump(sender, receiver)
    for peer in (sender, receiver):
        assert not peer.negotiated
        [error] = peer.failures
        assert isinstance(error, P.BadHandshake)
        assert "a different code" in str(error)
        assert peer.core.state == "failed"
    assert "the peer sent an unexpected handshake" in str(receiver.failures[0])


def test_a_reference_peer_with_another_key_is_refused() -> None:
    theirs = RefPeer(OTHER_KEY, is_sender=True)
    ours = OurPeer(core(KEY, is_sender=False))
    pump(ours, theirs)
    [error] = ours.failures
    assert "a different code" in str(error)
    assert not ours.negotiated


@pytest.mark.parametrize("sender_kind", ["ours", "reference"])
def test_nevermind_received_by_the_receiver(sender_kind: str) -> None:
    sender: Any = (
        OurPeer(core(is_sender=True), go=False)
        if sender_kind == "ours"
        else RefPeer(KEY, is_sender=True, go=False)
    )
    receiver = OurPeer(core(is_sender=False))
    pump(sender, receiver)
    assert not receiver.negotiated
    [error] = receiver.failures
    assert isinstance(error, P.BadHandshake)
    assert "chose another connection" in str(error)
    if sender_kind == "ours":
        assert not sender.negotiated
        assert "another connection won" in str(sender.failures[0])


def test_go_then_nevermind_split_byte_by_byte() -> None:
    receiver = OurPeer(core(is_sender=False))
    for byte in P.sender_handshake(KEY) + b"nevermind\n":
        receiver.feed(bytes([byte]))
    [error] = receiver.failures
    assert "chose another connection" in str(error)


@pytest.mark.parametrize(
    "answer",
    [b"HTTP/1.1 400 Bad Request\r\n\r\n", b"no\n", b"okay\n", b"\x00\xff"],
    ids=["http", "no", "okay", "binary"],
)
def test_garbage_instead_of_the_relay_ok(answer: bytes) -> None:
    peer = OurPeer(core(is_sender=True, relay_side=SIDE))
    peer.feed(answer)
    [error] = peer.failures
    assert isinstance(error, P.BadHandshake)
    assert "the transit relay" in str(error)
    assert peer.take_output() == ref.build_sided_relay_handshake(KEY, SIDE)  # no handshake leaked


def test_relay_ok_followed_by_the_peer_handshake_in_one_read() -> None:
    sender = OurPeer(core(is_sender=True, relay_side=SIDE))
    assert sender.take_output() == P.relay_handshake(KEY, SIDE)
    sender.feed(b"ok\n" + P.receiver_handshake(KEY))
    assert sender.failures == []
    assert sender.take_output() == P.sender_handshake(KEY) + P.GO
    assert sender.negotiated


def test_a_receiver_must_not_speak_before_go() -> None:
    sender = OurPeer(core(is_sender=True))
    sender.feed(P.receiver_handshake(KEY) + b"unexpected")
    # The sender decided "go"; the stray bytes then fail as records.
    assert sender.negotiated
    assert len(sender.failures) == 1 and isinstance(sender.failures[0], P.BadRecord)


# --- properties ----------------------------------------------------------------------------

MAX = 200  # a small record limit keeps the examples fast
BOUND = MAX + P.RECORD_OVERHEAD + 4


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    edges = [0, *points, len(data)]
    return [data[a:b] for a, b in itertools.pairwise(edges)]


@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    records=st.lists(st.binary(max_size=MAX), max_size=8),
    cuts=st.lists(st.integers(min_value=0), max_size=30),
)
def test_any_split_of_a_record_stream_decodes_the_same(records: list[bytes], cuts: list[int]):
    decoder = P.RecordDecoder(KEY, max_record=MAX)
    got: list[bytes] = []
    for chunk in split(records_stream(KEY, records), cuts):
        got += decoder.feed(chunk)
        assert decoder.buffered < BOUND
    assert got == records
    assert decoder.buffered == 0


@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    records=st.lists(st.binary(max_size=MAX), max_size=6),
    cuts=st.lists(st.integers(min_value=0), max_size=30),
    via_relay=st.booleans(),
)
def test_any_split_of_a_whole_session_gives_the_same_events(
    records: list[bytes], cuts: list[int], via_relay: bool
) -> None:
    """Relay ok, handshake, go and records, however TCP cuts them up."""
    receiver = OurPeer(core(is_sender=False, relay_side=SIDE if via_relay else None))
    out_key, _ = P.record_keys(KEY, is_sender=True)
    stream = (
        (P.RELAY_OK if via_relay else b"")
        + P.sender_handshake(KEY)
        + P.GO
        + records_stream(out_key, records)
    )
    for chunk in split(stream, cuts):
        receiver.feed(chunk)
    assert receiver.failures == []
    assert receiver.negotiated
    assert receiver.records == records


@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    valid=st.lists(st.binary(max_size=MAX), max_size=3),
    garbage=st.lists(
        st.one_of(
            st.binary(max_size=300),
            # plausible frames: a length within the limit, then random bytes
            st.integers(min_value=0, max_value=MAX + P.RECORD_OVERHEAD).flatmap(
                lambda n: st.binary(min_size=n, max_size=n).map(lambda b: n.to_bytes(4, "big") + b)
            ),
            st.integers(min_value=0, max_value=2**32 - 1).map(lambda n: n.to_bytes(4, "big")),
        ),
        max_size=6,
    ),
    cuts=st.lists(st.integers(min_value=0), max_size=20),
)
def test_arbitrary_bytes_give_records_or_bad_record_and_stay_bounded(
    valid: list[bytes], garbage: list[bytes], cuts: list[int]
) -> None:
    decoder = P.RecordDecoder(KEY, max_record=MAX)
    got: list[bytes] = []
    for chunk in split(records_stream(KEY, valid) + b"".join(garbage), cuts):
        try:
            out = decoder.feed(chunk)
        except P.BadRecord:
            break  # the only failure allowed; the connection is dead from here
        assert isinstance(out, list) and all(isinstance(r, bytes) for r in out)
        got += out
        assert decoder.buffered < BOUND
    # Garbage never authenticates: whatever came out is a prefix of the valid records.
    assert got == valid[: len(got)]


@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    is_sender=st.booleans(),
    via_relay=st.booleans(),
    chunks=st.lists(st.binary(max_size=120), max_size=8),
)
def test_arbitrary_bytes_never_crash_the_core(
    is_sender: bool, via_relay: bool, chunks: list[bytes]
) -> None:
    peer = OurPeer(core(is_sender=is_sender, relay_side=SIDE if via_relay else None))
    for chunk in chunks:
        peer.feed(chunk)  # must not raise
    for event in peer.events:
        assert isinstance(event, P.Failed | P.ReadyForDecision | P.Negotiated)
    assert len(peer.failures) <= 1
    if peer.failures:
        assert peer.core.state == "failed"
        assert isinstance(peer.failures[0], P.TransitError)


# =====================================================================================
# Part 2: whole transfers in this process, broken on purpose
# =====================================================================================

HANG = 45.0  # a side still running after this long is hanging: fail the test
SIZE = 6 * SEND_CHUNK + 1234  # several records


def make_connector(is_sender: bool, relay_url: str | None = None, **kwargs: Any):
    kwargs.setdefault("listen_addresses", ["127.0.0.1"])
    return TransitConnector(reactor(), is_sender=is_sender, relay_url=relay_url, **kwargs)


async def outcome(d: defer.Deferred) -> Any:
    """The result or the exception; a hang becomes a TimeoutError naming the side."""
    d.addTimeout(HANG, reactor())
    try:
        return await d
    except Exception as e:
        return e


async def transfer(
    mailbox_url: str,
    src: Path,
    dest: Path,
    sender: TransitConnector,
    receiver: TransitConnector,
) -> tuple[Any, Any]:
    """Send ``src`` into ``dest`` between two in-process peers: (sent, received)."""
    ws = Wormhole(offers.APPID, mailbox_url, reactor())
    wr = Wormhole(offers.APPID, mailbox_url, reactor())
    try:
        ws.allocate_code()
        wr.set_code(await ws.get_code())
        sending = defer.ensureDeferred(filetransfer.send_path(ws, src, sender))
        receiving = defer.ensureDeferred(filetransfer.receive(wr, dest, receiver))
        sent, received = await defer.gatherResults(
            [defer.ensureDeferred(outcome(sending)), defer.ensureDeferred(outcome(receiving))]
        )
    finally:
        for w in (ws, wr):
            with contextlib.suppress(DilationError):
                await w.close()
    return sent, received


@pytest.fixture
def src(tmp_path: Path) -> Path:
    path = tmp_path / "outbox" / "payload.bin"
    path.parent.mkdir()
    path.write_bytes(os.urandom(SIZE))
    return path


@pytest.fixture
def dest(tmp_path: Path) -> Path:
    path = tmp_path / "inbox"
    path.mkdir()
    return path


def assert_nothing_saved(dest: Path) -> None:
    assert sorted(p.name for p in dest.iterdir()) == [], "the receiver left files behind"


def assert_is_error(value: Any, *types: type[BaseException]) -> BaseException:
    assert isinstance(value, types), f"expected {types}, got {value!r}"
    assert not isinstance(value, defer.TimeoutError | defer.CancelledError), "it hung"
    return value


# --- the baseline: the same harness succeeds when nothing is broken --------------------


@pytest.mark.parametrize("mode", ["direct", "relay-only"])
@reactor_test(timeout=120)
async def test_in_process_transfer_succeeds(mailbox_url, relay_url, src, dest, mode):
    no_listen = mode == "relay-only"
    sent, received = await transfer(
        mailbox_url,
        src,
        dest,
        make_connector(True, relay_url, no_listen=no_listen),
        make_connector(False, relay_url, no_listen=no_listen),
    )
    assert isinstance(received, filetransfer.ReceivedFile), received
    assert received.path == dest / src.name
    assert received.path.read_bytes() == src.read_bytes()
    assert sent == received.sha256
    assert sorted(p.name for p in dest.iterdir()) == [src.name]


# --- (a) a corrupted record ----------------------------------------------------------------


@reactor_test(timeout=120)
async def test_corrupted_record(mailbox_url, relay_url, src, dest, monkeypatch):
    encode = P.TransitConnectionCore.encode_record
    count: dict[int, int] = {}

    def corrupt_third_sender_record(self: P.TransitConnectionCore, record: bytes) -> bytes:
        wire = encode(self, record)
        if not self.is_sender:
            return wire
        count[id(self)] = n = count.get(id(self), 0) + 1
        if n != 3:
            return wire
        flipped = bytearray(wire)
        flipped[4 + P.NONCE_SIZE + 100] ^= 0x01  # one ciphertext byte
        return bytes(flipped)

    monkeypatch.setattr(P.TransitConnectionCore, "encode_record", corrupt_third_sender_record)
    sent, received = await transfer(
        mailbox_url, src, dest, make_connector(True, relay_url), make_connector(False, relay_url)
    )

    error = assert_is_error(received, TransferError)
    assert "dropped before the whole file arrived" in str(error)
    assert "authentication" in str(error) and "corrupted" in str(error)
    assert f"of {SIZE} bytes" in str(error) and "Nothing was saved" in str(error)
    got = int(re.search(r"got (\d+) of", str(error)).group(1))
    assert got <= 2 * SEND_CHUNK  # never a byte of the corrupted record or beyond
    assert_nothing_saved(dest)

    error = assert_is_error(sent, TransferError, P.TransitError)
    assert "closed before" in str(error)


# --- (b) the sender hangs up halfway -------------------------------------------------------


@reactor_test(timeout=120)
async def test_truncated_transfer(mailbox_url, relay_url, src, dest, monkeypatch):
    send_record = TransitConnection.send_record
    count: dict[int, int] = {}

    def abort_after_two(self: TransitConnection, record: bytes) -> None:
        if not self.core.is_sender:
            return send_record(self, record)
        count[id(self)] = n = count.get(id(self), 0) + 1
        if n <= 2:
            return send_record(self, record)
        if n == 3:
            self.transport.abortConnection()
        return None

    monkeypatch.setattr(TransitConnection, "send_record", abort_after_two)
    sent, received = await transfer(
        mailbox_url, src, dest, make_connector(True, relay_url), make_connector(False, relay_url)
    )

    error = assert_is_error(received, TransferError)
    assert "dropped before the whole file arrived" in str(error)
    got = int(re.search(r"got (\d+) of (\d+) bytes", str(error)).group(1))
    assert got <= 2 * SEND_CHUNK < SIZE
    assert "Nothing was saved; try again." in str(error)
    assert_nothing_saved(dest)

    error = assert_is_error(sent, TransferError, P.TransitError)
    assert "closed before" in str(error)


# --- (c) the only hint answers garbage -----------------------------------------------------


class _Garbage(protocol.Protocol):
    def connectionMade(self) -> None:
        self.transport.write(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")


@reactor_test(timeout=120)
async def test_bad_handshake_from_the_only_hint(mailbox_url, src, dest):
    factory = protocol.ServerFactory.forProtocol(_Garbage)
    port = await endpoints.TCP4ServerEndpoint(reactor(), 0, interface="127.0.0.1").listen(factory)
    garbage_port = port.getHost().port
    try:
        garbage_hint = {
            "type": "direct-tcp-v1",
            "priority": 0.0,
            "hostname": "127.0.0.1",
            "port": garbage_port,
        }
        sender = make_connector(True, None, no_listen=True)
        receiver = make_connector(False, None, no_listen=True, connect_timeout=2.0)
        add = receiver.add_connection_hints
        receiver.add_connection_hints = lambda hints: add([garbage_hint])
        sent, received = await transfer(mailbox_url, src, dest, sender, receiver)
    finally:
        await port.stopListening()

    error = assert_is_error(received, P.TransitError)
    text = str(error)
    # Not listening and its only attempt failed: it gives up at once, not at the timeout.
    assert text.startswith("could not connect to the other side: every attempt failed (tried: ")
    assert f"direct tcp:127.0.0.1:{garbage_port}: " in text
    assert "unexpected handshake" in text and "HTTP/1.1 400" in text
    assert "a different code, or not a wormhole peer" in text
    assert_nothing_saved(dest)

    # The sender had nothing at all to try: it says so at once.
    error = assert_is_error(sent, P.TransitError)
    assert "neither side offered a usable hint" in str(error)


# --- (d) the two sides derive different transit keys ---------------------------------------


@pytest.mark.parametrize("how", ["flip-a-key-byte", "another-purpose"])
@reactor_test(timeout=120)
async def test_wrong_transit_key(mailbox_url, relay_url, src, dest, monkeypatch, how):
    sender = make_connector(True, relay_url, connect_timeout=4.0)
    receiver = make_connector(False, relay_url, connect_timeout=4.0)
    if how == "flip-a-key-byte":
        set_key = receiver.set_transit_key
        receiver.set_transit_key = lambda key: set_key(bytes([key[0] ^ 1]) + key[1:])
    else:
        # _exchange_hints reads the purpose at call time: the receiver exchanges
        # second (after the sender's hints arrive), so switch it in between.
        exchange = filetransfer._exchange_hints

        async def per_side(w: Wormhole, connector: TransitConnector) -> None:
            purpose = filetransfer.TRANSIT_KEY_PURPOSE
            if connector is receiver:
                monkeypatch.setattr(filetransfer, "TRANSIT_KEY_PURPOSE", purpose + "/wrong")
            try:
                await exchange(w, connector)
            finally:
                monkeypatch.setattr(filetransfer, "TRANSIT_KEY_PURPOSE", purpose)

        monkeypatch.setattr(filetransfer, "_exchange_hints", per_side)

    sent, received = await transfer(mailbox_url, src, dest, sender, receiver)

    for side, value in (("receiver", received), ("sender", sent)):
        error = assert_is_error(value, P.TransitError)
        text = str(error)
        assert text.startswith("could not connect to the other side within 4 s"), (side, text)
        assert "unexpected handshake" in text, (side, text)
        assert "a different code" in text, (side, text)
    assert_nothing_saved(dest)


# --- the connector: a record asked for after the connection ended ---------------------------


@reactor_test(timeout=60)
async def test_receive_record_after_the_connection_closed_fails_instead_of_hanging():
    key = os.urandom(32)
    sender, receiver = make_connector(True), make_connector(False)
    sender.add_connection_hints(await receiver.get_connection_hints())
    receiver.add_connection_hints(await sender.get_connection_hints())
    sender.set_transit_key(key)
    receiver.set_transit_key(key)
    s, r = await defer.gatherResults([sender.connect(), receiver.connect()])
    assert s.describe().startswith("direct ") and r.describe().startswith("direct ")

    s.send_record(b"to the receiver")
    assert await r.receive_record() == b"to the receiver"
    r.send_record(b"to the sender")
    assert await s.receive_record() == b"to the sender"

    await r.close()
    await s.when_closed()
    d = s.receive_record()
    d.addTimeout(10, reactor())
    error = await failure_of(d)
    assert isinstance(error, P.TransitError), f"expected a TransitError, got {error!r}"
    assert "closed" in str(error)
    for c in (sender, receiver):
        c.stop()
