"""The batch drain (docs/architecture.md, 'The worker side'): destinations from a DestPool, completions into a native
batch, one call per
drain. Checked against drain_ingress, the per-object form of the same loop."""

from __future__ import annotations

import mmap
import random

import numpy as np
import pytest

from cython_ring import (
    RING_HEADER_LEN,
    Completion,
    Completions,
    DestPool,
    DrainEnd,
    EgressState,
    IngressState,
    ObjectSpec,
    Ring,
    drain_batch,
    drain_ingress,
    write_egress,
)

SPEC = ObjectSpec("tensor", 1 << 20, 8, "uint8", (), "strict")


def ring(capacity: int = 256) -> Ring:
    return Ring.init(mmap.mmap(-1, RING_HEADER_LEN + capacity), 0, 7, capacity)


def produce(r: Ring, st: EgressState, object_id: int, seq: int, data: np.ndarray) -> None:
    write_egress(r, st, object_id, seq, data.ctypes.data, data.nbytes)
    assert not st.busy, "the test object must fit the ring"


def test_one_call_loads_every_object_into_pooled_destinations_in_order() -> None:
    r, st = ring(1024), EgressState(SPEC)
    data = [np.full(64, i, np.uint8) for i in range(5)]
    for i, d in enumerate(data):
        produce(r, st, 100 + i, i, d)
    dst = np.zeros((5, 64), np.uint8)
    pool, out = DestPool(exact=True), Completions()
    pool.put_many(np.array([dst[i].ctypes.data for i in range(5)], np.uint64), 64)
    assert drain_batch(r, IngressState(), SPEC, pool, out) == 5
    assert out.records() == [Completion(100 + i, i, 64, 0) for i in range(5)]
    assert out.rows(7) == [[100 + i, i, 64, 7 + i] for i in range(5)]
    assert out.end is None and out.need is None and out.writable and out.loaded_bytes == 320
    assert all((dst[i] == i).all() for i in range(5)) and len(pool) == 0 and pool.taken == 5
    assert r.readable == 0


def test_an_empty_or_ill_fitting_pool_stops_before_the_header_and_names_it() -> None:
    r, st, ist = ring(), EgressState(SPEC), IngressState()
    produce(r, st, 1, 0, np.ones(16, np.uint8))
    produce(r, st, 2, 1, np.ones(32, np.uint8))
    pool, out = DestPool(exact=True), Completions()
    assert drain_batch(r, ist, SPEC, pool, out) == 0
    assert out.need == Completion(1, 0, 16, 0) and r.readable == 2 * 40 + 48  # nothing consumed
    small, big = np.zeros(16, np.uint8), np.zeros(64, np.uint8)
    pool.put(small.ctypes.data, 16)
    pool.put(big.ctypes.data, 64)  # exact: a 64-byte destination does not fit a 32-byte object
    assert drain_batch(r, ist, SPEC, pool, out) == 1 and out.need == Completion(2, 1, 32, 0)
    assert pool.next_size == 64 and pool.clear() == 1
    loose = DestPool()  # not exact: any destination at least the extent fits
    loose.put(big.ctypes.data, 64)
    assert drain_batch(r, ist, SPEC, loose, out) == 1 and out.need is None and (big[:32] == 1).all()


def test_an_object_larger_than_the_ring_streams_over_several_calls() -> None:
    r, st, ist = ring(128), EgressState(SPEC), IngressState()
    data = np.random.default_rng(1).integers(0, 256, 1000, dtype=np.uint8)
    dst = np.zeros(1000, np.uint8)
    pool, out = DestPool(exact=True), Completions()
    pool.put(dst.ctypes.data, 1000)
    loaded = 0
    while True:
        write_egress(r, st, 9, 0, data.ctypes.data, data.nbytes)
        loaded += drain_batch(r, ist, SPEC, pool, out)
        if not st.busy and ist.phase == "need_header":
            break
    assert loaded == 1 and out.records() == [Completion(9, 0, 1000, 0)] and (dst == data).all()


def test_a_bad_header_ends_the_stream_with_a_named_record_and_faults_the_ring() -> None:
    r, st, ist = ring(), EgressState(SPEC), IngressState()
    produce(r, st, 1, 0, np.ones(8, np.uint8))
    bad = EgressState()  # no spec: it writes a sequence the strict consumer refuses
    write_egress(r, bad, 2, 5, np.ones(8, np.uint8).ctypes.data, 8)
    pool, out = DestPool(), Completions()
    buf = np.zeros(64, np.uint8)
    pool.put(buf.ctypes.data, 64)
    pool.put(buf.ctypes.data, 64)
    assert drain_batch(r, ist, SPEC, pool, out) == 1
    assert out.end == DrainEnd("failed", "sequence_violation", out.end.message, 2, 5)
    assert not out.writable and r.state == 3 and ist.phase == "faulted"
    assert drain_batch(r, ist, SPEC, pool, out) == 0 and out.end is None  # faulted once, reported once


def test_closed_ring_ends_cleanly() -> None:
    r, st, ist = ring(), EgressState(SPEC), IngressState()
    produce(r, st, 1, 0, np.ones(8, np.uint8))
    r.close()
    pool, out = DestPool(), Completions()
    buf = np.zeros(8, np.uint8)
    pool.put(buf.ctypes.data, 8)
    assert drain_batch(r, ist, SPEC, pool, out) == 1 and out.end == DrainEnd("closed")
    assert out.end.legacy() == ("closed",)


def test_max_objects_stops_early_and_says_so() -> None:
    r, st, ist = ring(1024), EgressState(SPEC), IngressState()
    for i in range(4):
        produce(r, st, i, i, np.ones(8, np.uint8))
    pool, out = DestPool(), Completions()
    buf = np.zeros(8, np.uint8)
    pool.put_many(np.full(4, buf.ctypes.data, np.uint64), 8)
    assert drain_batch(r, ist, SPEC, pool, out, 3) == 3 and out.more
    assert drain_batch(r, ist, SPEC, pool, out, 3) == 1 and not out.more


def test_pool_refuses_a_null_destination_and_grows_past_its_first_block() -> None:
    pool = DestPool()
    with pytest.raises(ValueError):
        pool.put(0, 8)
    with pytest.raises(ValueError):
        pool.put_many(np.zeros(2, np.uint64), 8)
    pool.put(0, 0)  # a zero-byte object needs no memory
    pool.put_many(np.arange(1, 1001, dtype=np.uint64), 8)
    assert len(pool) == 1001 and pool.next_size == 0


@pytest.mark.parametrize("seed", range(20))
def test_batch_and_per_object_drains_agree_on_random_streams(seed: int) -> None:
    rng = random.Random(seed)
    cap = 64 * rng.randint(2, 8)
    a, b = ring(cap), ring(cap)
    sa, sb, ia, ib = EgressState(SPEC), EgressState(SPEC), IngressState(), IngressState()
    objects = [np.random.default_rng(seed * 100 + i).integers(0, 256, 8 * rng.randint(0, 40), dtype=np.uint8)
               for i in range(rng.randint(1, 12))]
    got_a: list[bytes] = []
    got_b: list[bytes] = []
    landing: list[np.ndarray] = []
    pool, out, pooled = DestPool(exact=True), Completions(), []

    def resolve(object_id: int, sequence: int, extent: int) -> tuple[int, int]:
        landing.append(np.zeros(max(extent, 1), np.uint8))
        return landing[-1].ctypes.data, extent

    for i, data in enumerate(objects):
        while True:
            write_egress(a, sa, i, i, data.ctypes.data, data.nbytes)
            write_egress(b, sb, i, i, data.ctypes.data, data.nbytes)
            got_a += [bytes(landing.pop(0)[:ev[3]]) for ev in drain_ingress(a, ia, SPEC, resolve) if ev[0] == "loaded"]
            while True:
                drain_batch(b, ib, SPEC, pool, out)
                got_b += [bytes(pooled.pop(0)[:rec.extent]) for rec in out.records()]
                if out.need is None:
                    break
                pooled.append(np.zeros(max(out.need.extent, 1), np.uint8))
                pool.put(pooled[-1].ctypes.data if out.need.extent else 0, out.need.extent)
            if not sa.busy:
                break
    assert got_a == got_b == [bytes(d) for d in objects]
    assert ia.bytes_consumed == ib.bytes_consumed and a.readable == b.readable == 0
