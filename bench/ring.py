"""Data-plane throughput, one run, objects of 4 KiB, 64 KiB, 1 MiB and 64 MiB:

- ingress: daemon producer (load_many: batched native writes, one wake hint per burst) -> shared-memory
  ring -> worker DeviceBridge -> tinygrad CPU buffer, timed until the last object is reported loaded
  (completions arrive batched, one OBJECTS_LOADED per worker drain), on device memory recycled from a
  first, untimed lap, as in a running pipeline; the daemon's CPU time per object is taken over the lap;
- echo round trip: load, EXECUTE_STEP(echo), pull from the egress ring, one object at a time;
- the native drain alone (bench/ring_native.py's 4 KiB case), for the end-to-end / native ratio;
- baselines measured in the same run: a single-process two-copy memcpy (source -> staging ->
  destination, buffers reused, page-aligned, so in cache up to a few MiB), the same two copies with
  the ingress path's footprint ("cold": staging walks a ring-sized region, each object gets its own
  destination), and the same bytes sent as raw frames on a Unix socket to a child process that
  decodes them with our FrameDecoder.

    .venv/bin/python bench/ring.py [--quick]
"""

from __future__ import annotations

import argparse
import mmap
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
os.environ.setdefault("DEV", "CPU")

import numpy as np
import trio

from trio_gpuworker import LaneConfig, Supervisor, SupervisorConfig
from trio_gpuworker._proto import frame_prefix

KiB, MiB = 1 << 10, 1 << 20
SIZES = (4 * KiB, 64 * KiB, 1 * MiB, 64 * MiB)
RING_CAPACITY = 8 * MiB
SPEC = {"kind": "bytes", "max_extent": 1 << 30, "alignment": 1, "dtype": "uint8", "shape": [],
        "sequence_policy": "strict"}
FRAME_READER = """
import os, socket, sys
sys.path.insert(0, sys.argv[1])
from trio_gpuworker._proto import FrameDecoder
s = socket.socket(fileno=int(sys.argv[2])); dec = FrameDecoder(1 << 30); n = int(sys.argv[3]); seen = 0
while True:
    data = s.recv(1 << 20)
    if not data: break
    dec.feed(data)
    while (f := dec.next_frame()) is not None:
        seen += 1
        if seen in (1, n + 1): s.sendall(b"k")  # one ack after the warm-up frame, one after the lot
"""


def count_for(size: int, quick: bool) -> int:
    total = (64 if quick else 192) * MiB  # one lap must fit the worker's recycled-buffer pool (256 MiB)
    return max(2, min(2000, total // size))


def page_aligned(n: int) -> np.ndarray:
    return np.frombuffer(mmap.mmap(-1, max(n, 1)), np.uint8)[:n]


def memcpy_two_copy(size: int, n: int) -> float:
    src, staging, dst = page_aligned(size), page_aligned(size), page_aligned(size)
    src[:] = 7
    np.copyto(staging, src)
    np.copyto(dst, staging)
    t0 = time.perf_counter()
    for _ in range(n):
        np.copyto(staging, src)
        np.copyto(dst, staging)
    return size * n / (time.perf_counter() - t0)


def memcpy_two_copy_cold(size: int, n: int) -> float:
    """The same two copies with the ingress path's memory footprint: staging walks a ring-sized region and
    every object lands in its own destination (the lap's device buffers), so neither fits in cache."""
    src = page_aligned(size)
    src[:] = 7
    staging, dst = page_aligned(max(RING_CAPACITY, size)), page_aligned(size * n)
    dst[:] = 0
    slots = max(1, staging.nbytes // size)
    t0 = time.perf_counter()
    for i in range(n):
        k = (i % slots) * size
        np.copyto(staging[k:k + size], src)
        np.copyto(dst[i * size:(i + 1) * size], staging[k:k + size])
    return size * n / (time.perf_counter() - t0)


def socket_frames(size: int, n: int) -> float:
    """The same bytes as raw control-socket frames to another process that decodes every frame."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    child = subprocess.Popen([sys.executable, "-c", FRAME_READER, str(ROOT), str(b.fileno()), str(n)],
                             pass_fds=(b.fileno(),))
    b.close()
    payload = page_aligned(size)
    prefix = frame_prefix(size, 1 << 30)
    a.sendall(prefix + payload.tobytes())
    a.recv(1)
    t0 = time.perf_counter()
    for _ in range(n):
        a.sendall(prefix)
        a.sendall(payload)
    a.recv(1)
    rate = size * n / (time.perf_counter() - t0)
    a.close()
    child.wait()
    return rate


async def ring_paths(sizes: tuple[int, ...], quick: bool) -> dict[int, tuple[float, float, float, float]]:
    """size -> (ingress bytes/s, ingress objects/s, echo round trip bytes/s, daemon CPU s per ingress object)."""
    cfg = SupervisorConfig(lanes=(LaneConfig("bench", ()),), models=(), state_dir=ROOT / ".state",
                           runtime_dir=Path(tempfile.mkdtemp(prefix="gw-ring-")), arena_bytes=256 * MiB)
    out = {}
    async with Supervisor(cfg) as sup:
        dp = sup.dataplane
        await dp.configure_role("bench", "echo", {"kind": "echo"})
        for size in sizes:
            n = count_for(size, quick)
            ingress = await dp.install_ring("bench", direction="ingress", capacity=RING_CAPACITY, object_spec=SPEC)
            egress = await dp.install_ring("bench", direction="egress", capacity=RING_CAPACITY, object_spec=SPEC)
            data = page_aligned(size)
            data[:] = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
            seq = 0
            await dp.release_handle("bench", await dp.load(ingress, data, object_id=0, sequence=seq))  # warm
            seq += 1
            t_ingress, cpu = await steady_ingress(dp, ingress, data, n, seq)
            seq += 2 * n
            rounds = max(2, n // 4)
            t0 = time.perf_counter()
            for i in range(-1, rounds):  # round -1 warms the step path up (first step schedules kernels)
                if i == 0:
                    t0 = time.perf_counter()
                handle = await dp.load(ingress, data, object_id=seq, sequence=seq)
                got: list = []
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(lambda: _pull(dp, egress, got))
                    await dp.execute_step("bench", "echo", i + 1, [{"port_id": "in", "object_id": seq,
                                                                    "sequence": seq, "device_handle": handle}],
                                          [{"port_id": "out", "ring_id": egress.ring_id, "object_id": seq,
                                            "sequence": i + 1, "extent": size}], release_inputs_after=True)
                seq += 1
            t_echo = time.perf_counter() - t0
            assert np.array_equal(got[0][2], data), "echo returned different bytes"
            await dp.uninstall_ring(ingress)
            await dp.uninstall_ring(egress)
            out[size] = (size * n / t_ingress, n / t_ingress, size * rounds / t_echo, cpu / n)
    return out


async def timed_lap(dp, ingress, data, n: int, first: int) -> tuple[float, float, list[dict]]:
    """Load n objects back to back; wall and daemon CPU seconds to the last completion, and the handles."""
    objects = [data] * n
    t0, c0 = time.perf_counter(), time.process_time()
    handles = await dp.load_many(ingress, objects, first_object_id=first, first_sequence=first)
    return time.perf_counter() - t0, time.process_time() - c0, handles


async def steady_ingress(dp, ingress, data, n: int, first: int) -> tuple[float, float]:
    """Ingress once device memory is recycled, as in a running pipeline: a first lap of n objects is loaded
    and released untimed (freed buffers go to the worker's pool), then a second lap is timed. Releases
    stay outside the timing: a pipeline frees inputs with EXECUTE_STEP's release_inputs_after."""
    _, _, handles = await timed_lap(dp, ingress, data, n, first)
    for h in handles:
        await dp.release_handle("bench", h)
    elapsed, cpu, handles = await timed_lap(dp, ingress, data, n, first + n)
    for h in handles:
        await dp.release_handle("bench", h)
    return elapsed, cpu


def native_drain_objects_per_s(seconds: float) -> float:
    from ring_native import LoadedRing, timed

    lr = LoadedRing(4 * KiB, 2 * MiB)
    return lr.per_lap / timed(lr.drain, lr.publish, seconds)


async def _pull(dp, end, got) -> None:
    got.append(await dp.pull(end))


def human(n: int) -> str:
    return f"{n // MiB} MiB" if n >= MiB else f"{n // KiB} KiB"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true", help="fewer bytes per size")
    args = p.parse_args()
    rings = trio.run(ring_paths, SIZES, args.quick)
    native = native_drain_objects_per_s(0.5 if args.quick else 2.0)
    print(f"{os.cpu_count()} CPUs; ring capacity {human(RING_CAPACITY)}; GB/s = 1e9 bytes/s")
    print(f"{'object':>8} {'memcpy x2':>10} {'x2 cold':>8} {'socket':>8} {'ingress':>8} {'obj/s':>9} "
          f"{'us cpu/obj':>10} {'echo rt':>8} {'ingress/memcpy':>15} {'ingress/cold':>13} {'ingress/socket':>15} "
          f"{'echo/memcpy':>12} {'echo/cold':>10}")
    for size in SIZES:
        n = count_for(size, args.quick)
        mem, cold, sock = memcpy_two_copy(size, n), memcpy_two_copy_cold(size, n), socket_frames(size, n)
        ing, objs, echo, cpu = rings[size]
        print(f"{human(size):>8} {mem / 1e9:>10.2f} {cold / 1e9:>8.2f} {sock / 1e9:>8.2f} {ing / 1e9:>8.2f} "
              f"{objs:>9.0f} {cpu * 1e6:>10.2f} {echo / 1e9:>8.2f} {ing / mem:>14.2f}x {ing / cold:>12.2f}x "
              f"{ing / sock:>14.2f}x {echo / mem:>11.2f}x {echo / cold:>9.2f}x")
    objs4k = rings[4 * KiB][1]
    print(f"native drain, 4 KiB: {native:.0f} objects/s; end to end {objs4k:.0f} objects/s = "
          f"{objs4k / native:.2f}x native")


if __name__ == "__main__":
    main()
