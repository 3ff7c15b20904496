"""The gpuworker.loaded_block extension: ingress completions as a raw frame of little-endian u64 rows, asked for by
the daemon only of a worker that advertised it; a ring installed without it keeps OBJECTS_LOADED's CBOR rows."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import trio

from cython_ring import EgressState, ObjectSpec, write_egress
from tests.support.config import dataplane_config
from trio_gpuworker import RestartPolicy, Supervisor
from trio_gpuworker._proto import (
    EXT_LOADED_BLOCK,
    InstallRing,
    LoadedBlock,
    NeverInstalled,
    ObjectsLoaded,
    advertised,
    required_extensions,
)
from trio_gpuworker.supervisor import ArenaManager

SPEC = {"kind": "tensor", "max_extent": 1 << 24, "alignment": 4, "dtype": "float32", "shape": [],
        "sequence_policy": "strict"}


def test_only_a_worker_that_advertised_it_is_asked_for_the_block() -> None:
    fields = {"ring_id": 1, "loaded_block": True}
    assert required_extensions("INSTALL_RING", fields) == {EXT_LOADED_BLOCK}
    assert required_extensions("INSTALL_RING", {"ring_id": 1}) == frozenset()


async def test_the_cpu_drain_reports_the_same_rows_in_either_form() -> None:
    from trio_gpuworker.worker._dataplane import WorkerDataPlane

    objects = [np.arange(n, dtype=np.float32) + k for k, n in enumerate((4, 8, 4))]
    with ArenaManager(1 << 20) as arena:
        emitted: list[str] = []
        plane = WorkerDataPlane(1, lambda msg: emitted.append(msg.T), {}, arena=arena.mmap)
        notices: dict[bool, list[Any]] = {}
        for block in (False, True):
            lease = await arena.lease(4096)
            ring = arena.init_ring(lease)
            reply = plane.install_ring(InstallRing(
                req_id=1, ring_id=lease.ring_id, edge_id="e", port_id="p", direction="ingress",
                layout={"offset": lease.offset, "header_len": 128, "capacity": 4096}, object_spec=SPEC,
                loaded_block=True if block else None))
            assert reply.T == "RING_INSTALLED"
            state = EgressState(ObjectSpec.from_wire(SPEC))
            for k, data in enumerate(objects):
                write_egress(ring, state, 10 + k, k, data.ctypes.data, data.nbytes)
            notices[block] = plane.drain(lease.ring_id)
            plane.quiesce(lease.ring_id)
            ring.release()
            arena.release(lease, NeverInstalled(lease.ring_id))
        [loaded], [block] = notices[False], notices[True]
        assert isinstance(loaded, ObjectsLoaded) and isinstance(block, LoadedBlock)
        # consume advanced: RING_WRITABLE went out at once, ahead of the drain's reply
        assert emitted == ["RING_WRITABLE", "RING_WRITABLE"]
        assert [row[:3] for row in loaded.objects] == [[10, 0, 16], [11, 1, 32], [12, 2, 16]]
        rows = np.frombuffer(block.raw, "<u8").reshape(-1, 4)
        assert rows[:, :3].tolist() == [row[:3] for row in loaded.objects]
        assert block.worker_generation == loaded.worker_generation == 1
        for handle_id, data in zip(rows[:, 3].tolist(), objects, strict=True):  # each a live device object
            assert plane.objects[handle_id].shape == (data.size,)
        plane.stop()


async def test_the_daemon_takes_block_rows_from_a_worker_that_advertised_them(tmp_path: Path) -> None:
    cfg = dataplane_config(tmp_path, restart=RestartPolicy())
    async with Supervisor(cfg) as sup:
        lane, dp = sup.lanes["dp"], sup.dataplane
        assert EXT_LOADED_BLOCK in advertised(lane.gens[lane.generation].wp.hello)
        events = sup.subscribe()
        ring = await dp.install_ring("dp", direction="ingress", capacity=4096, object_spec=SPEC)
        data = [np.full(n, n, np.float32) for n in (4, 300, 1000)]  # the last two do not fit the ring together
        handles = await dp.load_many(ring, data, first_object_id=5, first_sequence=0)
        assert [h["worker_generation"] for h in handles] == [lane.generation] * 3
        assert len({h["id"] for h in handles}) == 3 and all(isinstance(h["id"], int) for h in handles)
        assert list(handles) == [handles[k] for k in range(3)] == handles[:] == [*handles[:1], *handles[1:]]
        seen = []
        with trio.fail_after(10):
            while "LOADED_BLOCK" not in seen:
                seen.append((await events.receive())["t"])
        # every completion had arrived before load_many returned: none of them came as CBOR rows
        while True:
            try:
                seen.append(events.receive_nowait()["t"])
            except trio.WouldBlock:
                break
        assert "OBJECTS_LOADED" not in seen and "OBJECT_LOADED" not in seen
        for h in handles:  # live on the daemon's side: each releases once
            await dp.release_handle("dp", h)
