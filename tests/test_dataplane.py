"""The data plane end to end: daemon rings in the shared arena, a real worker process, tinygrad buffers."""

from __future__ import annotations

import os
import signal
import struct
from pathlib import Path

import numpy as np
import pytest
import trio

from cython_ring import RING_VERSION, Ring, encode_header
from tests.support.config import dataplane_config
from tests.support.supervision import SPEC
from trio_gpuworker import (
    ObjectFailed,
    RingFault,
    StaleHandle,
    StepFailed,
    Supervisor,
)
from trio_gpuworker._proto import ExecuteStep, InstallRing, RingReadable


async def test_object_ten_times_the_ring_streams_through_and_echoes_back(tmp_path: Path) -> None:
    async with Supervisor(dataplane_config(tmp_path)) as sup:
        dp = sup.dataplane
        ingress = await dp.install_ring("dp", direction="ingress", capacity=4096, object_spec=SPEC, port_id="in")
        egress = await dp.install_ring("dp", direction="egress", capacity=4096, object_spec=SPEC, port_id="out")
        data = np.random.default_rng(0).standard_normal(10 * 4096 // 4).astype(np.float32)  # 10x the capacity
        handle = await dp.load(ingress, data, object_id=7, sequence=0)
        assert handle["worker_generation"] == sup.lanes["dp"].generation
        await dp.configure_role("dp", "echo-0", {"kind": "echo"})
        got: list[tuple[int, int, np.ndarray]] = []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: _collect(dp, egress, got))
            produced = await dp.execute_step("dp", "echo-0", 1, [{"port_id": "in", "object_id": 7, "sequence": 0,
                                                                  "device_handle": handle}],
                                             [{"port_id": "out", "ring_id": egress.ring_id, "object_id": 70,
                                               "sequence": 0, "extent": data.nbytes}])
        assert [(p["object_id"], p["extent"]) for p in produced] == [(70, data.nbytes)]
        (object_id, sequence, payload), = got
        assert (object_id, sequence) == (70, 0)
        np.testing.assert_array_equal(payload.view(np.float32), data)
        await dp.release_handle("dp", handle)
        with pytest.raises(StepFailed) as info:
            await dp.release_handle("dp", handle)
        assert info.value.code == "invalid_device_handle"
        for end in (ingress, egress):
            await dp.uninstall_ring(end)
        assert sup.arena.live() == []


async def _collect(dp, end, out) -> None:
    out.append(await dp.pull(end))


async def test_linear_role_with_weights_loaded_as_objects(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    x, w, b = (rng.standard_normal(s).astype(np.float32) for s in ((3, 8), (8, 5), (5,)))
    spec = dict(SPEC)
    async with Supervisor(dataplane_config(tmp_path)) as sup:
        dp = sup.dataplane
        rings = {p: await dp.install_ring("dp", direction="ingress", capacity=1024, port_id=p,
                                          object_spec=dict(spec, shape=list(a.shape)))
                 for p, a in (("x", x), ("W", w), ("b", b))}
        handles = {p: await dp.load(rings[p], a, object_id=i, sequence=0)
                   for i, (p, a) in enumerate((("x", x), ("W", w), ("b", b)))}
        out = await dp.install_ring("dp", direction="egress", capacity=1024, object_spec=spec, port_id="y")
        await dp.configure_role("dp", "lin", {"kind": "linear"})
        got: list = []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: _collect(dp, out, got))
            await dp.execute_step("dp", "lin", 1, [{"port_id": p, "object_id": i, "sequence": 0,
                                                    "device_handle": handles[p]} for i, p in enumerate("xWb")],
                                  [{"port_id": "y", "ring_id": out.ring_id, "object_id": 9, "sequence": 0,
                                    "extent": 3 * 5 * 4}], release_inputs_after=True)
        np.testing.assert_allclose(got[0][2].view(np.float32).reshape(3, 5), x @ w + b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("header", "code"), [
    (b"\x00" * 40, "header_malformed"),
    (encode_header(1, 0, (1 << 24) + 4), "extent_exceeds_max"),
    (encode_header(1, 0, 6), "extent_alignment_invalid"),
    (encode_header(1, 5, 8), "sequence_violation"),
])
async def test_bad_objects_fail_before_allocation_and_fault_the_ring(tmp_path: Path, header: bytes, code: str) -> None:
    async with Supervisor(dataplane_config(tmp_path)) as sup:
        dp = sup.dataplane
        end = await dp.install_ring("dp", direction="ingress", capacity=1024, object_spec=SPEC)
        end.ring.write(header)  # bypasses the daemon's own validation on purpose
        await sup.lanes["dp"].notify(end.generation, RingReadable(ring_id=end.ring_id))
        with pytest.raises(ObjectFailed) as info:
            await dp.next_event(end)
        assert info.value.code == code
        with pytest.raises(RingFault):
            await dp.next_event(end)
        # the worker is fine: a fresh ring still works
        ok = await dp.install_ring("dp", direction="ingress", capacity=1024, object_spec=SPEC)
        await dp.load(ok, np.ones(4, np.float32), object_id=1, sequence=0)
        assert sup.lanes["dp"].generation == 1


async def test_eof_mid_object(tmp_path: Path) -> None:
    async with Supervisor(dataplane_config(tmp_path)) as sup:
        dp = sup.dataplane
        end = await dp.install_ring("dp", direction="ingress", capacity=1024, object_spec=SPEC)
        end.ring.write(encode_header(1, 0, 64) + b"\x01" * 16)
        end.ring.close()  # the producer closes the ring in the middle of the payload
        await sup.lanes["dp"].notify(end.generation, RingReadable(ring_id=end.ring_id))
        with pytest.raises(ObjectFailed) as info:
            await dp.next_event(end)
        assert info.value.code == "eof_mid_object"


async def test_crash_mid_object_faults_rings_and_rejects_stale_handles(tmp_path: Path) -> None:
    async with Supervisor(dataplane_config(tmp_path)) as sup:
        dp, lane = sup.dataplane, sup.lanes["dp"]
        events = sup.subscribe()
        small = await dp.install_ring("dp", direction="ingress", capacity=1024, object_spec=SPEC)
        handle = await dp.load(small, np.arange(8, dtype=np.float32), object_id=1, sequence=0)
        slow = await dp.install_ring("dp", direction="ingress", capacity=1024, object_spec=SPEC)
        failures: list[RingFault] = []

        async def push_big() -> None:  # 4 MiB through a 1 KiB ring: still mid-object when the worker dies
            try:
                await dp.push(slow, np.zeros(1 << 20, np.float32), object_id=1, sequence=0)
            except RingFault as exc:
                failures.append(exc)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(push_big)
            await trio.sleep(0.2)
            os.kill(lane.pid, signal.SIGKILL)
        assert [f.code for f in failures] == ["worker_process_exited"]
        with trio.fail_after(30):  # the rings fault as the worker is reaped, before the lane leaves READY
            while lane.generation < 2:  # noqa: ASYNC110
                await trio.sleep(0.01)
        await sup.wait_ready(30)
        assert lane.generation == 2 and sup.arena.live() == []  # leases released once the worker was reaped
        seen = []
        while True:
            try:
                seen.append(events.receive_nowait())
            except trio.WouldBlock:
                break
        faults = {e["ring_id"] for e in seen if e["t"] == "RING_FAULT" and e["reason"] == "worker_process_exited"}
        assert faults == {small.ring_id, slow.ring_id}
        assert any(e["t"] == "WORKER_CRASHED" for e in seen)
        await dp.configure_role("dp", "echo", {"kind": "echo"})
        with pytest.raises(StaleHandle):
            await dp.execute_step("dp", "echo", 1, [{"port_id": "in", "object_id": 1, "sequence": 0,
                                                     "device_handle": handle}], [])
        # a stale handle that reaches the worker anyway is refused there too
        reply = await lane.call(ExecuteStep(role_id="echo", step_id=2, runtime={}, release_inputs_after=False,
                                            outputs=[], inputs=[{"port_id": "in", "object_id": 1, "sequence": 0,
                                                                 "device_handle": handle}]))
        assert reply.T == "STEP_FAILED" and reply.reason == "invalid_input_handle"


async def test_install_ring_rejects_a_bad_layout(tmp_path: Path) -> None:
    async with Supervisor(dataplane_config(tmp_path)) as sup:
        lane = sup.lanes["dp"]
        install = {"ring_id": 99, "edge_id": "e", "port_id": "p", "direction": "ingress",
                   "layout": {"offset": 4096, "header_len": 128, "capacity": 1024}, "object_spec": SPEC}
        reply = await lane.call(InstallRing(**install))  # nothing was written there: a zero magic
        assert reply.T == "RING_FAULT" and reply.reason == "ring_layout_invalid", reply
        assert "magic 0x00000000" in reply.msg
        # the worker reads the daemon's header in place, little-endian: a real one with only its u16 ABI version
        # (offset 4) changed is refused as that version
        Ring.init(sup.arena.mmap, 4096, 99, 1024).release()
        struct.pack_into("<H", sup.arena.mmap, 4096 + 4, RING_VERSION + 1)
        reply = await lane.call(InstallRing(**install))
        assert reply.T == "RING_FAULT" and reply.reason == "unsupported_ring_version", reply
        assert f"version {RING_VERSION + 1}," in reply.msg


async def test_file_pump_streams_a_file_through_a_small_ring(tmp_path: Path) -> None:
    weights = np.random.default_rng(5).standard_normal(50_000).astype(np.float32)  # 200 KB through 4 KiB
    path = tmp_path / "weights.bin"
    path.write_bytes(weights.tobytes())
    async with Supervisor(dataplane_config(tmp_path)) as sup:
        dp = sup.dataplane
        ingress = await dp.install_ring("dp", direction="ingress", capacity=4096, object_spec=SPEC)
        egress = await dp.install_ring("dp", direction="egress", capacity=4096, object_spec=SPEC)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: dp.pump_file(ingress, path, object_id=1, sequence=0))
            loaded = await dp.next_event(ingress)
        assert loaded.extent == weights.nbytes
        await dp.configure_role("dp", "echo", {"kind": "echo"})
        got: list = []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: _collect(dp, egress, got))
            await dp.execute_step("dp", "echo", 1, [{"port_id": "in", "object_id": 1, "sequence": 0,
                                                     "device_handle": loaded.device_handle}],
                                  [{"port_id": "out", "ring_id": egress.ring_id, "object_id": 2, "sequence": 0,
                                    "extent": weights.nbytes}])
        np.testing.assert_array_equal(got[0][2].view(np.float32), weights)
        assert dp.bytes_moved["ingress"] >= weights.nbytes and dp.bytes_moved["egress"] >= weights.nbytes
