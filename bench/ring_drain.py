"""The worker's CPU ingress drain in process, 4 KiB objects: what its compute thread spends per object once device
memory is recycled, and how much of that is the native drain.

Each lap writes LAP objects into an 8 MiB ingress ring (one batch write, as the daemon's load_many does), drains
them with WorkerDataPlane.drain (256-object calls into pooled device memory, completions as LOADED_BLOCK), then
releases every handle (the pool takes the buffers back for the next lap). Timed apart: the drains, the native
drain_batch calls inside them (wrapped with a timer), and the releases. Medians over the laps; the first laps warm
the pool and are not counted.

    .venv/bin/python bench/ring_drain.py [--laps N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DEV", "CPU")

import numpy as np
import trio

import trio_gpuworker.worker._ingress as ingress
from cython_ring import EgressState, ObjectSpec, buffer_records, write_egress_batch
from trio_gpuworker._proto import InstallRing, NeverInstalled
from trio_gpuworker.supervisor import ArenaManager
from trio_gpuworker.worker._dataplane import WorkerDataPlane

SPEC = {"kind": "bytes", "max_extent": 1 << 30, "alignment": 1, "dtype": "uint8", "shape": [],
        "sequence_policy": "strict"}
CAPACITY, SIZE, LAP = 8 << 20, 4 << 10, 1800
native = [0.0]


def timed_native(fn: Any) -> Any:
    def run(*args: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            native[0] += time.perf_counter() - t0
    return run


async def laps(n: int) -> list[tuple[float, float, float]]:
    """(drain, native drain_batch, release) seconds per object, one row per counted lap."""
    ingress.drain_batch = timed_native(ingress.drain_batch)
    with ArenaManager(64 << 20) as arena:
        posted: list[tuple[Any, ...]] = []  # a long drain call posts each full chunk's completions as it ends
        plane = WorkerDataPlane(1, lambda *m: posted.append(m), {}, arena=arena.mmap)
        lease = await arena.lease(CAPACITY)
        ring = arena.init_ring(lease)
        reply = plane.install_ring(InstallRing(
            req_id=1, ring_id=lease.ring_id, edge_id="e", port_id="p", direction="ingress",
            layout={"offset": lease.offset, "header_len": 128, "capacity": CAPACITY}, object_spec=SPEC,
            loaded_block=True))
        assert reply.T == "RING_INSTALLED", reply
        state, data, seq, out = EgressState(ObjectSpec.from_wire(SPEC)), np.ones(SIZE, np.uint8), 0, []
        for lap in range(-3, n):
            written, _, _ = write_egress_batch(ring, state, buffer_records([data] * LAP, seq, seq, 0), 0)
            assert written == LAP, written
            seq += LAP
            native[0], loaded = 0.0, 0
            t0 = time.perf_counter()
            while True:
                notices = plane.drain(lease.ring_id) + posted
                posted.clear()
                loaded += sum(len(m[2]) // 32 for m in notices if m[0] == "LOADED_BLOCK")
                if not plane.more(lease.ring_id):
                    break
            t1 = time.perf_counter()
            assert loaded == LAP, loaded
            for h in list(plane.objects):
                plane.bridge.free_device(plane.objects.pop(h).alloc)
            if lap >= 0:
                out.append(((t1 - t0) / LAP, native[0] / LAP, (time.perf_counter() - t1) / LAP))
        plane.stop()
        ring.release()
        arena.release(lease, NeverInstalled(lease.ring_id))
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--laps", type=int, default=15)
    args = p.parse_args()
    rows = trio.run(laps, args.laps)
    drain, nat, release = (statistics.median(col) * 1e6 for col in zip(*rows, strict=True))
    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}; {args.laps} laps of {LAP} 4 KiB objects")
    print(f"drain {drain:.2f} us/object, of which native drain_batch {nat:.2f} and Python around it "
          f"{drain - nat:.2f}; release (free_device) {release:.2f} us/object")


if __name__ == "__main__":
    main()
