"""Data-plane throughput, one run, objects of 4 KiB, 64 KiB, 1 MiB and 64 MiB:

- ingress: daemon producer (load_many: batched native writes, one wake hint per burst) -> shared-memory
  ring -> worker DeviceBridge -> tinygrad CPU buffer, timed until the last object is reported loaded
  (completions arrive batched, one OBJECTS_LOADED per worker drain), on device memory recycled from a
  first, untimed lap, as in a running pipeline; the median of INGRESS_LAPS timed laps, the CPU times per
  object averaged over them;
- echo round trip: load, EXECUTE_STEP(echo), pull from the egress ring, one object at a time; its
  throughput, and the p50 / p99 latency of the step alone (EXECUTE_STEP with its output pulled
  concurrently, the input already loaded);
- the native drain alone (bench/ring_native.py's 4 KiB case), for the end-to-end / native ratio;
- where the CPU goes at 4 KiB: the daemon's CPU time and the worker's (its event loop thread and its other
  threads apart, from /proc's schedstat) per ingress object and per echo round;
- baselines measured in the same run: a single-process two-copy memcpy (source -> staging ->
  destination, buffers reused, page-aligned, so in cache up to a few MiB), the same two copies with
  the ingress path's footprint ("cold": staging walks a ring-sized region, each object gets its own
  destination), and the same bytes sent as raw frames on a Unix socket to a child process that
  decodes them with our FrameDecoder; and, for the step latency, a bare trio round trip of a 64-byte
  message over a Unix socket to a trio child process that echoes it (trio at both ends, no protocol).

    .venv/bin/python bench/ring.py [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import mmap
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
os.environ.setdefault("DEV", "CPU")

import numpy as np
import trio
from placement import core_to_core_ns, describe

from trio_gpuworker import LaneConfig, Supervisor, SupervisorConfig
from trio_gpuworker._proto import frame_prefix

KiB, MiB = 1 << 10, 1 << 20
SIZES = (4 * KiB, 64 * KiB, 1 * MiB, 64 * MiB)
RING_CAPACITY = 8 * MiB
L3_LAP, L3_LAPS = 16, 8  # the in-L3 1 MiB ingress: objects per lap, timed laps
INGRESS_LAPS = 5  # timed ingress laps per size: the median lap is the figure
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


UDS_ECHO = """
import socket, sys, trio
async def main():
    s = trio.SocketStream(trio.socket.from_stdlib_socket(socket.socket(fileno=int(sys.argv[1]))))
    while data := await s.receive_some(1 << 16):
        await s.send_all(data)
trio.run(main)
"""


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def uds_echo_once(stream: trio.SocketStream) -> float:
    """Seconds of one 64-byte round trip to the UDS_ECHO child."""
    t0 = time.perf_counter()
    await stream.send_all(b"x" * 64)
    got = 0
    while got < 64:
        got += len(await stream.receive_some(64 - got))
    return time.perf_counter() - t0


def uds_round_trips(n: int) -> list[float]:
    """Seconds per round trip of a 64-byte message to a trio echo process over a Unix socket (after a warm-up)."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    child = subprocess.Popen([sys.executable, "-c", UDS_ECHO, str(b.fileno())], pass_fds=(b.fileno(),))
    b.close()

    async def run() -> list[float]:
        stream = trio.SocketStream(trio.socket.from_stdlib_socket(a))
        samples = []
        async with stream:
            for i in range(-20, n):
                t = await uds_echo_once(stream)
                if i >= 0:
                    samples.append(t)
        return samples

    try:
        return trio.run(run)
    finally:
        a.close()
        child.wait()


def thread_cpu(pid: int | None) -> np.ndarray:
    """CPU seconds so far of the worker's event loop thread (its main thread) and of all its other threads."""
    if pid is None:
        return np.zeros(2)
    out = np.zeros(2)
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{tid}/schedstat") as f:
            out[0 if int(tid) == pid else 1] += int(f.read().split()[0]) / 1e9
    return out


async def ring_paths(sizes: tuple[int, ...], quick: bool) -> dict[Any, Any]:
    """size -> (ingress bytes/s, ingress objects/s, echo round trip bytes/s, daemon CPU s per ingress object,
    seconds of each echo step, each timed lap's objects/s); "cpu" -> the 4 KiB CPU split (seconds: daemon,
    worker loop, worker other threads per ingress object, then the same per echo round)."""
    with tempfile.TemporaryDirectory(prefix="gw-ring-") as run:  # the worker's socket: gone with the run
        return await _ring_paths(sizes, quick, Path(run))


async def _ring_paths(sizes: tuple[int, ...], quick: bool, run: Path) -> dict[Any, Any]:
    cfg = SupervisorConfig(lanes=(LaneConfig("bench", ()),), models=(), state_dir=ROOT / ".state",
                           runtime_dir=run, arena_bytes=256 * MiB)
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
            pid = sup.lanes["bench"].pid
            t_ingress, cpu, w_ingress, laps = await steady_ingress(dp, ingress, data, n, seq, pid)
            seq += (1 + len(laps)) * n  # the untimed lap and the timed ones
            rounds = max(2, n // 4)
            t0, c0, w0 = time.perf_counter(), time.process_time(), thread_cpu(pid)
            steps: list[float] = []
            for i in range(-1, rounds):  # round -1 warms the step path up (first step schedules kernels)
                if i == 0:
                    t0, c0, w0 = time.perf_counter(), time.process_time(), thread_cpu(pid)
                handle = await dp.load(ingress, data, object_id=seq, sequence=seq)
                got: list = []
                t_step = time.perf_counter()
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(lambda: _pull(dp, egress, got))
                    await dp.execute_step("bench", "echo", i + 1, [{"port_id": "in", "object_id": seq,
                                                                    "sequence": seq, "device_handle": handle}],
                                          [{"port_id": "out", "ring_id": egress.ring_id, "object_id": seq,
                                            "sequence": i + 1, "extent": size}], release_inputs_after=True)
                steps.append(time.perf_counter() - t_step)
                seq += 1
            t_echo = time.perf_counter() - t0
            if size == 4 * KiB:
                out["cpu"] = (cpu / n, *(w_ingress / n), (time.process_time() - c0) / rounds,
                              *((thread_cpu(pid) - w0) / rounds))
            assert np.array_equal(got[0][2], data), "echo returned different bytes"
            await dp.uninstall_ring(ingress)
            await dp.uninstall_ring(egress)
            if size == MiB:
                out["l3"] = await ingress_in_l3(dp, data)
            out[size] = (size * n / t_ingress, n / t_ingress, size * rounds / t_echo, cpu / n, steps[1:],
                         [n / t for t in laps])
    return out


async def timed_lap(dp, ingress, data, n: int, first: int) -> tuple[float, float, list[dict]]:
    """Load n objects back to back; wall and daemon CPU seconds to the last completion, and the handles."""
    objects = [data] * n
    t0, c0 = time.perf_counter(), time.process_time()
    handles = await dp.load_many(ingress, objects, first_object_id=first, first_sequence=first)
    return time.perf_counter() - t0, time.process_time() - c0, handles


async def steady_ingress(dp, ingress, data, n: int, first: int, pid: int | None
                         ) -> tuple[float, float, np.ndarray, list[float]]:
    """Ingress once device memory is recycled, as in a running pipeline: a first lap of n objects is loaded
    and released untimed (freed buffers go to the worker's pool), then INGRESS_LAPS laps are timed, each
    released before the next. Returns the median lap's wall seconds (the native drain it is compared with is a
    median too), the daemon's CPU seconds and the worker's (loop, other threads) per lap, averaged over the
    timed laps, and every timed lap's wall seconds (one lap of 4 KiB objects lasts a few ms, so a single lap
    moves with whatever else the machine does). Releases stay outside the timing: a pipeline frees inputs
    with EXECUTE_STEP's release_inputs_after."""
    walls, cpu, worker = [], 0.0, np.zeros(2)
    for lap in range(-1, INGRESS_LAPS):
        w0 = thread_cpu(pid)
        elapsed, c, handles = await timed_lap(dp, ingress, data, n, first + (lap + 1) * n)
        if lap >= 0:
            walls.append(elapsed)
            cpu += c
            worker += thread_cpu(pid) - w0
        for h in handles:
            await dp.release_handle("bench", h)
    return statistics.median(walls), cpu / INGRESS_LAPS, worker / INGRESS_LAPS, walls


async def ingress_in_l3(dp, data) -> float:
    """1 MiB ingress bytes/s with a footprint that fits this CPU's 32 MiB L3: a 2 MiB ring and laps of L3_LAP
    objects released between laps, so the worker's pool hands the same destinations out again (1 + 2 + 16 MiB).
    Only load_many is timed, as in the main lap."""
    ring = await dp.install_ring("bench", direction="ingress", capacity=2 * MiB, object_spec=SPEC)
    elapsed, seq = 0.0, 0  # a fresh ring: sequences start at 0
    for lap in range(-2, L3_LAPS):
        t, _, handles = await timed_lap(dp, ring, data, L3_LAP, seq)
        seq += L3_LAP
        elapsed += t if lap >= 0 else 0.0
        for h in handles:
            await dp.release_handle("bench", h)
    await dp.uninstall_ring(ring)
    return data.nbytes * L3_LAP * L3_LAPS / elapsed


def native_drain_objects_per_s(seconds: float) -> tuple[float, float]:
    """4 KiB objects/s of the native drain with a Python resolver (drain_ingress, the baseline the targets name),
    and of drain_batch into a destination pool (no Python per object)."""
    from ring_native import LoadedRing, timed

    lr = LoadedRing(4 * KiB, 2 * MiB)
    per_object = lr.per_lap / timed(lr.drain, lr.publish, seconds)
    return per_object, lr.per_lap / timed(lr.drain_batch, lr.publish_batch, seconds)


async def _pull(dp, end, got) -> None:
    got.append(await dp.pull(end))


def human(n: int) -> str:
    return f"{n // MiB} MiB" if n >= MiB else f"{n // KiB} KiB"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true", help="fewer bytes per size")
    args = p.parse_args()
    before = core_to_core_ns()  # the CPUs' placement, at the start and the end (bench/placement.py)
    rings = trio.run(ring_paths, SIZES, args.quick)
    uds = uds_round_trips(500 if args.quick else 2000)
    native, batch = native_drain_objects_per_s(0.5 if args.quick else 2.0)
    after = core_to_core_ns()
    print(f"{os.cpu_count()} CPUs; ring capacity {human(RING_CAPACITY)}; GB/s = 1e9 bytes/s")
    print(f"core-to-core round trip (bench/placement.py): {describe(before)} at the start, "
          f"{describe(after)} at the end")
    print(f"{'object':>8} {'memcpy x2':>10} {'x2 cold':>8} {'socket':>8} {'ingress':>8} {'obj/s':>9} "
          f"{'us cpu/obj':>10} {'echo rt':>8} {'step p50':>9} {'step p99':>9} "
          f"{'ingress/memcpy':>15} {'ingress/cold':>13} {'ingress/socket':>15} "
          f"{'echo/memcpy':>12} {'echo/cold':>10}")
    for size in SIZES:
        n = count_for(size, args.quick)
        mem, cold, sock = memcpy_two_copy(size, n), memcpy_two_copy_cold(size, n), socket_frames(size, n)
        ing, objs, echo, cpu, steps, _ = rings[size]
        print(f"{human(size):>8} {mem / 1e9:>10.2f} {cold / 1e9:>8.2f} {sock / 1e9:>8.2f} {ing / 1e9:>8.2f} "
              f"{objs:>9.0f} {cpu * 1e6:>10.2f} {echo / 1e9:>8.2f} {percentile(steps, 0.5) * 1e6:>9.0f} "
              f"{percentile(steps, 0.99) * 1e6:>9.0f} {ing / mem:>14.2f}x {ing / cold:>12.2f}x "
              f"{ing / sock:>14.2f}x {echo / mem:>11.2f}x {echo / cold:>9.2f}x")
    mem1m = memcpy_two_copy(MiB, count_for(MiB, args.quick))
    print(f"1 MiB ingress in L3 (2 MiB ring, {L3_LAP}-object laps on recycled destinations): "
          f"{rings['l3'] / 1e9:.2f} GB/s = {rings['l3'] / mem1m:.2f}x the in-cache two-copy memcpy ({mem1m / 1e9:.2f})")
    objs4k, steps4k, laps4k = rings[4 * KiB][1], rings[4 * KiB][4], rings[4 * KiB][5]
    print(f"native drain, 4 KiB: {native:.0f} objects/s; end to end {objs4k:.0f} objects/s = "
          f"{objs4k / native:.2f}x native, the median of {INGRESS_LAPS} laps (laps in order: "
          f"{', '.join(f'{r / 1e3:.0f} k' for r in laps4k)}; drain_batch into a pool, the worker's CPU path: "
          f"{batch:.0f} objects/s)")
    p50, p99, u50, u99 = (percentile(steps4k, 0.5), percentile(steps4k, 0.99), percentile(uds, 0.5),
                          percentile(uds, 0.99))
    print(f"echo step, 4 KiB: p50 {p50 * 1e6:.0f} us, p99 {p99 * 1e6:.0f} us; bare trio UDS round trip: p50 "
          f"{u50 * 1e6:.0f} us, p99 {u99 * 1e6:.0f} us; step p50 / UDS p50 = {p50 / u50:.2f}x")
    c = [x * 1e6 for x in rings["cpu"]]
    print(f"CPU at 4 KiB, us: per ingress object daemon {c[0]:.2f}, worker event loop {c[1]:.2f}, worker other threads "
          f"{c[2]:.2f}; per echo round (load + step) daemon {c[3]:.0f}, worker event loop {c[4]:.0f}, worker other "
          f"threads {c[5]:.0f}")


if __name__ == "__main__":
    main()
