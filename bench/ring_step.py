"""Where an EXECUTE_STEP echo round trip's time goes, one 4 KiB object, against a bare trio UDS round trip:

- the step alone, as bench/ring.py times it (EXECUTE_STEP with its output pulled concurrently), on one loaded input
  reused (release_inputs_after false), so no load runs between steps: p50 / p99, and CPU per step of the daemon
  and of the worker (its event loop thread and its other threads apart, from /proc's schedstat);
- the same steps under cProfile in the daemon: Python function calls and event-loop passes (epoll waits) per step;
- baseline in the same run: the bare trio round trip of bench/ring.py (64 bytes to a trio echo child), its p50 /
  p99, and CPU per round trip of each side.

    .venv/bin/python bench/ring_step.py [--steps N]
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import trio
from placement import core_to_core_ns, describe
from ring import RING_CAPACITY, ROOT, SPEC, UDS_ECHO, MiB, page_aligned, percentile, thread_cpu, uds_echo_once

from trio_gpuworker import LaneConfig, Supervisor, SupervisorConfig

SIZE = 4 << 10
EPOLL_WAIT = "<method 'poll' of 'select.epoll' objects>"  # trio's wait for events: one per event-loop pass


async def steps(n: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="gw-step-") as run:
        return await _steps(n, SupervisorConfig(lanes=(LaneConfig("bench", ()),), models=(), state_dir=ROOT / ".state",
                                                runtime_dir=Path(run), arena_bytes=64 * MiB))


async def _steps(n: int, cfg: SupervisorConfig) -> dict[str, float]:
    async with Supervisor(cfg) as sup:
        dp, pid = sup.dataplane, sup.lanes["bench"].pid
        await dp.configure_role("bench", "echo", {"kind": "echo"})
        ingress = await dp.install_ring("bench", direction="ingress", capacity=RING_CAPACITY, object_spec=SPEC)
        egress = await dp.install_ring("bench", direction="egress", capacity=RING_CAPACITY, object_spec=SPEC)
        data = page_aligned(SIZE)
        handle = await dp.load(ingress, data, object_id=0, sequence=0)
        seq = 0

        async def step() -> float:
            nonlocal seq
            t0 = time.perf_counter()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(dp.pull, egress)
                await dp.execute_step("bench", "echo", seq + 1, [{"port_id": "in", "object_id": 0, "sequence": 0,
                                                                  "device_handle": handle}],
                                      [{"port_id": "out", "ring_id": egress.ring_id, "object_id": seq,
                                        "sequence": seq, "extent": SIZE}])
            seq += 1
            return time.perf_counter() - t0

        for _ in range(20):  # the first steps import and warm up
            await step()
        c0, w0 = time.process_time(), thread_cpu(pid)
        times = [await step() for _ in range(n)]
        daemon, worker = (time.process_time() - c0) / n, (thread_cpu(pid) - w0) / n
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(n):
            await step()
        prof.disable()
        stats = pstats.Stats(prof)
        polls = sum(v[1] for (_, _, name), v in stats.stats.items() if name == EPOLL_WAIT)
    return {"p50": percentile(times, 0.5), "p99": percentile(times, 0.99), "daemon": daemon, "loop": worker[0],
            "other": worker[1], "calls": stats.total_calls / n, "polls": polls / n}


def uds(n: int) -> dict[str, float]:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    child = subprocess.Popen([sys.executable, "-c", UDS_ECHO, str(b.fileno())], pass_fds=(b.fileno(),))
    b.close()

    async def run() -> dict[str, float]:
        stream = trio.SocketStream(trio.socket.from_stdlib_socket(a))
        times = []
        async with stream:
            for i in range(-20, n):
                if i == 0:
                    c0, w0 = time.process_time(), thread_cpu(child.pid)
                t = await uds_echo_once(stream)
                if i >= 0:
                    times.append(t)
            mine, child_cpu = (time.process_time() - c0) / n, (thread_cpu(child.pid) - w0).sum() / n
        return {"p50": percentile(times, 0.5), "p99": percentile(times, 0.99), "daemon": mine, "child": child_cpu}

    try:
        return trio.run(run)
    finally:
        a.close()
        child.wait()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=1000)
    args = p.parse_args()
    before = core_to_core_ns()  # the CPUs' placement, at the start and the end (bench/placement.py)
    s = trio.run(steps, args.steps)
    u = uds(args.steps)
    after = core_to_core_ns()
    us = lambda x: f"{x * 1e6:.0f}"  # noqa: E731
    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}; {args.steps} steps of a 4 KiB echo")
    print(f"core-to-core round trip (bench/placement.py): {describe(before)} at the start, "
          f"{describe(after)} at the end")
    print(f"echo step: p50 {us(s['p50'])} us, p99 {us(s['p99'])} us; CPU per step: daemon {us(s['daemon'])} us, "
          f"worker event loop {us(s['loop'])} us, worker other threads {us(s['other'])} us; daemon per step "
          f"(cProfile): {s['calls']:.0f} Python calls, {s['polls']:.1f} event-loop passes")
    print(f"bare trio UDS round trip: p50 {us(u['p50'])} us, p99 {us(u['p99'])} us; CPU per round trip: this side "
          f"{us(u['daemon'])} us, echo child {us(u['child'])} us")
    cpu = (s["daemon"] + s["loop"] + s["other"]) / (u["daemon"] + u["child"])
    print(f"step / UDS: p50 {s['p50'] / u['p50']:.2f}x; CPU {cpu:.2f}x")


if __name__ == "__main__":
    main()
