"""The ceiling of ingress between two processes on this machine: what the native halves of the data plane alone
reach, with no protocol, no wake-up messages and no event loop, against the in-cache two-copy memcpy of
bench/ring.py, measured in the same run.

A forked child consumes with drain_batch into a few recycled destinations; the parent produces with
write_egress_batch from one reused source buffer; both share one anonymous mapping (the ring header and data) and
spin with sched_yield while the ring is full or empty, so no wake-up cost is counted (the daemon blocks on the
socket instead: a wake-up across CPUs costs ~40 us here). Footprints: the ring's capacity plus `--dests`
destinations of the object's size plus the source. With a 2 MiB ring and 2 destinations the 1 MiB case keeps
both copies within L3; with an 8 MiB ring it is bench/ring.py's ingress ring. `--case RING_MIB:DESTS` (repeatable)
measures other footprints instead. bench/ring.py's objects stay loaded until their lap ends, and its drain keeps up to
a ring's worth of spares, so its main 1 MiB row (laps of 64 objects with --quick, 192 without, on an 8 MiB ring)
cycles through about 72 destinations (200), and its "in L3" row (16-object laps, 2 MiB ring) through about 18.

    .venv/bin/python bench/ring_ceiling.py [--seconds 2] [--size 1048576] [--case 2:18 --case 8:72]
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import numpy as np
from placement import core_to_core_ns, describe
from ring import memcpy_two_copy, page_aligned

from cython_ring import (
    Completions,
    DestPool,
    EgressState,
    IngressState,
    ObjectSpec,
    Ring,
    buffer_records,
    drain_batch,
    write_egress_batch,
)

MiB = 1 << 20
LAP = 64  # objects the producer hands write_egress_batch at once (their records are reused lap after lap)


def consume(arena: mmap.mmap, size: int, n: int, dests: int, report: int) -> None:
    """The child: drain n objects of `size` bytes into `dests` recycled destinations, then write the seconds from
    the first object to the last to `report` (a pipe)."""
    ring = Ring.attach(arena, 0, 1)
    state, spec = IngressState(), ObjectSpec("tensor", size, 8, "uint8", (size,))
    pool, batch = DestPool(exact=True), Completions()
    slab = page_aligned(size * dests)
    slab[:] = 0  # fault the destinations in before timing
    addresses = np.arange(slab.ctypes.data, slab.ctypes.data + size * dests, size, dtype=np.uint64)
    pool.put_many(addresses, size)
    got, t0, nxt = 0, 0.0, 0
    while got < n:
        loaded = drain_batch(ring, state, spec, pool, batch)
        if loaded:
            if not got:
                t0 = time.perf_counter()
            got += loaded
            # the completed objects took the oldest destinations: hand exactly those back, in the same order
            back = np.take(addresses, np.arange(nxt, nxt + loaded) % dests)
            pool.put_many(back, size)
            nxt += loaded
        else:
            os.sched_yield()
    os.write(report, f"{time.perf_counter() - t0} {got}".encode())


def produce(arena: mmap.mmap, size: int, n: int) -> None:
    ring = Ring.attach(arena, 0, 1)
    state = EgressState(ObjectSpec("tensor", size, 8, "uint8", (size,)))
    src = page_aligned(size)
    src[:] = 7
    sent = 0
    while sent < n:
        lap = min(LAP, n - sent)
        records = buffer_records([src] * lap, sent, sent)
        i = 0
        while i < lap:
            i, moved, _ = write_egress_batch(ring, state, records, i)
            if not moved:
                os.sched_yield()
        sent += lap


def two_process(size: int, capacity: int, dests: int, seconds: float) -> float:
    """Bytes/s from the first object the consumer finished to the last, for about `seconds` of traffic."""
    per_s = memcpy_two_copy(size, max(4, int(2e8) // size)) / size  # a guess of the rate, to size the run
    n = max(8, int(per_s * seconds / 2))
    arena = mmap.mmap(-1, 128 + capacity)
    Ring.init(arena, 0, 1, capacity).release()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child runs the consumer and nothing else
        try:
            os.close(r)
            consume(arena, size, n, dests, w)
        finally:
            os._exit(0)
    os.close(w)
    try:
        produce(arena, size, n)
        elapsed, got = os.read(r, 64).decode().split()
    finally:
        os.close(r)
        os.waitpid(pid, 0)
    return size * (int(got) - 1) / float(elapsed)  # the first object starts the clock


def footprint(text: str) -> tuple[int, int]:
    """`--case`: "RING_MIB:DESTS" as (ring bytes, destinations)."""
    try:
        ring, dests = (int(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not RING_MIB:DESTS, e.g. 8:24") from None
    if ring < 1 or dests < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: the ring and the destinations must be at least 1")
    return ring * MiB, dests


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=2.0, help="traffic per case")
    p.add_argument("--size", type=int, default=MiB, help="object bytes")
    p.add_argument("--rounds", type=int, default=3, help="runs per case; the median is printed")
    p.add_argument("--case", action="append", type=footprint, metavar="RING_MIB:DESTS",
                   help="a ring size in MiB and a count of recycled destinations (default 2:2, 8:2 and 8:16)")
    args = p.parse_args()
    size = args.size
    cases = args.case or [(2 * MiB, 2), (8 * MiB, 2), (8 * MiB, 16)]
    print(f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}; objects of {size >> 10} KiB; "
          f"GB/s = 1e9 bytes/s; median of {args.rounds} round(s)")
    print(f"core-to-core round trip (bench/placement.py) at the start: {describe(core_to_core_ns())}")
    mem = [memcpy_two_copy(size, max(4, int(2e9) // size)) for _ in range(args.rounds)]
    print(f"in-cache two-copy memcpy, one process: {statistics.median(mem) / 1e9:.2f} GB/s")
    for capacity, dests in cases:
        rates = [two_process(size, capacity, dests, args.seconds) for _ in range(args.rounds)]
        rate = statistics.median(rates)
        print(f"two processes, native halves only, ring {capacity >> 20} MiB, {dests} destinations: "
              f"{rate / 1e9:.2f} GB/s = {rate / statistics.median(mem):.2f}x the memcpy "
              f"(rounds {', '.join(f'{x / 1e9:.2f}' for x in rates)})")
    print(f"load average {os.getloadavg()[0]:.2f} at the end; core-to-core round trip {describe(core_to_core_ns())}")


if __name__ == "__main__":
    main()
