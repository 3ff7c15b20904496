"""Native ingress drain alone (parse + validate + copy + events) against memcpy baselines, one run.

4 KiB objects: objects/s of drain_ingress (target >= 1M/s) against the same payload bytes moved by
a plain two-copy memcpy (source -> staging -> destination). 1 MiB objects: GB/s of drain_ingress
against the two-copy and one-copy memcpy. Every buffer is reused and page-aligned; the ring is
filled once and re-published each lap (only the sequence numbers change), outside the timing.
"""

from __future__ import annotations

import argparse
import ctypes
import math
import mmap
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np
from _common import table

from cython_ring import (
    HEADER_LEN,
    Completions,
    DestPool,
    IngressState,
    ObjectSpec,
    Ring,
    drain_batch,
    drain_ingress,
    encode_header,
)

TARGET_OBJECTS_PER_S = 1_000_000


def page_aligned(n: int) -> np.ndarray:
    return np.frombuffer(mmap.mmap(-1, n), np.uint8)


def timed(fn: Callable[[], None], prepare: Callable[[], None], seconds: float) -> float:
    """Median seconds per call of fn over about `seconds`, running prepare (untimed) before each."""
    samples: list[float] = []
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline or len(samples) < 5:
        prepare()
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


class LoadedRing:
    """A ring holding `per_lap` back-to-back records; capacity is a multiple of the record size so
    every lap lays the records out at the same places and only their sequence fields change."""

    def __init__(self, extent: int, min_capacity: int) -> None:
        record = HEADER_LEN + extent
        unit = math.lcm(64, record)
        self.capacity = unit * max(1, min_capacity // unit)
        self.per_lap = self.capacity // record
        self.extent = extent
        self.arena = mmap.mmap(-1, 128 + self.capacity)
        self.ring = Ring.init(self.arena, 0, 1, self.capacity)
        data = np.frombuffer(self.arena, np.uint8, self.capacity, 128)
        pattern = np.random.default_rng(1).integers(0, 256, extent, dtype=np.uint8)
        for i in range(self.per_lap):
            data[i * record:i * record + HEADER_LEN] = np.frombuffer(encode_header(i, i, extent), np.uint8)
            data[i * record + HEADER_LEN:(i + 1) * record] = pattern
        self.sequences = data.view(np.uint64)[2::record // 8][:self.per_lap]
        self.state = IngressState()
        self.spec = ObjectSpec("tensor", extent, 8, "uint8", (extent,))
        self.dst = page_aligned(extent)
        target = (self.dst.ctypes.data, extent)
        self.resolver = lambda object_id, sequence, extent: target
        self.pool, self.batch = DestPool(exact=True), Completions()
        self.addresses = np.full(self.per_lap, self.dst.ctypes.data, np.uint64)
        self.laps = 0

    def publish(self) -> None:
        self.sequences[:] = np.arange(self.laps * self.per_lap, (self.laps + 1) * self.per_lap, dtype=np.uint64)
        self.laps += 1
        self.ring.clear_writable()  # as the producer would, so each drain also pays for its hint
        self.ring.advance_commit(self.capacity)

    def publish_batch(self) -> None:
        """publish, and one destination per record in the pool drain_batch takes them from."""
        self.publish()
        self.pool.clear()
        self.pool.put_many(self.addresses, self.extent)

    def drain_batch(self) -> None:
        assert drain_batch(self.ring, self.state, self.spec, self.pool, self.batch) == self.per_lap, self.batch

    def drain(self) -> None:
        events = drain_ingress(self.ring, self.state, self.spec, self.resolver)
        assert len(events) == 2 * self.per_lap + 1 and events[-2][0] == "loaded", events[-3:]


def two_copy(src: np.ndarray, staging: np.ndarray, dst: np.ndarray, n: int) -> Callable[[], None]:
    """Stream src in n-byte pieces through one reused staging buffer into one reused destination."""
    s, m, d = src.ctypes.data, staging.ctypes.data, dst.ctypes.data

    def run() -> None:
        for off in range(0, src.nbytes, n):
            ctypes.memmove(m, s + off, n)
            ctypes.memmove(d, m, n)
    return run


def one_copy(src: np.ndarray, dst: np.ndarray, n: int) -> Callable[[], None]:
    s, d = src.ctypes.data, dst.ctypes.data

    def run() -> None:
        for off in range(0, src.nbytes, n):
            ctypes.memmove(d, s + off, n)
    return run


def small_objects(seconds: float) -> str:
    lr = LoadedRing(4096, 2 << 20)
    per_drain = timed(lr.drain, lr.publish, seconds)
    # One bulk copy per leg: the cheapest the two-copy path could ever be at this size.
    lap_bytes = lr.per_lap * lr.extent
    src, staging, dst = page_aligned(lap_bytes), page_aligned(lap_bytes), page_aligned(lap_bytes)
    src[:] = 1
    bulk = timed(two_copy(src, staging, dst, lap_bytes), lambda: None, seconds)
    rows = [("two-copy memcpy of the same payload bytes", lr.per_lap / bulk, "objects/s"),
            ("drain_ingress, 4 KiB objects", lr.per_lap / per_drain, "objects/s"),
            ("target", TARGET_OBJECTS_PER_S, "objects/s")]
    note = (f"drain: {lr.per_lap} objects per call, {per_drain / lr.per_lap * 1e9:.0f} ns per object; "
            f"{lr.per_lap / per_drain / TARGET_OBJECTS_PER_S:.2f}x the 1M objects/s target")
    return table(f"4 KiB objects (ring of {lr.capacity >> 10} KiB)", rows,
                 "two-copy memcpy of the same payload bytes") + "\n" + note


def large_objects(seconds: float) -> str:
    extent = 1 << 20
    lr = LoadedRing(extent, 8 << 20)
    per_drain = timed(lr.drain, lr.publish, seconds)
    # The baselines read as many distinct source bytes per lap as the drain reads from the ring.
    src, staging, dst = page_aligned(lr.per_lap * extent), page_aligned(extent), page_aligned(extent)
    src[:] = 1  # fault the pages in before timing
    two = timed(two_copy(src, staging, dst, extent), lambda: None, seconds)
    one = timed(one_copy(src, dst, extent), lambda: None, seconds)
    lap_gb = lr.per_lap * extent / 1e9
    rows = [("two-copy memcpy (src -> staging -> dst)", lap_gb / two, "GB/s"),
            ("one-copy memcpy (src -> dst)", lap_gb / one, "GB/s"),
            ("drain_ingress, 1 MiB objects", lap_gb / per_drain, "GB/s")]
    return table(f"1 MiB objects (ring of {lr.capacity >> 20} MiB)", rows,
                 "two-copy memcpy (src -> staging -> dst)")


def aliasing(seconds: float) -> str:
    """The 4K-aliasing question: does a copy whose source sits a few bytes past its destination modulo 4096
    (an MO01 payload 40 bytes after its header, into a page-aligned device buffer) run slower than an
    aligned one? Median GB/s over interleaved rounds, in cache (1 MiB) and out of cache (64 MiB)."""
    offsets = ((0, 0), (40, 0), (168, 0), (0, 40), (64, 0))
    lines = ["4K aliasing: memmove GB/s by (source, destination) offset from a page, median of rounds"]
    for size in (1 << 20, 64 << 20):
        src, dst = page_aligned(size + 8192), page_aligned(size + 8192)
        src[:] = 1
        dst[:] = 2
        samples: dict[tuple[int, int], list[float]] = {o: [] for o in offsets}
        reps = max(1, int(2e8) // size)
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline or len(samples[offsets[-1]]) < 3:
            for so, do in offsets:
                s, d = src.ctypes.data + so, dst.ctypes.data + do
                t0 = time.perf_counter()
                for _ in range(reps):
                    ctypes.memmove(d, s, size)
                samples[(so, do)].append(size * reps / (time.perf_counter() - t0) / 1e9)
        base = statistics.median(samples[(0, 0)])
        lines.append(f"  {size >> 20} MiB: " + ", ".join(
            f"src+{so}/dst+{do} {statistics.median(v):.1f} ({statistics.median(v) / base:.2f}x)"
            for (so, do), v in samples.items()))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=2.0, help="time spent per measured path")
    parser.add_argument("--aliasing", action="store_true", help="also measure the 4K-aliasing cost of copies")
    args = parser.parse_args()
    print(small_objects(args.seconds))
    print()
    print(large_objects(args.seconds))
    if args.aliasing:
        print()
        print(aliasing(args.seconds))


if __name__ == "__main__":
    main()
