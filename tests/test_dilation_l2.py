"""Dilation L2 (framing + Noise) against the reference magic-wormhole 0.24, in process.

The reference's own objects are the oracle: its ``_Framer``/``_Record`` on a
``StringTransport``, and NoiseConnections built exactly like
``wormhole/_dilation/connector.py`` does. No sockets, no reactor, no timing
asserts. Frame lengths are the ones observed on the wire (shared/WIRE.md §3.5).
"""

from __future__ import annotations

import itertools
import os
import random
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from twisted.internet.testing import StringTransport
from wormhole._dilation import connection as ref_conn
from wormhole._dilation.connector import (
    PROLOGUE_FOLLOWER,
    PROLOGUE_LEADER,
    build_noise,
    build_sided_relay_handshake,
)
from wormhole._dilation.roles import FOLLOWER, LEADER

from spark_dilation.dilation import framing, noise
from spark_dilation.dilation.framing import (
    DEFAULT_MAX_FRAME,
    FOLLOWER_PROLOGUE,
    LEADER_PROLOGUE,
    RELAY_OK,
    Frame,
    Framer,
    FramingError,
    PrologueReceived,
    SendBytes,
    encode_frame,
    frame_header,
    relay_handshake,
)
from spark_dilation.dilation.noise import (
    NOISE_MAX_CIPHERTEXT,
    DecryptError,
    HandshakeError,
    NoiseHandshake,
    NoiseTransport,
    decrypted_length,
    encrypted_length,
)
from spark_dilation.dilation.records import (
    KCM,
    Ack,
    Close,
    Data,
    Open,
    Ping,
    Pong,
    Record,
    RecordError,
    decode_record,
    encode_record,
)
from spark_dilation.errors import DilationError

KEY = bytes(range(32))
SIDE = "0123456789abcdef"
SIZES = [0, 1, 65510, 65511, 65519, 65520, 65536, 200000, 1024 * 1024]
# write() size -> frame length, observed on the wire (WIRE.md §3.5).
WIRE_FRAME_LENGTHS = {65510: 65535, 65511: 65552, 65536: 65577, 200000: 200073}

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def payload(n: int, seed: int = 0) -> bytes:
    return random.Random(seed * 1_000_003 + n).randbytes(n)


# --- the reference, configured like connector.py:Connector.build_protocol ------


def ref_noise(key: bytes, leader: bool):
    n = build_noise()
    n.set_psks(key)
    if leader:
        n.set_as_initiator()
    else:
        n.set_as_responder()
    n.start_handshake()
    return n


def ref_encrypt_record(n, message: bytes) -> bytes:
    """connection.py:_Record.send_record, minus the framer."""
    if len(message) <= ref_conn.NOISE_MAX_PAYLOAD:
        return n.encrypt(message)
    frame = b""
    for start in range(0, len(message), ref_conn.NOISE_MAX_PAYLOAD):
        frame += n.encrypt(message[start : start + ref_conn.NOISE_MAX_PAYLOAD])
    return frame


def ref_decrypt_frame(n, frame: bytes) -> bytes:
    """connection.py:_Record.decrypt_message, minus parse_record."""
    if len(frame) <= ref_conn.NOISE_MAX_CIPHERTEXT:
        return n.decrypt(frame)
    message = b""
    for start in range(0, len(frame), ref_conn.NOISE_MAX_CIPHERTEXT):
        message += n.decrypt(frame[start : start + ref_conn.NOISE_MAX_CIPHERTEXT])
    return message


def handshake_with_reference(key: bytes, our_leader: bool):
    ours = NoiseHandshake(key, leader=our_leader)
    ref = ref_noise(key, not our_leader)
    if our_leader:
        msg1 = ours.start()
        assert msg1 is not None and len(msg1) == 48
        ref.read_message(msg1)
        msg2 = bytes(ref.write_message())
        assert ours.receive(msg2) is None
    else:
        assert ours.start() is None
        msg1 = bytes(ref.write_message())
        msg2 = ours.receive(msg1)
        assert msg2 is not None and len(msg2) == 48
        ref.read_message(msg2)
    assert ours.complete and ref.handshake_finished
    return ours.transport(), ref


def to_ref(r: Record):
    """Our record as the reference's namedtuple (note its (seqnum, scid) order)."""
    match r:
        case KCM():
            return ref_conn.KCM()
        case Ping(ping_id):
            return ref_conn.Ping(ping_id)
        case Pong(ping_id):
            return ref_conn.Pong(ping_id)
        case Open(scid, seqnum, name):
            return ref_conn.Open(seqnum, scid, name)
        case Data(scid, seqnum, data):
            return ref_conn.Data(seqnum, scid, data)
        case Close(scid, seqnum):
            return ref_conn.Close(seqnum, scid)
        case Ack(resp_seqnum):
            return ref_conn.Ack(resp_seqnum)
    raise TypeError(r)


def same_record(ours: Record, ref) -> bool:
    expected = to_ref(ours)
    return type(expected) is type(ref) and tuple(expected) == tuple(ref)


# --- Noise interop --------------------------------------------------------------


@pytest.mark.parametrize("our_leader", [True, False], ids=["our-leader", "our-follower"])
def test_noise_records_interoperate_with_reference(our_leader: bool) -> None:
    ours, ref = handshake_with_reference(KEY, our_leader)
    for size in SIZES:
        plaintext = payload(size)
        frame = ours.encrypt_record(plaintext)
        assert len(frame) == encrypted_length(size)
        assert ref_decrypt_frame(ref, frame) == plaintext
        ref_frame = ref_encrypt_record(ref, plaintext)
        assert len(ref_frame) == len(frame)
        assert ours.decrypt_frame(ref_frame) == plaintext
    # One nonce per 65519-byte piece (17 for the MiB): the little-endian
    # counter is well past 0 in both directions.
    assert ours.send_nonce == ours.receive_nonce == 1 + 1 + 1 + 1 + 1 + 2 + 2 + 4 + 17


@pytest.mark.parametrize("our_leader", [True, False], ids=["our-leader", "our-follower"])
def test_buffer_apis_interoperate_with_reference(our_leader: bool) -> None:
    ours, ref = handshake_with_reference(KEY, our_leader)
    for size in (0, 17, 65519, 200000):
        plaintext = payload(size, seed=1)
        whole = ours.encrypt_frame(plaintext)
        assert bytes(whole[:4]) == frame_header(encrypted_length(size))
        assert ref_decrypt_frame(ref, bytes(whole[4:])) == plaintext
        out = bytearray(encrypted_length(size) + 7)  # larger is fine
        assert ours.encrypt_record_into(plaintext, out) == encrypted_length(size)
        assert ref_decrypt_frame(ref, bytes(out[: encrypted_length(size)])) == plaintext
        ref_frame = ref_encrypt_record(ref, plaintext)
        back = bytearray(size)
        assert ours.decrypt_frame_into(memoryview(ref_frame), back) == size
        assert back == plaintext


def test_fallback_without_into_apis(monkeypatch: pytest.MonkeyPatch) -> None:
    # cryptography < 47 has no encrypt_into/decrypt_into; the copying stand-in
    # must give the same bytes.
    monkeypatch.setattr(noise, "_HAS_INTO", False)
    ours, ref = handshake_with_reference(KEY, our_leader=True)
    for size in (0, 65519, 65520, 200000):
        plaintext = payload(size, seed=2)
        assert ref_decrypt_frame(ref, ours.encrypt_record(plaintext)) == plaintext
        assert ref_decrypt_frame(ref, bytes(ours.encrypt_frame(plaintext)[4:])) == plaintext
        assert ours.decrypt_frame(ref_encrypt_record(ref, plaintext)) == plaintext
    with pytest.raises(DecryptError):
        ours.decrypt_frame(bytes(65535 + 20))


def test_wire_frame_lengths() -> None:
    ours, ref = handshake_with_reference(KEY, our_leader=False)
    for write_size, frame_length in WIRE_FRAME_LENGTHS.items():
        record = encode_record(Data(3, 7, payload(write_size)))
        assert len(ours.encrypt_record(record)) == frame_length
        assert len(ref_encrypt_record(ref, record)) == frame_length
        assert encrypted_length(len(record)) == frame_length
        assert decrypted_length(frame_length) == len(record)
    assert len(ours.encrypt_record(encode_record(KCM()))) == 17
    assert len(ours.encrypt_record(encode_record(Ack(5)))) == 21


def test_wrong_code_against_reference() -> None:
    ours = NoiseHandshake(KEY, leader=False)
    ours.start()
    other = ref_noise(bytes(32), leader=True)
    with pytest.raises(HandshakeError, match="different code"):
        ours.receive(bytes(other.write_message()))


def test_handshake_errors() -> None:
    leader = NoiseHandshake(KEY, leader=True)
    with pytest.raises(RuntimeError):
        leader.receive(bytes(48))  # before start()
    leader.start()
    with pytest.raises(HandshakeError, match="malformed"):
        leader.receive(b"HTTP/1.1 400 Bad Request\r\n")
    with pytest.raises(HandshakeError):
        leader.receive(os.urandom(48))  # a forged msg2
    with pytest.raises(RuntimeError):
        NoiseHandshake(KEY, leader=False).transport()
    with pytest.raises(ValueError):
        NoiseHandshake(b"short", leader=True)
    assert issubclass(HandshakeError, DilationError)


def test_our_ends_talk_to_each_other() -> None:
    leader, follower = NoiseHandshake(KEY, leader=True), NoiseHandshake(KEY, leader=False)
    assert follower.start() is None
    msg2 = follower.receive(leader.start())
    assert leader.receive(msg2) is None
    a, b = leader.transport(), follower.transport()
    assert b.decrypt_frame(a.encrypt_record(b"\x00")) == b"\x00"
    assert a.decrypt_frame(b.encrypt_record(b"\x00")) == b"\x00"


# --- decryption failures ----------------------------------------------------------


def transport_pair() -> tuple[NoiseTransport, NoiseTransport]:
    k1, k2 = bytes(32), bytes([1]) * 32
    return NoiseTransport(k1, k2), NoiseTransport(k2, k1)


@pytest.mark.parametrize(
    "length", [0, 1, 15, NOISE_MAX_CIPHERTEXT + 1, NOISE_MAX_CIPHERTEXT + 15, 3 * 65535 + 3]
)
def test_impossible_frame_lengths(length: int) -> None:
    _, b = transport_pair()
    with pytest.raises(DecryptError):
        b.decrypt_frame(bytes(length))
    with pytest.raises(DecryptError):
        decrypted_length(length)


def test_replay_and_poisoning() -> None:
    a, b = transport_pair()
    first = a.encrypt_record(b"one")
    assert b.decrypt_frame(first) == b"one"
    with pytest.raises(DecryptError, match="authentication"):
        b.decrypt_frame(first)  # replayed: the nonce moved on
    with pytest.raises(DecryptError, match="already failed"):
        b.decrypt_frame(a.encrypt_record(b"two"))


def test_frames_from_the_wrong_direction_fail() -> None:
    a, _ = transport_pair()
    with pytest.raises(DecryptError):
        a.decrypt_frame(a.encrypt_record(b"echo"))


@FAST
@given(
    sizes=st.lists(st.integers(0, 140_000), min_size=1, max_size=3),
    seed=st.integers(0, 2**16),
)
def test_encrypt_decrypt_round_trip(sizes: list[int], seed: int) -> None:
    a, b = transport_pair()
    for n in sizes:
        plaintext = payload(n, seed)
        frame = a.encrypt_record(plaintext)
        assert len(frame) == encrypted_length(n)
        assert b.decrypt_frame(frame) == plaintext


@FAST
@given(n=st.integers(0, 140_000), data=st.data())
def test_any_flipped_bit_fails(n: int, data) -> None:
    a, b = transport_pair()
    frame = bytearray(a.encrypt_record(payload(n)))
    bit = data.draw(st.integers(0, 8 * len(frame) - 1))
    frame[bit // 8] ^= 1 << (bit % 8)
    with pytest.raises(DecryptError):
        b.decrypt_frame(bytes(frame))


# --- framing -------------------------------------------------------------------------


def leader_framer(**kw) -> Framer:
    return Framer(LEADER_PROLOGUE, FOLLOWER_PROLOGUE, **kw)


def frames_of(events) -> list[bytes]:
    return [bytes(e.payload) for e in events if isinstance(e, Frame)]


def test_prologues() -> None:
    assert len(LEADER_PROLOGUE) == 45 and len(FOLLOWER_PROLOGUE) == 47
    assert (LEADER_PROLOGUE, FOLLOWER_PROLOGUE) == (PROLOGUE_LEADER, PROLOGUE_FOLLOWER)
    for ours, theirs in [
        (LEADER_PROLOGUE, FOLLOWER_PROLOGUE),
        (FOLLOWER_PROLOGUE, LEADER_PROLOGUE),
    ]:
        f = Framer(ours, theirs)
        assert f.connection_made() == ours
        assert not f.prologue_received
        assert f.data_received(theirs[:10]) == []
        assert f.data_received(theirs[10:]) == [PrologueReceived()]
        assert f.prologue_received
        assert f.data_received(encode_frame(b"x")) == [Frame(memoryview(b"x"))]


def test_relay_handshake_matches_reference() -> None:
    ours = relay_handshake(KEY, SIDE)
    assert len(ours) == 104
    assert ours == build_sided_relay_handshake(KEY, SIDE)


def test_relay_ok_path() -> None:
    hs = relay_handshake(KEY, SIDE)
    f = leader_framer(relay_handshake=hs)
    assert f.connection_made() == hs
    assert f.data_received(b"o") == []
    # ok, the peer's prologue and a frame can all come in one chunk.
    events = f.data_received(b"k\n" + FOLLOWER_PROLOGUE + encode_frame(b"msg1"))
    assert events == [SendBytes(LEADER_PROLOGUE), PrologueReceived(), Frame(memoryview(b"msg1"))]


@pytest.mark.parametrize("garbage", [b"bad handshake\n", b"o\n", b"okay", b"HTTP/1.1 400"])
def test_garbage_from_the_relay(garbage: bytes) -> None:
    f = leader_framer(relay_handshake=relay_handshake(KEY, SIDE))
    f.connection_made()
    with pytest.raises(FramingError, match="transit relay"):
        f.data_received(garbage)
    with pytest.raises(FramingError):  # and it stays failed
        f.data_received(RELAY_OK)


def test_same_role_prologue_fails_at_the_first_wrong_byte() -> None:
    f = leader_framer()
    common = len(b"Magic-Wormhole Dilation Handshake v1 ")
    assert f.data_received(LEADER_PROLOGUE[:common]) == []
    with pytest.raises(FramingError, match="same Dilation role"):
        f.data_received(LEADER_PROLOGUE[common : common + 1])


@pytest.mark.parametrize("junk", [b"HTTP/1.1 400 Bad Request\r\n\r\n", b"H", b"\x00\x00\x00\x30"])
def test_non_dilation_peer_fails_at_once(junk: bytes) -> None:
    with pytest.raises(FramingError, match="not a Dilation peer"):
        leader_framer().data_received(junk)


def test_huge_length_prefix_fails_without_allocating() -> None:
    f = leader_framer()
    f.data_received(FOLLOWER_PROLOGUE)
    with pytest.raises(FramingError, match="4294967295 bytes"):
        f.data_received(b"\xff\xff\xff\xff")
    assert f.buffered == 0
    # Split header, after a good frame in the same chunk.
    f = leader_framer()
    f.data_received(FOLLOWER_PROLOGUE + encode_frame(b"good") + b"\xff\xff")
    assert f.buffered == 2
    with pytest.raises(FramingError) as e:
        f.data_received(b"\xff\xff" + b"x" * 100)
    assert f.buffered == 0 and e.value.events == []
    # Good frames before the bad prefix are kept on the error.
    f = leader_framer()
    f.data_received(FOLLOWER_PROLOGUE)
    with pytest.raises(FramingError) as e:
        f.data_received(encode_frame(b"a") + encode_frame(b"b") + b"\xff\xff\xff\xff")
    assert frames_of(e.value.events) == [b"a", b"b"]


def test_max_frame_is_configurable() -> None:
    f = leader_framer(max_frame=10)
    f.data_received(FOLLOWER_PROLOGUE)
    assert frames_of(f.data_received(encode_frame(b"0123456789"))) == [b"0123456789"]
    with pytest.raises(FramingError, match="above our limit of 10"):
        f.data_received(frame_header(11))
    assert DEFAULT_MAX_FRAME >= encrypted_length(64 * 1024 * 1024)
    with pytest.raises(ValueError):
        leader_framer(max_frame=2**32)


def test_frame_header_bounds() -> None:
    assert frame_header(2**32 - 1) == b"\xff\xff\xff\xff"
    with pytest.raises(ValueError):
        frame_header(2**32)
    assert encode_frame(b"abc") == b"\x00\x00\x00\x03abc"


STREAM_PAYLOADS = [b"", b"a", payload(17), payload(300), payload(70_000), b"\x00\x00\x00\x00"]


def stream(payloads: list[bytes]) -> bytes:
    return FOLLOWER_PROLOGUE + b"".join(encode_frame(p) for p in payloads)


def test_frames_split_at_every_byte_boundary() -> None:
    small = [b"", b"a", payload(17), b"\x00\x00\x00\x05", payload(40)]
    data = stream(small)
    for cut in range(len(data) + 1):
        f = leader_framer()
        events = f.data_received(data[:cut]) + f.data_received(data[cut:])
        assert frames_of(events) == small, cut
        assert events.count(PrologueReceived()) == 1
        assert f.buffered == 0


def test_one_byte_at_a_time_and_big_frames() -> None:
    data = stream(STREAM_PAYLOADS)
    f = leader_framer()
    events = []
    for i in range(len(data)):
        events += f.data_received(data[i : i + 1])
        assert f.buffered <= 70_000 + 4
    assert frames_of(events) == STREAM_PAYLOADS


def test_many_frames_in_one_chunk_are_zero_copy() -> None:
    payloads = [i.to_bytes(4, "big") * (i % 5) for i in range(20_000)]
    f = leader_framer()
    events = f.data_received(stream(payloads))
    frames = [e for e in events if isinstance(e, Frame)]
    assert [bytes(e.payload) for e in frames] == payloads
    assert all(isinstance(e.payload, memoryview) for e in frames)
    assert f.buffered == 0


def test_same_frames_as_the_reference_framer() -> None:
    data = stream(STREAM_PAYLOADS)
    t = StringTransport()
    ref = ref_conn._Framer(t, PROLOGUE_LEADER, PROLOGUE_FOLLOWER)
    ref.connectionMade()
    assert t.value() == leader_framer().connection_made()
    tokens = []
    for start in range(0, len(data), 1000):
        tokens += list(ref.add_and_parse(data[start : start + 1000]))
    ref_frames = [tok.frame for tok in tokens if isinstance(tok, ref_conn.Frame)]
    assert ref_frames == frames_of(leader_framer().data_received(data))


@st.composite
def chunked(draw, data: bytes) -> list[bytes]:
    cuts = sorted(draw(st.lists(st.integers(0, len(data)), max_size=12)))
    bounds = [0, *cuts, len(data)]
    return [data[a:b] for a, b in itertools.pairwise(bounds)]


@FAST
@given(
    payloads=st.lists(st.binary(max_size=300), max_size=12),
    relay=st.booleans(),
    data=st.data(),
)
def test_any_chunking_gives_the_same_frames(payloads: list[bytes], relay: bool, data) -> None:
    prefix = RELAY_OK if relay else b""
    f = leader_framer(relay_handshake=relay_handshake(KEY, SIDE) if relay else None)
    events = []
    for chunk in data.draw(chunked(prefix + stream(payloads))):
        events += f.data_received(chunk)
    assert frames_of(events) == payloads
    assert f.prologue_received and f.buffered == 0


@FAST
@given(
    junk=st.binary(max_size=600),
    max_frame=st.integers(0, 300),
    data=st.data(),
)
def test_arbitrary_bytes_after_the_prologue(junk: bytes, max_frame: int, data) -> None:
    f = leader_framer(max_frame=max_frame)
    f.data_received(FOLLOWER_PROLOGUE)
    seen = bytearray()
    try:
        for chunk in data.draw(chunked(junk)):
            for event in f.data_received(chunk):
                assert isinstance(event, Frame)
                assert len(event.payload) <= max_frame
                seen += encode_frame(event.payload)
            assert f.buffered <= max_frame + 4
    except FramingError as e:
        assert "above our limit" in str(e)
        return
    # Nothing lost, nothing invented: frames + what is buffered == the input.
    assert bytes(seen) == junk[: len(seen)]
    assert len(seen) + f.buffered == len(junk)


# --- full stack against the reference _Framer + _Record ------------------------------


class OurEnd:
    """Framer + NoiseHandshake + NoiseTransport, glued like the Twisted layer will be."""

    def __init__(self, key: bytes, leader: bool, relay: bytes | None = None) -> None:
        out, inbound = (
            (LEADER_PROLOGUE, FOLLOWER_PROLOGUE) if leader else (FOLLOWER_PROLOGUE, LEADER_PROLOGUE)
        )
        self.framer = Framer(out, inbound, relay_handshake=relay)
        self.handshake = NoiseHandshake(key, leader=leader)
        self.transport: NoiseTransport | None = None
        self.out = bytearray(self.framer.connection_made())
        self.records: list[Record] = []
        self.frame_lengths: list[int] = []

    def receive(self, data: bytes) -> None:
        for event in self.framer.data_received(data):
            if isinstance(event, SendBytes):
                self.out += event.data
            elif isinstance(event, PrologueReceived):
                msg1 = self.handshake.start()
                if msg1 is not None:
                    self.out += encode_frame(msg1)
            elif not self.handshake.complete:
                msg2 = self.handshake.receive(event.payload)
                self.transport = self.handshake.transport()
                if msg2 is not None:  # the Follower sends its KCM right after msg2
                    self.out += encode_frame(msg2)
                    self.send(KCM())
            else:
                assert self.transport is not None
                self.frame_lengths.append(len(event.payload))
                record = decode_record(self.transport.decrypt_frame(event.payload))
                if record == KCM() and self.handshake.leader:
                    self.send(KCM())  # select this connection: the Leader's KCM
                self.records.append(record)

    def send(self, record: Record) -> int:
        assert self.transport is not None
        frame = self.transport.encrypt_record(encode_record(record))
        self.out += frame_header(len(frame)) + frame
        return len(frame)

    def take(self) -> bytes:
        data, self.out = bytes(self.out), bytearray()
        return data


class RefEnd:
    """The reference's _Framer + _Record on a StringTransport."""

    def __init__(self, key: bytes, leader: bool, relay: bytes | None = None) -> None:
        self.t = StringTransport()
        out, inbound = (
            (PROLOGUE_LEADER, PROLOGUE_FOLLOWER) if leader else (PROLOGUE_FOLLOWER, PROLOGUE_LEADER)
        )
        self.leader = leader
        self.framer = ref_conn._Framer(self.t, out, inbound)
        if relay is not None:
            self.framer.use_relay(relay)
        self.record = ref_conn._Record(
            self.framer, ref_noise_unstarted(key, leader), LEADER if leader else FOLLOWER
        )
        if leader:
            self.record.set_role_leader()
        else:
            self.record.set_role_follower()
        self.record.connectionMade()
        self.tokens: list = []

    def receive(self, data: bytes) -> None:
        for token in self.record.add_and_unframe(data):
            self.tokens.append(token)
            if isinstance(token, ref_conn.Handshake) and not self.leader:
                self.record.send_record(ref_conn.KCM())
            elif isinstance(token, ref_conn.KCM) and self.leader:
                self.record.send_record(ref_conn.KCM())  # select: the Leader's KCM

    def take(self) -> bytes:
        data = self.t.value()
        self.t.clear()
        return data


def ref_noise_unstarted(key: bytes, leader: bool):
    n = build_noise()  # _Record.__attrs_post_init__ calls start_handshake()
    n.set_psks(key)
    if leader:
        n.set_as_initiator()
    else:
        n.set_as_responder()
    return n


def pump(ours: OurEnd, ref: RefEnd) -> None:
    for _ in range(50):
        a, b = ours.take(), ref.take()
        if not a and not b:
            return
        if a:
            ref.receive(a)
        if b:
            ours.receive(b)
    raise AssertionError("the two ends never went quiet")


@pytest.mark.parametrize("relay", [False, True], ids=["direct", "relay"])
@pytest.mark.parametrize("our_leader", [True, False], ids=["our-leader", "our-follower"])
def test_full_l2_against_the_reference(our_leader: bool, relay: bool) -> None:
    ours = OurEnd(KEY, our_leader, relay_handshake(KEY, SIDE) if relay else None)
    ref = RefEnd(KEY, not our_leader, build_sided_relay_handshake(KEY, SIDE) if relay else None)
    if relay:
        # Both sent the sided relay handshake; the "relay" joins them with ok.
        assert len(ours.take()) == 104 and len(ref.take()) == 104
        ours.receive(RELAY_OK)
        ref.receive(RELAY_OK)
    pump(ours, ref)
    # Handshake done, both KCMs crossed (the Follower's first, then the Leader's).
    assert ours.records == [KCM()]
    assert ours.frame_lengths == [17]
    assert [type(t).__name__ for t in ref.tokens] == ["Handshake", "KCM"]
    ref.tokens.clear()

    ours.frame_lengths.clear()
    sent = [
        Open(1, 0, "spark-dilation/partition/v1"),
        *(Data(1, i + 1, payload(n)) for i, n in enumerate(WIRE_FRAME_LENGTHS)),
        Data(1, 5, payload(1024 * 1024)),
        Close(1, 6),
        Ack(9),
        Ping(b"\x01\x02\x03\x04"),
    ]
    lengths = [ours.send(r) for r in sent]
    for r in sent:
        ref.record.send_record(to_ref(r))
    pump(ours, ref)
    assert len(ref.tokens) == len(sent)
    assert all(same_record(ours_r, tok) for ours_r, tok in zip(sent, ref.tokens, strict=True))
    assert ours.records[1:] == sent
    # The reference's frames have exactly the lengths ours do, and the table's.
    assert ours.frame_lengths == lengths
    assert lengths[1:5] == list(WIRE_FRAME_LENGTHS.values())


def test_wrong_code_against_the_reference_stack() -> None:
    ours = OurEnd(KEY, leader=False)
    ref = RefEnd(bytes(32), leader=True)
    with pytest.raises(HandshakeError, match="different code"):
        pump(ours, ref)


# --- L3 records against the reference codec --------------------------------------------


record_bytes = st.one_of(
    st.binary(max_size=40),
    st.builds(lambda t, rest: bytes([t]) + rest, st.integers(0, 8), st.binary(max_size=20)),
)

be4 = st.integers(0, 2**32 - 1)
records = st.one_of(
    st.just(KCM()),
    st.builds(Ping, st.binary(min_size=4, max_size=4)),
    st.builds(Pong, st.binary(min_size=4, max_size=4)),
    st.builds(Open, be4, be4, st.text(max_size=20)),
    st.builds(Data, be4, be4, st.binary(max_size=100)),
    st.builds(Close, be4, be4),
    st.builds(Ack, be4),
)


@settings(max_examples=300, deadline=None)
@given(raw=record_bytes)
def test_decode_record_on_arbitrary_bytes(raw: bytes) -> None:
    try:
        record = decode_record(raw)
    except RecordError:
        return
    assert encode_record(record) == raw
    ref = ref_conn.parse_record(raw)  # the reference accepts whatever we accept
    assert same_record(record, ref)
    assert ref_conn.encode_record(ref) == raw


@settings(max_examples=200, deadline=None)
@given(record=records)
def test_records_round_trip_like_the_reference(record: Record) -> None:
    raw = encode_record(record)
    assert raw == ref_conn.encode_record(to_ref(record))
    assert decode_record(raw) == record
    assert decode_record(memoryview(raw)) == record
    assert same_record(record, ref_conn.parse_record(raw))


def test_l2_modules_do_not_import_the_reference() -> None:
    for module in (framing, noise):
        source = Path(module.__file__).read_text()
        assert "import wormhole" not in source and "from wormhole" not in source
