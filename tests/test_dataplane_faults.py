"""Data-plane defects from the conformance review, each reproduced against a real worker (or, where a device
fault cannot be provoked on CPU, against the worker's data plane in process with one injected fault)."""

from __future__ import annotations

import ctypes
import functools
import os
import signal
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio

from cython_ring import EgressState, ObjectSpec, write_egress
from tests.support.config import dataplane_config
from tests.support.helpers import wait_until
from tests.support.supervision import SPEC
from trio_gpuworker import (
    ObjectFailed,
    RingFault,
    StepFailed,
    Supervisor,
)
from trio_gpuworker._proto import InstallRing, RingReadable
from trio_gpuworker.supervisor import ArenaManager

PROMPT_S = 10.0  # far below the inference window: an answer within it is not a watchdog's doing


def _echo_step(handle: dict[str, int], ring_id: int, extent: int, step_id: int = 1) -> tuple[list, list]:
    return ([{"port_id": "in", "object_id": 1, "sequence": 0, "device_handle": handle}],
            [{"port_id": "out", "ring_id": ring_id, "object_id": 2, "sequence": 0, "extent": extent}])


async def test_uninstall_stops_a_step_blocked_on_its_ring(tmp_path: Path) -> None:
    async with Supervisor(dataplane_config(tmp_path)) as sup:
        dp, lane = sup.dataplane, sup.lanes["dp"]
        ingress = await dp.install_ring("dp", direction="ingress", capacity=4096, object_spec=SPEC, port_id="in")
        egress = await dp.install_ring("dp", direction="egress", capacity=1024, object_spec=SPEC, port_id="out")
        data = np.arange(4096, dtype=np.float32)  # 16x the egress ring, and nobody pulls
        handle = await dp.load(ingress, data, object_id=1, sequence=0)
        await dp.configure_role("dp", "echo", {"kind": "echo"})
        failures: list[StepFailed] = []

        async def step() -> None:
            try:
                await dp.execute_step("dp", "echo", 1, *_echo_step(handle, egress.ring_id, data.nbytes))
            except StepFailed as exc:
                failures.append(exc)

        with trio.fail_after(PROMPT_S):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(step)
                # the step is blocked
                await wait_until(lambda: egress.ring.readable == egress.ring.capacity, within_s=PROMPT_S)
                await dp.uninstall_ring(egress)
        assert [f.code for f in failures] == ["invalid_output_ring"]
        assert egress.released and egress.ring_id not in {le.ring_id for le in sup.arena.live()}
        assert lane.generation == 1 and lane.policy.strikes == 0  # no hang strike, no restart


async def test_pull_raises_when_the_daemon_finds_the_egress_fault(tmp_path: Path) -> None:
    async with Supervisor(dataplane_config(tmp_path)) as sup:
        dp = sup.dataplane
        egress = await dp.install_ring("dp", direction="egress", capacity=1024, object_spec=SPEC)
        egress.ring.write(b"\x00" * 40)  # a malformed header where the worker's first object should be
        with trio.fail_after(PROMPT_S), pytest.raises(RingFault) as info:
            await dp.pull(egress)
        assert info.value.code == "header_malformed"


async def test_a_failed_step_still_releases_its_inputs(tmp_path: Path) -> None:
    async with Supervisor(dataplane_config(tmp_path)) as sup:
        dp = sup.dataplane
        ingress = await dp.install_ring("dp", direction="ingress", capacity=1024, object_spec=SPEC, port_id="in")
        handle = await dp.load(ingress, np.ones(8, np.float32), object_id=1, sequence=0)
        await dp.configure_role("dp", "echo", {"kind": "echo"})
        with pytest.raises(StepFailed) as info:
            await dp.execute_step("dp", "echo", 1, *_echo_step(handle, 9999, 32), release_inputs_after=True)
        assert info.value.code == "invalid_output_ring"
        with pytest.raises(StepFailed) as released:
            await dp.release_handle("dp", handle)
        assert released.value.code == "invalid_device_handle"  # the failed step already freed it


async def test_a_step_that_consumes_its_inputs_frees_them_even_when_its_caller_is_cancelled(tmp_path: Path) -> None:
    """Once written, the worker frees the inputs of a `release_inputs_after` step: a caller cancelled while the step
    runs (an outer cancel scope, not its own deadline) leaves no handle counted live, and the handle is refused;
    the step, still blocked on the ring nobody pulls, keeps its ring until the lane is done with it, so
    uninstalling the ring stops it promptly and the healthy worker is not struck."""
    async with Supervisor(dataplane_config(tmp_path)) as sup:
        dp = sup.dataplane
        ingress = await dp.install_ring("dp", direction="ingress", capacity=4096, object_spec=SPEC, port_id="in")
        egress = await dp.install_ring("dp", direction="egress", capacity=1024, object_spec=SPEC, port_id="out")
        data = np.arange(4096, dtype=np.float32)  # 16x the egress ring, and nobody pulls: the step blocks
        handle = await dp.load(ingress, data, object_id=1, sequence=0)
        await dp.configure_role("dp", "echo", {"kind": "echo"})
        assert dp.steps.handles.count() == 1
        with trio.fail_after(PROMPT_S):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(functools.partial(dp.execute_step, "dp", "echo", 1,
                                                     *_echo_step(handle, egress.ring_id, data.nbytes),
                                                     release_inputs_after=True))
                # written, and blocked
                await wait_until(lambda: egress.ring.readable == egress.ring.capacity, within_s=PROMPT_S)
                nursery.cancel_scope.cancel()
        assert dp.steps.handles.count() == 0
        with pytest.raises(StepFailed) as info:
            await dp.release_handle("dp", handle)
        assert info.value.code == "invalid_device_handle"
        with trio.fail_after(PROMPT_S):  # the step still holds the lane: the uninstall reaches the worker past it
            await dp.uninstall_ring(egress)
        assert egress.released and sup.lanes["dp"].generation == 1 and sup.lanes["dp"].policy.strikes == 0


async def test_an_egress_header_the_ring_refuses_fails_the_step_typed(tmp_path: Path) -> None:
    async with Supervisor(dataplane_config(tmp_path)) as sup:
        dp = sup.dataplane
        ingress = await dp.install_ring("dp", direction="ingress", capacity=1024, object_spec=SPEC, port_id="in")
        egress = await dp.install_ring("dp", direction="egress", capacity=1024, port_id="out",
                                       object_spec=dict(SPEC, max_extent=16))
        handle = await dp.load(ingress, np.ones(16, np.float32), object_id=1, sequence=0)
        await dp.configure_role("dp", "echo", {"kind": "echo"})
        with pytest.raises(StepFailed) as info:
            await dp.execute_step("dp", "echo", 1, *_echo_step(handle, egress.ring_id, 64))
        assert info.value.code == "output_extent_invalid"
        assert sup.lanes["dp"].generation == 1


async def test_step_failed_keeps_the_lanes_strikes(tmp_path: Path) -> None:
    async with Supervisor(dataplane_config(tmp_path)) as sup:
        dp, lane = sup.dataplane, sup.lanes["dp"]
        os.kill(lane.pid, signal.SIGKILL)
        await wait_until(lambda: lane.generation == 2, within_s=PROMPT_S)
        await sup.wait_ready(PROMPT_S)
        assert lane.policy.strikes == 1
        with pytest.raises(StepFailed) as info:
            await dp.execute_step("dp", "missing-role", 1, [], [])
        assert info.value.code == "role_unavailable"
        assert lane.policy.strikes == 1  # a failed reply is not drained serving work


async def test_a_role_id_is_configured_once(tmp_path: Path) -> None:
    async with Supervisor(dataplane_config(tmp_path)) as sup:
        await sup.dataplane.configure_role("dp", "r", {"kind": "echo"})
        with pytest.raises(StepFailed) as info:
            await sup.dataplane.configure_role("dp", "r", {"kind": "linear"})
        assert info.value.code == "worker_rejected_role"


async def test_an_unmappable_arena_is_worker_fatal(tmp_path: Path) -> None:
    bad = {"GPUWORKER_ARENA_FD": "1000", "GPUWORKER_ARENA_BYTES": "4096"}  # no such descriptor in the worker
    async with Supervisor(dataplane_config(tmp_path, env=bad)) as sup:
        events = sup.subscribe()
        with trio.fail_after(PROMPT_S):
            while (event := await events.receive())["t"] != "WORKER_FATAL":
                pass
        assert event["reason"] == "arena_map_failed"


async def test_abort_in_flight_fails_a_blocked_step_at_once(tmp_path: Path) -> None:
    async with Supervisor(dataplane_config(tmp_path)) as sup:
        dp, lane = sup.dataplane, sup.lanes["dp"]
        ingress = await dp.install_ring("dp", direction="ingress", capacity=4096, object_spec=SPEC, port_id="in")
        egress = await dp.install_ring("dp", direction="egress", capacity=1024, object_spec=SPEC, port_id="out")
        data = np.arange(4096, dtype=np.float32)
        handle = await dp.load(ingress, data, object_id=1, sequence=0)
        await dp.configure_role("dp", "echo", {"kind": "echo"})
        failures: list[StepFailed] = []

        async def step() -> None:
            try:
                await dp.execute_step("dp", "echo", 1, *_echo_step(handle, egress.ring_id, data.nbytes))
            except StepFailed as exc:
                failures.append(exc)

        with trio.fail_after(PROMPT_S):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(step)
                await wait_until(lambda: egress.ring.readable == egress.ring.capacity, within_s=PROMPT_S)
                lane.abort_in_flight()  # out of band: the worker must not wait for the step
        assert [f.code for f in failures] == ["worker_shutting_down"]
        await wait_until(lambda: lane.generation == 2, within_s=PROMPT_S)
        await sup.wait_ready(PROMPT_S)
        assert lane.policy.strikes == 0  # an ordered stop, not a fault


async def test_a_batch_with_a_bad_header_loads_the_good_objects_first(tmp_path: Path) -> None:
    async with Supervisor(dataplane_config(tmp_path)) as sup:
        dp = sup.dataplane
        end = await dp.install_ring("dp", direction="ingress", capacity=4096, object_spec=SPEC)
        good = [np.full(16, i, np.float32) for i in range(3)]
        await dp.push_many(end, good, first_object_id=10, first_sequence=0)
        end.ring.write(b"MO01" + b"\x00" * 36)  # then a header with the magic but nothing else right
        await sup.lanes["dp"].notify(end.generation, RingReadable(ring_id=end.ring_id))
        handles = [await dp.next_event(end) for _ in good]
        assert [h.object_id for h in handles] == [10, 11, 12]
        with pytest.raises(ObjectFailed) as info:
            await dp.next_event(end)
        assert info.value.code in ("header_malformed", "unsupported_object_version")
        with pytest.raises(RingFault):
            await dp.next_event(end)


# --- the worker's data plane in process: faults a CPU device cannot produce ------------------------------


def _worker_plane(arena: ArenaManager, bridge: Any = None) -> Any:
    from trio_gpuworker.worker._dataplane import WorkerDataPlane

    return WorkerDataPlane(1, lambda msg: None, {}, arena=arena.mmap, bridge=bridge)


async def _installed(arena: ArenaManager, plane: Any, capacity: int = 4096) -> tuple[Any, Any]:
    lease = await arena.lease(capacity)
    ring = arena.init_ring(lease)
    reply = plane.install_ring(InstallRing(
        req_id=1, ring_id=lease.ring_id, edge_id="e", port_id="p", direction="ingress",
        layout={"offset": lease.offset, "header_len": 128, "capacity": capacity}, object_spec=SPEC))
    assert reply.T == "RING_INSTALLED"
    return lease, ring


@pytest.mark.parametrize("window", [1 << 20, 4], ids=["staged", "streamed"])
async def test_a_device_copy_failure_during_ingress_is_typed_not_fatal(window: int) -> None:
    from trio_gpuworker.worker._bridge import DeviceBridge, DeviceError

    class FailingCopies(DeviceBridge):
        """The generic (non-CPU) path with the device refusing the copy of object 2 (a fault injection)."""

        def host_to_device(self, alloc: Any, offset: int, src: Any, n: int) -> None:
            if alloc.nbytes == 8:
                raise DeviceError("device_copy_failed", "the device refused the copy")
            super().host_to_device(alloc, offset, src, n)

    with ArenaManager(1 << 20) as arena:
        plane = _worker_plane(arena, FailingCopies(generic=True))
        plane.stream_window = window
        lease, ring = await _installed(arena, plane)
        state = EgressState(ObjectSpec.from_wire(SPEC))
        for object_id, data in ((1, np.ones(4, np.float32)), (2, np.ones(2, np.float32))):
            write_egress(ring, state, object_id, object_id - 1, data.ctypes.data, data.nbytes)
        out = plane.drain(lease.ring_id)
        assert [m.T for m in out] == ["OBJECTS_LOADED", "OBJECT_FAILED", "RING_FAULT"]
        assert [row[0] for row in out[0].objects] == [1]
        assert out[1].reason == "device_copy_failed" and out[1].object_id == 2
        assert out[2].reason == "device_copy_failed"
        assert ring.state == 3 and plane.drain(lease.ring_id) == []  # faulted once, reported once
        plane.stop()
        assert plane.rings == {} and plane.objects == {}  # SHUTDOWN: rings quiesced, device objects freed
        ring.release()
        arena.release(lease, _quiesced(lease))


@functools.cache
def _gpu() -> str | None:
    from tinygrad import Device

    for name in ("NV", "CUDA", "AMD"):
        try:
            Device[name]
        except Exception:
            continue
        return name
    return None


@pytest.mark.parametrize("where", ["generic-cpu", pytest.param("gpu", marks=pytest.mark.skipif(
    _gpu() is None, reason="no NV/CUDA/AMD device in this tinygrad install"))])
async def test_a_large_object_streams_into_device_memory_through_a_small_window(where: str) -> None:
    from trio_gpuworker.worker._bridge import DeviceBridge

    bridge = DeviceBridge(_gpu(), generic=True) if where == "gpu" else DeviceBridge(generic=True)
    assert not bridge.direct
    data = np.random.default_rng(3).standard_normal(10_240).astype(np.float32)  # 40 KiB: 10x the ring
    with ArenaManager(1 << 20) as arena:
        plane = _worker_plane(arena, bridge)
        plane.stream_window = 1024  # the only host memory the object may pass through
        lease, ring = await _installed(arena, plane)
        state, out = EgressState(ObjectSpec.from_wire(SPEC)), []
        while True:
            write_egress(ring, state, 1, 0, data.ctypes.data, data.nbytes)
            out += plane.drain(lease.ring_id)
            if not state.busy:
                break
        out += plane.drain(lease.ring_id)
        (row,) = [r for m in out if m.T == "OBJECTS_LOADED" for r in m.objects]
        assert row[:3] == [1, 0, data.nbytes]
        got = np.empty_like(data)
        bridge.device_to_host(plane.objects[row[3]].alloc, 0, memoryview(got).cast("B"), data.nbytes)
        np.testing.assert_array_equal(got, data)
        assert plane.rings[lease.ring_id].window.nbytes == 1024
        plane.stop()
        ring.release()
        arena.release(lease, _quiesced(lease))


async def test_an_unknown_ring_version_is_named_as_such() -> None:
    with ArenaManager(1 << 20) as arena:
        plane = _worker_plane(arena)
        lease = await arena.lease(1024)
        ring = arena.init_ring(lease)
        arena.mmap[lease.offset + 4:lease.offset + 6] = (3).to_bytes(2, "little")
        reply = plane.install_ring(InstallRing(
            req_id=1, ring_id=lease.ring_id, edge_id="e", port_id="p", direction="ingress",
            layout={"offset": lease.offset, "header_len": 128, "capacity": 1024}, object_spec=SPEC))
        assert reply.T == "RING_FAULT" and reply.reason == "unsupported_ring_version"
        ring.release()
        arena.release(lease, _quiesced(lease))


async def test_the_cpu_drain_refills_its_pool_for_a_new_extent_and_types_an_allocation_failure() -> None:
    from trio_gpuworker.worker._bridge import DeviceBridge, DeviceError

    class NoMemoryFor12Floats(DeviceBridge):
        """CPU (direct) allocations that fail for 48-byte objects (a fault injection)."""

        def alloc_mapped_many(self, nbytes: int, k: int) -> Any:
            if nbytes == 48:
                raise DeviceError("device_out_of_memory", "no memory for 48 bytes")
            return super().alloc_mapped_many(nbytes, k)

    with ArenaManager(1 << 20) as arena:
        plane = _worker_plane(arena, NoMemoryFor12Floats())
        lease, ring = await _installed(arena, plane)
        state = EgressState(ObjectSpec.from_wire(SPEC))
        objects = [np.arange(n, dtype=np.float32) + k for k, n in enumerate((4, 4, 8, 12))]
        for k, data in enumerate(objects):
            write_egress(ring, state, 10 + k, k, data.ctypes.data, data.nbytes)
        out = plane.drain(lease.ring_id)
        assert [m.T for m in out] == ["OBJECTS_LOADED", "OBJECT_FAILED", "RING_FAULT"]
        rows = out[0].objects
        assert [row[:3] for row in rows] == [[10, 0, 16], [11, 1, 16], [12, 2, 32]]
        for row, data in zip(rows, objects, strict=False):  # each landed whole in its own pooled allocation
            obj = plane.objects[row[3]]
            assert obj.alloc.nbytes == data.nbytes and obj.shape == (data.size,)
            assert ctypes.string_at(plane.bridge.host_address(obj.alloc), data.nbytes) == data.tobytes()
        assert out[1].reason == "device_allocation_failed" and out[1].object_id == 13
        assert out[2].reason == "device_out_of_memory"
        assert ring.state == 3 and plane.drain(lease.ring_id) == []  # faulted once, reported once
        plane.stop()
        assert plane.rings == {} and plane.objects == {}
        ring.release()
        arena.release(lease, _quiesced(lease))


def _quiesced(lease: Any) -> Any:
    from trio_gpuworker._proto import NeverInstalled

    return NeverInstalled(lease.ring_id)  # no worker process: the in-process plane never held the lease


# --- end to end: random sizes and batches between two real processes, checksummed through echo -------------

BYTES = {"kind": "bytes", "max_extent": 1 << 24, "alignment": 1, "dtype": "uint8", "shape": [],
         "sequence_policy": "strict"}
RING = 4096


@pytest.mark.parametrize("seed", [1, 2])
async def test_random_batches_echo_back_byte_for_byte(tmp_path: Path, seed: int) -> None:
    import hashlib
    import random

    rng = random.Random(seed)
    async with Supervisor(dataplane_config(tmp_path)) as sup:
        dp = sup.dataplane
        ingress = await dp.install_ring("dp", direction="ingress", capacity=RING, object_spec=BYTES, port_id="in")
        egress = await dp.install_ring("dp", direction="egress", capacity=RING, object_spec=BYTES, port_id="out")
        await dp.configure_role("dp", "echo", {"kind": "echo"})
        first, step_id = 0, 0
        for _ in range(4):
            sizes = [rng.choice((1, rng.randint(1, RING), rng.randint(RING, 4 * RING)))
                     for _ in range(rng.randint(1, 12))]
            batch = [np.frombuffer(rng.randbytes(n), np.uint8) for n in sizes]
            handles = await dp.load_many(ingress, batch, first_object_id=first, first_sequence=first)
            echoed: list[tuple[int, int, np.ndarray]] = []
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_pull_n, dp, egress, len(batch), echoed)
                for k, (handle, data) in enumerate(zip(handles, batch, strict=True)):
                    await dp.execute_step("dp", "echo", step_id, [{"port_id": "in", "object_id": first + k,
                                                                   "sequence": first + k, "device_handle": handle}],
                                          [{"port_id": "out", "ring_id": egress.ring_id, "object_id": first + k,
                                            "sequence": step_id, "extent": data.nbytes}], release_inputs_after=True)
                    step_id += 1
            assert [(o, hashlib.sha256(p).hexdigest()) for o, _, p in echoed] == \
                [(first + k, hashlib.sha256(d).hexdigest()) for k, d in enumerate(batch)]
            first += len(batch)
        assert sup.lanes["dp"].generation == 1


async def _pull_n(dp: Any, end: Any, count: int, out: list) -> None:
    while len(out) < count:
        out.extend(await dp.pull_many(end))


async def test_a_burst_longer_than_one_drain_chunk_is_drained_without_more_hints(tmp_path: Path) -> None:
    from trio_gpuworker.worker._ingress import DRAIN_CHUNK

    async with Supervisor(dataplane_config(tmp_path)) as sup:
        dp = sup.dataplane
        end = await dp.install_ring("dp", direction="ingress", capacity=1 << 20, object_spec=BYTES)
        objects = [np.full(8, k % 251, np.uint8) for k in range(3 * DRAIN_CHUNK + 5)]  # one burst, one hint
        with trio.fail_after(PROMPT_S):
            handles = await dp.load_many(end, objects, first_object_id=0, first_sequence=0)
        assert len({h["id"] for h in handles}) == len(objects)


async def test_graceful_shutdown_quiesces_rings_before_worker_stopped(tmp_path: Path) -> None:
    async with Supervisor(dataplane_config(tmp_path)) as sup:
        dp, lane = sup.dataplane, sup.lanes["dp"]
        events = sup.subscribe()
        end = await dp.install_ring("dp", direction="ingress", capacity=1024, object_spec=SPEC)
        await dp.load(end, np.ones(4, np.float32), object_id=1, sequence=0)
        with trio.fail_after(PROMPT_S):
            await lane.reload()  # an ordered restart: SHUTDOWN graceful
        seen = []
        while True:
            try:
                seen.append(events.receive_nowait())
            except trio.WouldBlock:
                break
        assert {"t": "RING_QUIESCED", "ring_id": end.ring_id} in [{k: e.get(k) for k in ("t", "ring_id")}
                                                                    for e in seen]
        assert not any(e["t"] == "RING_FAULT" for e in seen)  # released on its quiescence, not on the reap
        assert end.released and sup.arena.live() == []
