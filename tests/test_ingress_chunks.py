"""The worker's CPU ingress drain over a long burst: one compute-thread call drains several chunks, posting each full
chunk's completions as it ends (in stream order, ahead of the call's own reply), and hands the thread back after
DRAIN_CALL_CHUNKS chunks; a refill takes recycled buffers only while the bridge holds any of the object's size, so a
steady stream allocates nothing once its first lap is released. A drain on the event loop (while the compute thread is
idle) stops at its byte budget, and only a small ring drains there."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import numpy as np
import pytest

import trio_gpuworker.worker._ingress as ingress
from cython_ring import EgressState, ObjectSpec, buffer_records, write_egress_batch
from trio_gpuworker._proto import InstallRing, LoadedBlock, NeverInstalled
from trio_gpuworker.supervisor import ArenaManager

SPEC = {"kind": "bytes", "max_extent": 1 << 20, "alignment": 1, "dtype": "uint8", "shape": [],
        "sequence_policy": "strict"}
CAPACITY = 1 << 16
CHUNK, CALL_CHUNKS = 4, 3


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ingress, "DRAIN_CHUNK", CHUNK)
    monkeypatch.setattr(ingress, "DRAIN_CALL_CHUNKS", CALL_CHUNKS)


def _rows(notices: list[Any]) -> list[list[int]]:
    """Every LOADED_BLOCK's rows [object_id, sequence, extent, handle], in order."""
    return [row for n in notices if isinstance(n, LoadedBlock)
            for row in np.frombuffer(n.raw, "<u8").reshape(-1, 4).tolist()]


def _install(plane: Any, arena: ArenaManager, lease: Any) -> None:
    reply = plane.install_ring(InstallRing(
        req_id=1, ring_id=lease.ring_id, edge_id="e", port_id="p", direction="ingress",
        layout={"offset": lease.offset, "header_len": 128, "capacity": CAPACITY}, object_spec=SPEC,
        loaded_block=True))
    assert reply.T == "RING_INSTALLED", reply


def _uninstall(plane: Any, arena: ArenaManager, lease: Any, ring: Any) -> None:
    plane.stop()
    ring.release()
    arena.release(lease, NeverInstalled(lease.ring_id))


@contextlib.asynccontextmanager
async def _installed(emit: Callable[..., None]) -> AsyncIterator[tuple[Any, Any, Any]]:
    """A worker data plane on a fresh arena, one ingress ring of CAPACITY installed: (plane, lease, ring)."""
    from trio_gpuworker.worker._dataplane import WorkerDataPlane

    with ArenaManager(1 << 20) as arena:
        plane = WorkerDataPlane(1, emit, {}, arena=arena.mmap)
        lease = await arena.lease(CAPACITY)
        ring = arena.init_ring(lease)
        _install(plane, arena, lease)
        try:
            yield plane, lease, ring
        finally:  # a failed assertion surfaces as itself, not as the arena's live lease
            _uninstall(plane, arena, lease, ring)


async def test_one_call_drains_several_chunks_and_posts_each_as_it_ends(small_chunks: None) -> None:
    emitted: list[Any] = []
    async with _installed(emitted.append) as (plane, lease, ring):
        count = CHUNK * CALL_CHUNKS + 2
        objects = [np.full(8 + k, k, np.uint8) for k in range(count)]
        written, _, _ = write_egress_batch(ring, EgressState(ObjectSpec.from_wire(SPEC)),
                                           buffer_records(objects, 100, 0, 0), 0)
        assert written == count
        first = plane.drain(lease.ring_id)
        # the first CALL_CHUNKS - 1 full chunks went out as they ended, the last full one is the call's reply
        assert [len(_rows([m])) for m in emitted if isinstance(m, LoadedBlock)] == [CHUNK] * (CALL_CHUNKS - 1)
        assert {m.T for m in emitted} <= {"LOADED_BLOCK", "RING_WRITABLE"}
        assert len(_rows(first)) == CHUNK and plane.more(lease.ring_id)  # the thread is handed back: more to do
        second = plane.drain(lease.ring_id)
        assert not plane.more(lease.ring_id)
        rows = _rows(emitted) + _rows(first) + _rows(second)
        assert [r[:3] for r in rows] == [[100 + k, k, 8 + k] for k in range(count)]  # stream order, none twice
        for (_, _, extent, handle), data in zip(rows, objects, strict=True):
            obj = plane.objects[handle]
            got = np.empty(extent, np.uint8)
            plane.bridge.device_to_host(obj.alloc, 0, memoryview(got), extent)
            np.testing.assert_array_equal(got, data)


async def test_a_steady_stream_allocates_nothing_once_its_first_lap_is_released(small_chunks: None) -> None:
    emitted: list[Any] = []
    async with _installed(emitted.append) as (plane, lease, ring):
        bridge = plane.bridge
        fresh: list[int] = []
        alloc = bridge.alloc_device
        bridge.alloc_device = lambda n: fresh.append(n) or alloc(n)  # counts the allocations not recycled
        state, data, lap = EgressState(ObjectSpec.from_wire(SPEC)), np.ones(512, np.uint8), 2 * CHUNK + 3
        for k in range(4):
            written, _, _ = write_egress_batch(ring, state, buffer_records([data] * lap, k * lap, k * lap, 0), 0)
            assert written == lap
            notices = plane.drain(lease.ring_id)
            while plane.more(lease.ring_id):
                notices += plane.drain(lease.ring_id)
            rows = _rows(emitted + notices)
            emitted.clear()
            assert [r[0] for r in rows] == list(range(k * lap, (k + 1) * lap))
            if k == 0:
                assert len(fresh) >= lap  # the first lap allocates its destinations
                fresh.clear()
            else:
                assert fresh == []  # later laps land in the buffers the earlier ones released
            for handle in [r[3] for r in rows]:  # as RELEASE_DEVICE_OBJECT does
                bridge.free_device(plane.objects.pop(handle).alloc)


async def test_a_drain_on_the_event_loop_stops_at_its_byte_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    """On the event loop a drain holds the loop, so once it has copied LOOP_DRAIN_BYTES it stops at the next refill
    (the pool has nothing for the next object), with `more` set and nothing posted on the side; the drainer's next
    calls take the rest, in stream order. Objects of two sizes make the pool run dry between native calls."""
    small, large = 4096, 8192
    monkeypatch.setattr(ingress, "LOOP_DRAIN_BYTES", 2 * small)
    emitted: list[Any] = []
    async with _installed(emitted.append) as (plane, lease, ring):
        extents = [small, small, large, large, small, small, large, large]
        objects = [np.full(n, k, np.uint8) for k, n in enumerate(extents)]
        written, _, _ = write_egress_batch(ring, EgressState(ObjectSpec.from_wire(SPEC)),
                                           buffer_records(objects, 0, 0, 0), 0)
        assert written == len(objects)
        first = plane.drain(lease.ring_id, on_loop=True)
        # the two small objects make the budget; the first large one would need a refill: the drain stops there
        assert [r[2] for r in _rows(first)] == [small, small]
        assert plane.more(lease.ring_id) and emitted == []
        notices = first
        while plane.more(lease.ring_id):
            notices += plane.drain(lease.ring_id, on_loop=True)
        rows = _rows(notices)
        assert [r[:3] for r in rows] == [[k, k, n] for k, n in enumerate(extents)]  # all, in order, none twice
        for (_, _, extent, handle), data in zip(rows, objects, strict=True):
            got = np.empty(extent, np.uint8)
            plane.bridge.device_to_host(plane.objects[handle].alloc, 0, memoryview(got), extent)
            np.testing.assert_array_equal(got, data)


async def test_only_a_small_ring_drains_on_the_event_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    async with _installed(lambda *m: None) as (plane, lease, _):
        assert not plane.drains_on_loop(lease.ring_id)  # no bridge yet: making one belongs on the compute thread
        assert plane.bridge.direct  # made, as the first drain (on the compute thread) makes it
        assert plane.drains_on_loop(lease.ring_id)
        monkeypatch.setattr(ingress, "LOOP_DRAIN_BYTES", CAPACITY - 64)  # this ring is now over the limit
        assert not plane.drains_on_loop(lease.ring_id)
        assert not plane.drains_on_loop(lease.ring_id + 1)  # no such ring
