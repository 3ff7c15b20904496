"""Ring header ABI v2, spans, copies, wake bits, ingress drain and egress write (docs/architecture.md, 'Data plane')."""

from __future__ import annotations

import mmap
import random
import struct
from collections.abc import Callable, Generator

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cython_ring import (
    RING_HEADER_LEN,
    RING_MAGIC,
    STATE_ACTIVE,
    STATE_CLOSED,
    STATE_FAULTED,
    WAKE_READABLE,
    WAKE_WRITABLE,
    EgressState,
    IngressState,
    ObjectSpec,
    Ring,
    drain_ingress,
    encode_header,
    write_egress,
)
from cython_ring.errors import (
    ExtentAlignmentInvalid,
    ExtentExceedsMax,
    HeaderMalformed,
    RingCorrupt,
    RingError,
    SequenceViolation,
)

CAP = 256
SPEC = ObjectSpec("tensor", 1 << 20, 8, "uint8", (), "strict")


def header_bytes(magic: int = RING_MAGIC, version: int = 2, header_len: int = 128, ring_id: int = 7,
                 capacity: int = CAP, commit: int = 0, consume: int = 0, state: int = 1, wake: int = 0,
                 reserved: bytes = b"") -> bytes:
    fixed = struct.pack("<IHHQQQQII", magic, version, header_len, ring_id, capacity, commit, consume, state, wake)
    return fixed + reserved.ljust(80, b"\0")


def arena(size: int = 8192) -> mmap.mmap:
    return mmap.mmap(-1, size)


def ring(capacity: int = CAP, offset: int = 0) -> Ring:
    return Ring.init(arena(offset + RING_HEADER_LEN + capacity), offset, 7, capacity)


def payload(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


class Sink:
    """Destination resolver: a fresh buffer per object, and a record of every call."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int, int]] = []
        self.buffers: list[np.ndarray] = []

    def __call__(self, object_id: int, sequence: int, extent: int) -> tuple[int, int]:
        self.calls.append((object_id, sequence, extent))
        buf = np.zeros(max(extent, 1), np.uint8)
        self.buffers.append(buf)
        return buf.ctypes.data, extent


# --- header ABI ---------------------------------------------------------------------------


def test_init_writes_the_abi_byte_for_byte() -> None:
    m = arena()
    Ring.init(m, 64, 7, CAP)
    assert m[64:64 + 128] == header_bytes()
    assert m[64:68] == b"SWRG" and m[:64] == bytes(64)


def test_attach_reads_a_hand_built_header() -> None:
    m = arena()
    m[128:256] = header_bytes(ring_id=2**40, capacity=4096, commit=1000, consume=900, wake=3)
    r = Ring.attach(m, 128, expected_ring_id=2**40, expected_capacity=4096)
    assert (r.ring_id, r.capacity, r.offset, r.data_offset) == (2**40, 4096, 128, 256)
    assert (r.commit, r.consume, r.state, r.wake, r.readable, r.writable) == (1000, 900, 1, 3, 100, 3996)
    assert r.data_address - r.header_address == RING_HEADER_LEN


def test_cursor_state_and_wake_words_live_at_their_offsets() -> None:
    m = arena()
    r = Ring.init(m, 0, 7, CAP)
    r.write(b"x" * 10)
    r.read(3)
    r.mark_readable()
    r.mark_writable()
    r.close()
    assert struct.unpack_from("<QQII", m, 24) == (10, 3, STATE_CLOSED, WAKE_READABLE | WAKE_WRITABLE)


CORRUPTIONS = [
    ({"magic": 0x47525754}, "magic"),
    ({"version": 1}, "version 1"),
    ({"version": 3}, "version 3"),
    ({"header_len": 64}, "header_len 64"),
    ({"ring_id": 0}, "ring_id 0"),
    ({"ring_id": 8}, "ring_id 8, expected 7"),
    ({"capacity": 0}, "capacity 0"),
    ({"capacity": 100}, "capacity 100"),
    ({"capacity": 128}, "capacity 128, expected 256"),
    ({"state": 0}, "state 0"),
    ({"state": 4}, "state 4"),
    ({"wake": 4}, "wake word"),
    ({"commit": 5, "consume": 6}, "commit 5 and consume 6"),
    ({"commit": 300, "consume": 0}, "commit 300 and consume 0"),
    *[({"reserved": bytes(i) + b"\x01"}, f"reserved byte {48 + i}") for i in (0, 1, 40, 79)],
]


@pytest.mark.parametrize(("fields", "match"), CORRUPTIONS)
def test_each_corrupt_field_is_ring_corrupt(fields: dict[str, object], match: str) -> None:
    m = arena()
    m[0:128] = header_bytes(**fields)  # type: ignore[arg-type]
    with pytest.raises(RingCorrupt, match=match):
        Ring.attach(m, 0, expected_ring_id=7, expected_capacity=CAP)


def test_attach_rejects_capacity_beyond_the_buffer() -> None:
    m = arena(4096)
    m[0:128] = header_bytes(capacity=4096)
    with pytest.raises(RingCorrupt, match="overruns the 4096-byte buffer"):
        Ring.attach(m, 0)
    with pytest.raises(RingCorrupt, match="does not fit"):
        Ring.attach(m, 4032)


@pytest.mark.parametrize(("offset", "ring_id", "capacity"), [(32, 1, 64), (-64, 1, 64), (0, 0, 64),
                                                            (0, 1, 0), (0, 1, 96), (0, 1, 8192)])
def test_init_rejects_bad_layout(offset: int, ring_id: int, capacity: int) -> None:
    with pytest.raises(ValueError):
        Ring.init(arena(), offset, ring_id, capacity)


def test_rings_come_only_from_init_or_attach() -> None:
    with pytest.raises(TypeError, match=r"Ring\.init"):
        Ring()


def test_needs_a_writable_buffer() -> None:
    with pytest.raises(BufferError):
        Ring.attach(header_bytes() + bytes(CAP), 0)


def test_release_lets_the_mapping_close() -> None:
    m = arena()
    r = Ring.init(m, 0, 7, CAP)
    with pytest.raises(BufferError):
        m.close()
    with r:
        r.write(b"abc")
    with pytest.raises(ValueError, match="released"):
        r.read()
    r.release()
    m.close()


# --- cursors, spans, copies ---------------------------------------------------------------


def test_spans_wrap() -> None:
    m = arena()
    r = Ring.init(m, 0, 7, CAP)
    assert r.readable_spans() == [] and r.writable_spans() == [(128, 256)]
    r.write(bytes(range(200)))
    assert r.read(150) == bytes(range(150))
    assert r.readable_spans() == [(278, 50)]
    assert r.writable_spans() == [(328, 56), (128, 150)]
    assert r.write(bytes(range(100, 250))) == 150  # 56 to the end, 94 wrapped
    assert r.readable_spans() == [(278, 106), (128, 94)]
    assert r.writable_spans() == [(222, 56)]
    assert b"".join(m[o:o + n] for o, n in r.readable_spans()) == bytes(range(150, 200)) + bytes(range(100, 250))
    assert r.read() == bytes(range(150, 200)) + bytes(range(100, 250))


def test_span_writes_then_commit() -> None:
    m = arena()
    r = Ring.init(m, 0, 7, 64)
    r.write(bytes(48))
    r.read()
    data = bytes(range(1, 61))
    pos = 0
    for off, n in r.writable_spans():
        chunk = data[pos:pos + n]
        m[off:off + len(chunk)] = chunk
        pos += len(chunk)
    r.advance_commit(60)
    assert r.read() == data


def test_advance_limits() -> None:
    r = ring()
    with pytest.raises(ValueError, match="cannot commit 257"):
        r.advance_commit(CAP + 1)
    r.advance_commit(CAP)
    with pytest.raises(ValueError, match="cannot commit 1"):
        r.advance_commit(1)
    with pytest.raises(ValueError, match="cannot consume 257"):
        r.advance_consume(CAP + 1)
    r.advance_consume(CAP)
    assert (r.commit, r.consume) == (CAP, CAP)
    with pytest.raises(ValueError):
        r.advance_commit(-1)


def test_corrupt_cursors_detected_on_every_access() -> None:
    m = arena()
    r = Ring.init(m, 0, 7, CAP)
    struct.pack_into("<QQ", m, 24, 10, 11)
    for op in (lambda: r.readable, lambda: r.readable_spans(), lambda: r.advance_commit(0),
               lambda: r.advance_consume(0), lambda: r.read(), lambda: r.write(b"x")):
        with pytest.raises(RingCorrupt, match="commit 10 and consume 11"):
            op()


def test_state_transitions() -> None:
    r = ring()
    r.write(b"abc")
    assert r.close() and not r.close()
    with pytest.raises(RingError, match="closed"):
        r.write(b"d")
    assert r.read() == b"abc"  # bytes before the close still drain
    assert r.fault() and not r.fault() and not r.close()
    assert r.state == STATE_FAULTED
    with pytest.raises(RingError, match="faulted"):
        r.read()


def test_copy_by_address_checks_the_stated_size() -> None:
    r = ring()
    src = payload(100)
    with pytest.raises(ValueError, match="exceeds"):
        r.copy_in(src.ctypes.data, 50, 60, src_size=100)
    with pytest.raises(ValueError, match="needs its size"):
        r.copy_in(src.ctypes.data, 0, 10)
    assert r.copy_in(src.ctypes.data, 10, 90, src_size=100) == 90
    dst = np.zeros(64, np.uint8)
    with pytest.raises(ValueError, match="exceeds"):
        r.copy_out(dst.ctypes.data, 0, 65, dst_size=64)
    with pytest.raises(ValueError, match="cannot read 91"):
        r.copy_out(bytearray(200), 0, 91)
    assert r.commit == 90 and r.consume == 0  # refused copies move nothing
    r.copy_out(dst.ctypes.data, 4, 60, dst_size=64)
    assert (dst[4:] == src[10:70]).all() and r.consume == 60
    with pytest.raises(BufferError):
        r.copy_out(b"read-only", 0, 1)


def test_large_copies_release_the_gil_and_stay_exact() -> None:
    r = ring(capacity=1 << 20)
    src = payload(3 << 19)
    out = np.zeros_like(src)
    r.copy_in(src, 0, 1 << 19)
    r.copy_out(out, 0, 1 << 19)
    r.copy_in(src, 1 << 19, 1 << 20)  # wraps
    r.copy_out(out, 1 << 19, 1 << 20)
    assert (out == src).all()


@given(capacity=st.sampled_from([64, 128, 192, 1024]),
       ops=st.lists(st.tuples(st.booleans(), st.integers(0, 1100)), max_size=60))
def test_cursor_model(capacity: int, ops: list[tuple[bool, int]]) -> None:
    m = arena(4096)
    r = Ring.init(m, 64, 3, capacity)
    expected = bytearray()
    counter = 0
    for produce, size in ops:
        if produce:
            data = bytes((counter + i) % 251 for i in range(size))
            n = r.write(data)
            assert n == min(size, capacity - len(expected))
            expected += data[:n]
            counter += n
        else:
            spans = r.readable_spans()
            assert sum(n for _, n in spans) == len(expected) and len(spans) <= 2
            assert b"".join(m[o:o + n] for o, n in spans) == expected
            got = r.read(size)
            assert got == expected[:size]
            del expected[:size]
        assert r.readable == len(expected) == r.commit - r.consume


# --- wake bits ------------------------------------------------------------------------------


def test_wake_bits_coalesce() -> None:
    r = ring()
    assert r.mark_readable() and not r.mark_readable()
    assert r.mark_writable() and not r.mark_writable()
    assert r.wake == WAKE_READABLE | WAKE_WRITABLE
    assert r.clear_readable() and not r.clear_readable()
    assert r.wake == WAKE_WRITABLE
    assert r.mark_readable()
    assert r.clear_writable() and r.wake == WAKE_READABLE


Actor = Generator[str | None, None, None]


def run_interleaved(actors: dict[str, Actor], inboxes: dict[str, list[str]], rng: random.Random) -> None:
    """Step actors in a random, bursty order; an actor that yields "wait" sleeps until its inbox fills.

    If every unfinished actor sleeps on an empty inbox, a wake-up was lost. Bursts (staying with
    one actor for a while) make the rare orders that lose wake-ups far likelier than uniform picks.
    """
    sleeping: set[str] = set()
    stay = rng.choice([0.0, 0.5, 0.7, 0.9])
    current = ""
    while actors:
        runnable = [a for a in actors if a not in sleeping or inboxes[a]]
        assert runnable, f"lost wake-up: {sorted(actors)} all asleep with nothing to wake them"
        if current not in runnable or rng.random() >= stay:
            current = rng.choice(runnable)
        sleeping.discard(current)
        try:
            if next(actors[current]) == "wait":
                sleeping.add(current)
        except StopIteration:
            del actors[current]


class Inbox(list[str]):
    """Hints waiting for an actor; counts hints sent to it and its clears of the matching bit."""

    sent = 0
    clears = 0

    def append(self, item: str) -> None:
        self.sent += 1
        super().append(item)


def byte_producer(r: Ring, data: bytes, chunks: list[int], peer: list[str], inbox: Inbox) -> Actor:
    pos = i = 0
    while pos < len(data):
        r.clear_writable()
        inbox.clears += 1
        yield None
        n = min(r.writable, chunks[i % len(chunks)], len(data) - pos)
        i += 1
        yield None
        if not n:
            while not inbox:
                yield "wait"
            inbox.clear()
            continue
        r.copy_in(data, pos, n)
        pos += n
        yield None
        if r.mark_readable():
            peer.append("readable")
        yield None
    r.close()
    if r.mark_readable():
        peer.append("readable")


def byte_consumer(r: Ring, out: bytearray, chunks: list[int], peer: list[str], inbox: Inbox) -> Actor:
    i = 0
    while True:
        while not inbox:
            yield "wait"
        inbox.clear()
        while True:
            r.clear_readable()
            inbox.clears += 1
            yield None
            closed = r.state == STATE_CLOSED
            n = min(r.readable, chunks[i % len(chunks)])
            i += 1
            yield None
            if not n:
                if closed:
                    return
                break
            out += r.read(n)
            yield None
            if r.mark_writable():
                peer.append("writable")
            yield None


@settings(max_examples=400)
@given(capacity=st.sampled_from([64, 128, 256]), size=st.integers(0, 2000),
       pchunks=st.lists(st.integers(1, 300), min_size=1, max_size=8),
       cchunks=st.lists(st.integers(1, 300), min_size=1, max_size=8),
       seed=st.integers(0, 2**32))
def test_wake_coalescing_never_loses_a_transition(capacity: int, size: int, pchunks: list[int],
                                                  cchunks: list[int], seed: int) -> None:
    rng = random.Random(seed)
    r = ring(capacity)
    data = rng.randbytes(size)
    out = bytearray()
    to_producer, to_consumer = Inbox(), Inbox()
    actors = {"producer": byte_producer(r, data, pchunks, to_consumer, to_producer),
              "consumer": byte_consumer(r, out, cchunks, to_producer, to_consumer)}
    run_interleaved(actors, {"producer": to_producer, "consumer": to_consumer}, rng)
    assert bytes(out) == data
    # Coalesced: a hint needs the bit clear, so each clear allows at most one more hint.
    assert to_consumer.sent <= to_consumer.clears + 1 and to_producer.sent <= to_producer.clears + 1


def object_producer(r: Ring, objects: list[np.ndarray], peer: list[str], inbox: list[str]) -> Actor:
    est = EgressState(SPEC)
    for seq, src in enumerate(objects):
        while True:
            _, hint = write_egress(r, est, seq, seq, src.ctypes.data, src.nbytes)
            if hint:
                peer.append("readable")
            yield None
            if not est.busy:
                break
            while not inbox:
                yield "wait"
            inbox.clear()
    r.close()
    if r.mark_readable():
        peer.append("readable")


def object_consumer(r: Ring, sink: Sink, peer: list[str], inbox: list[str]) -> Actor:
    ist = IngressState()
    while ist.phase != "closed":
        while not inbox:
            yield "wait"
        inbox.clear()
        for event in drain_ingress(r, ist, SPEC, sink):
            assert event[0] != "failed", event
            if event[0] == "writable":
                peer.append("writable")
        yield None


@settings(max_examples=200)
@given(capacity=st.sampled_from([64, 128, 512]), sizes=st.lists(st.integers(0, 200).map(lambda n: 8 * n),
                                                                 max_size=8),
       seed=st.integers(0, 2**32))
def test_drain_and_egress_wake_handling_never_loses_a_transition(capacity: int, sizes: list[int],
                                                                 seed: int) -> None:
    rng = random.Random(seed)
    r, sink = ring(capacity), Sink()
    objects = [payload(max(n, 8), i)[:n] for i, n in enumerate(sizes)]
    to_producer, to_consumer = Inbox(), Inbox()
    actors = {"producer": object_producer(r, objects, to_consumer, to_producer),
              "consumer": object_consumer(r, sink, to_producer, to_consumer)}
    run_interleaved(actors, {"producer": to_producer, "consumer": to_consumer}, rng)
    assert sink.calls == [(i, i, o.nbytes) for i, o in enumerate(objects)]
    assert all((b[:o.nbytes] == o).all() for b, o in zip(sink.buffers, objects, strict=True))


def test_clearing_after_the_load_would_lose_a_wake_up() -> None:
    # Why the consumer clears READABLE *before* loading commit: the other order strands bytes.
    r = ring()
    r.copy_in(b"a", 0, 1)
    assert r.mark_readable()
    assert r.read() == b"a"          # consumer loads commit and drains...
    r.copy_in(b"b", 0, 1)
    assert not r.mark_readable()     # ...producer finds the bit still set and sends nothing...
    r.clear_readable()               # ...consumer clears too late and goes to sleep
    assert r.readable == 1 and r.wake == 0


# --- ingress drain ------------------------------------------------------------------------


def obj(object_id: int, sequence: int, data: bytes | np.ndarray, flags: int = 0) -> bytes:
    return encode_header(object_id, sequence, len(data), flags) + bytes(data)


def test_drain_one_object() -> None:
    r, st_, sink = ring(), IngressState(), Sink()
    data = payload(64)
    r.write(obj(9000, 0, data, flags=1))
    events = drain_ingress(r, st_, SPEC, sink)
    assert events == [("header", 9000, 0, 64, 1), ("loaded", 9000, 0, 64, 1), ("writable",)]
    assert sink.calls == [(9000, 0, 64)] and (sink.buffers[0] == data).all()
    assert r.readable == 0 and r.wake == WAKE_WRITABLE
    assert (st_.phase, st_.expected_sequence, st_.objects_loaded, st_.bytes_consumed) == ("need_header", 1, 1, 104)
    assert drain_ingress(r, st_, SPEC, sink) == []  # nothing new; WRITABLE already pending


def test_drain_many_objects_with_headers_straddling_the_wrap() -> None:
    r, st_, sink = ring(64), IngressState(), Sink()
    stream = b"".join(obj(100 + i, i, payload(8 * (i % 4), i)) for i in range(40))
    pos, events = 0, []
    while pos < len(stream):
        pos += r.write(stream[pos:pos + 37])
        events += drain_ingress(r, st_, SPEC, sink)
    loaded = [e for e in events if e[0] == "loaded"]
    assert [e[1:3] for e in loaded] == [(100 + i, i) for i in range(40)]
    for i, buf in enumerate(sink.buffers):
        assert (buf[:8 * (i % 4)] == payload(8 * (i % 4), i)).all()


def test_objects_ten_times_the_ring_stream_through() -> None:
    capacity = 4096
    r, ist, est, sink = ring(capacity), IngressState(), EgressState(SPEC), Sink()
    objects = [payload(10 * capacity + 8 * k, k) for k in range(3)]
    events = []
    for seq, src in enumerate(objects):
        calls = 0
        while True:
            calls += 1
            write_egress(r, est, 50 + seq, seq, src.ctypes.data, src.nbytes)
            assert r.readable <= capacity
            events += drain_ingress(r, ist, SPEC, sink)
            if not est.busy:
                break
        assert calls >= 10
    events += drain_ingress(r, ist, SPEC, sink)
    assert sink.calls == [(50 + k, k, o.nbytes) for k, o in enumerate(objects)]
    assert [e for e in events if e[0] == "loaded"] == [("loaded", 50 + k, k, o.nbytes, 0)
                                                       for k, o in enumerate(objects)]
    assert all((b == o).all() for b, o in zip(sink.buffers, objects, strict=True))
    assert est.objects_produced == ist.objects_loaded == 3


@settings(max_examples=60)
@given(capacity=st.sampled_from([64, 128, 320, 1024]),
       sizes=st.lists(st.integers(0, 300).map(lambda n: n * 8), max_size=12),
       seed=st.integers(0, 2**32))
def test_random_chunking_delivers_every_object_intact(capacity: int, sizes: list[int],
                                                      seed: int) -> None:
    rng = random.Random(seed)
    r, st_, sink = ring(capacity), IngressState(), Sink()
    objects = [payload(n, i) for i, n in enumerate(sizes)]
    stream = b"".join(obj(i, i, o) for i, o in enumerate(objects))
    pos, events = 0, []
    while pos < len(stream) or r.readable:
        if pos < len(stream) and rng.random() < 0.6:
            pos += r.write(stream[pos:pos + rng.randint(1, 2 * capacity)])
        else:
            events += drain_ingress(r, st_, SPEC, sink)
    assert [e[1] for e in events if e[0] == "loaded"] == list(range(len(objects)))
    assert all((b[:o.nbytes] == o).all() for b, o in zip(sink.buffers, objects, strict=True))
    r.close()
    assert drain_ingress(r, st_, SPEC, sink)[-1] == ("closed",)
    assert st_.phase == "closed" and drain_ingress(r, st_, SPEC, sink) == []


def raw_header(**fields: int) -> bytes:
    f = {"magic": 0x31304F4D, "version": 1, "header_len": 40, "object_id": 1, "sequence": 0, "extent": 8,
         "flags": 0, "reserved": 0} | fields
    return struct.pack("<IHHQQQII", *f.values())


@pytest.mark.parametrize(
    ("header", "code", "ids"),
    [
        (raw_header(magic=0), "header_malformed", (None, None)),
        (raw_header(version=2), "unsupported_object_version", (None, None)),
        (raw_header(header_len=41), "header_malformed", (None, None)),
        (raw_header(reserved=1), "header_malformed", (None, None)),
        (raw_header(flags=4), "header_malformed", (None, None)),
        (raw_header(extent=1 << 21), "extent_exceeds_max", (1, 0)),
        (raw_header(extent=12), "extent_alignment_invalid", (1, 0)),
        (raw_header(sequence=1), "sequence_violation", (1, 1)),
    ],
)
def test_invalid_header_fails_before_any_destination(header: bytes, code: str,
                                                     ids: tuple[int | None, int | None]) -> None:
    r, st_, sink = ring(), IngressState(), Sink()
    r.write(header + bytes(16))
    events = drain_ingress(r, st_, SPEC, sink)
    assert len(events) == 1 and events[0][0] == "failed"
    assert events[0][1] == code and events[0][3:] == ids and events[0][2]
    assert sink.calls == [] and r.consume == 0
    assert r.state == STATE_FAULTED and st_.phase == "faulted"
    assert drain_ingress(r, st_, SPEC, sink) == []


def test_invalid_header_after_good_objects() -> None:
    r, st_, sink = ring(), IngressState(), Sink()
    r.write(obj(1, 0, bytes(8)) + obj(2, 1, bytes(8)) + obj(3, 5, bytes(8)))
    events = drain_ingress(r, st_, SPEC, sink)
    assert [e[0] for e in events] == ["header", "loaded", "header", "loaded", "failed"]
    assert events[-1][1:2] == ("sequence_violation",) and "sequence 5, expected 2" in events[-1][2]
    assert len(sink.calls) == 2 and r.consume == 96


def test_sequence_policy_none() -> None:
    r, st_, sink = ring(), IngressState(), Sink()
    r.write(obj(1, 7, bytes(8)) + obj(2, 3, bytes(8)))
    spec = ObjectSpec("tensor", 64, 8, "uint8", (), "none")
    assert [e[2] for e in drain_ingress(r, st_, spec, sink) if e[0] == "loaded"] == [7, 3]


def test_zero_extent_objects() -> None:
    r, st_, sink = ring(), IngressState(), Sink()
    r.write(obj(1, 0, b"") + obj(2, 1, b""))
    events = drain_ingress(r, st_, SPEC, sink)
    assert [e[:2] for e in events] == [("header", 1), ("loaded", 1), ("header", 2), ("loaded", 2), ("writable",)]


@pytest.mark.parametrize(
    ("resolver", "match"),
    [
        (lambda *_: (_ for _ in ()).throw(MemoryError("device full")), "MemoryError: device full"),
        (lambda o, s, e: (np.zeros(4, np.uint8).ctypes.data, 4), "cannot hold extent 8"),
        (lambda o, s, e: (0, 8), "cannot hold extent 8"),
        (lambda o, s, e: None, "TypeError"),
        (lambda o, s, e: (-1, 8), "address"),
    ],
)
def test_destination_failure_faults_the_ring(resolver: Callable[..., object], match: str) -> None:
    r, st_ = ring(), IngressState()
    r.write(obj(5, 0, bytes(8)))
    events = drain_ingress(r, st_, SPEC, resolver)
    assert events[0][0:2] == ("failed", "device_allocation_failed") and events[0][3:] == (5, 0)
    assert match in events[0][2] and st_.last_exception is not None
    assert r.state == STATE_FAULTED and r.consume == 0


def test_resolver_may_return_numpy_integers() -> None:
    r, st_ = ring(), IngressState()
    dst = np.zeros(8, np.uint8)
    r.write(obj(5, 0, bytes(range(8))))
    events = drain_ingress(r, st_, SPEC, lambda *_: (np.uint64(dst.ctypes.data), np.int64(8)))
    assert events[1] == ("loaded", 5, 0, 8, 0) and bytes(dst) == bytes(range(8))


def test_close_mid_payload_is_eof_mid_object() -> None:
    r, st_, sink = ring(), IngressState(), Sink()
    r.write(obj(4, 0, bytes(80))[:100])
    assert [e[0] for e in drain_ingress(r, st_, SPEC, sink)] == ["header", "writable"]
    r.close()
    events = drain_ingress(r, st_, SPEC, sink)
    assert events == [("failed", "eof_mid_object", "ring 7 closed after 60 of 80 payload bytes", 4, 0)]


def test_close_mid_header_is_eof_mid_object() -> None:
    r, st_, sink = ring(), IngressState(), Sink()
    r.write(obj(4, 0, bytes(8))[:20])
    r.close()
    events = drain_ingress(r, st_, SPEC, sink)
    assert events[0][:2] == ("failed", "eof_mid_object") and events[0][3:] == (None, None)
    assert sink.calls == []


def test_close_at_a_boundary() -> None:
    r, st_, sink = ring(), IngressState(), Sink()
    r.write(obj(4, 0, bytes(8)))
    r.close()
    assert [e[0] for e in drain_ingress(r, st_, SPEC, sink)] == ["header", "loaded", "closed"]


def test_producer_fault_and_corrupt_cursors_are_ring_faults() -> None:
    r, st_, sink = ring(), IngressState(), Sink()
    r.fault()
    assert drain_ingress(r, st_, SPEC, sink) == [("ring_fault", "ring_state_invalid",
                                                  "ring 7 is faulted")]
    m = arena()
    r2 = Ring.init(m, 0, 9, CAP)
    struct.pack_into("<Q", m, 24, 10_000)
    events = drain_ingress(r2, IngressState(), SPEC, sink)
    assert events[0][:2] == ("ring_fault", "ring_state_invalid") and "commit 10000" in events[0][2]
    assert r2.state == STATE_FAULTED


def test_drain_clears_readable_and_hints_writable_once() -> None:
    r, st_, sink = ring(), IngressState(), Sink()
    r.write(obj(1, 0, bytes(8)))
    assert r.mark_readable()
    assert drain_ingress(r, st_, SPEC, sink)[-1] == ("writable",)
    assert r.wake == WAKE_WRITABLE
    r.write(obj(2, 1, bytes(8)))
    assert r.mark_readable()
    assert drain_ingress(r, st_, SPEC, sink)[-1] == ("loaded", 2, 1, 8, 0)  # hint still pending
    assert r.clear_writable()


def test_resolver_cannot_release_the_ring_mid_drain() -> None:
    r, st_ = ring(), IngressState()
    r.write(obj(1, 0, bytes(8)))
    events = drain_ingress(r, st_, SPEC, lambda *_: r.release())
    assert events[0][1] == "device_allocation_failed" and "in use" in events[0][2]


# --- egress write ---------------------------------------------------------------------------


def test_egress_writes_header_then_payload_and_hints_once() -> None:
    r, est = ring(), EgressState(SPEC)
    src = payload(400)
    assert write_egress(r, est, 9000, 0, src.ctypes.data, 400) == (256, True)
    assert est.phase == "payload" and est.busy and est.produced == 216
    assert r.read(40) == encode_header(9000, 0, 400)
    assert write_egress(r, est, 9000, 0, src.ctypes.data, 400) == (40, False)  # READABLE still set
    r.clear_readable()
    r.read()
    assert write_egress(r, est, 9000, 0, src.ctypes.data, 400) == (144, True)
    assert not est.busy and est.expected_sequence == 1 and est.objects_produced == 1


def test_egress_waits_for_room_for_the_whole_header() -> None:
    r, est = ring(64), EgressState()
    r.write(bytes(30))
    assert write_egress(r, est, 1, 0, 0, 0) == (0, False)
    assert est.phase == "header" and r.commit == 30
    r.read()
    assert write_egress(r, est, 1, 0, 0, 0) == (40, True)
    assert est.phase == "idle"


@pytest.mark.parametrize(
    ("args", "error"),
    [((1, 0, 1 << 21), ExtentExceedsMax), ((1, 0, 12), ExtentAlignmentInvalid), ((1, 3, 8), SequenceViolation)],
)
def test_egress_rejects_before_writing(args: tuple[int, int, int], error: type[Exception]) -> None:
    r, est = ring(), EgressState(SPEC)
    src = np.zeros(1 << 21, np.uint8)
    object_id, sequence, extent = args
    with pytest.raises(error):
        write_egress(r, est, object_id, sequence, src.ctypes.data, extent)
    assert r.commit == 0 and est.phase == "idle"


def test_egress_bad_arguments() -> None:
    r, est = ring(), EgressState()
    with pytest.raises(HeaderMalformed):
        write_egress(r, est, 1, 0, 0, 0, 8)
    with pytest.raises(ValueError, match="source address"):
        write_egress(r, est, 1, 0, 0, 8)
    src = payload(1000)
    write_egress(r, est, 1, 0, src.ctypes.data, 1000)
    with pytest.raises(ValueError, match="object 1 seq 0 is still being written"):
        write_egress(r, est, 2, 1, src.ctypes.data, 8)


def test_abandoning_a_partial_object_faults_the_ring() -> None:
    r, est = ring(), EgressState()
    src = payload(1000)
    write_egress(r, est, 1, 0, src.ctypes.data, 1000)
    assert est.abandon(r) and r.state == STATE_FAULTED and est.phase == "faulted"
    with pytest.raises(RingError, match="abandoned"):
        write_egress(r, est, 1, 0, src.ctypes.data, 1000)


def test_abandon_before_the_header_leaves_the_ring_alone() -> None:
    r, est = ring(64), EgressState()
    r.write(bytes(64))
    write_egress(r, est, 1, 0, 0, 0)
    assert not est.abandon(r) and est.phase == "idle" and r.state == STATE_ACTIVE


def test_consumer_fault_mid_object_faults_the_egress_state() -> None:
    r, est = ring(), EgressState()
    src = payload(1000)
    write_egress(r, est, 1, 0, src.ctypes.data, 1000)
    r.fault()
    with pytest.raises(RingError, match="faulted"):
        write_egress(r, est, 1, 0, src.ctypes.data, 1000)
    assert est.phase == "faulted"


def test_egress_detects_corrupt_cursors() -> None:
    m = arena()
    r, est = Ring.init(m, 0, 7, CAP), EgressState()
    struct.pack_into("<Q", m, 32, 5)
    with pytest.raises(RingCorrupt):
        write_egress(r, est, 1, 0, 0, 0)
    assert r.state == STATE_FAULTED


def test_egress_then_ingress_across_two_rings_views() -> None:
    # Producer and consumer attach separately, as two processes would.
    m = arena(1 << 16)
    prod = Ring.init(m, 4096, 11, 1024)
    cons = Ring.attach(m, 4096, expected_ring_id=11, expected_capacity=1024)
    est, ist, sink = EgressState(SPEC), IngressState(), Sink()
    objects = [payload(8 * k, k) for k in range(0, 300, 37)]
    for seq, src in enumerate(objects):
        while True:
            write_egress(prod, est, seq, seq, src.ctypes.data if src.nbytes else 0, src.nbytes)
            drain_ingress(cons, ist, SPEC, sink)
            if not est.busy:
                break
    drain_ingress(cons, ist, SPEC, sink)
    assert ist.objects_loaded == len(objects)
    assert all((b[:o.nbytes] == o).all() for b, o in zip(sink.buffers, objects, strict=True))
