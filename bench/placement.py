"""Where the two CPUs a data-plane bench runs on sit relative to each other, measured: the core-to-core round trip
of bench/core_to_core.c (one cache line bounced between two pinned threads). On this VM it reads 50-150 ns while its
two vCPUs share an L3 and 300-400 ns while they do not; the host moves them between the two while the VM runs. A
shared-memory ring's copies and cross-CPU wake-ups go through it (or not), so bench/ring.py, bench/ring_step.py and
bench/ring_ceiling.py print it at the start and the end of a run: compare figures only between runs of one placement.

    .venv/bin/python bench/placement.py
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from _common import compiled_c

SOURCE = Path(__file__).resolve().parent / "core_to_core.c"
ROUNDS, BATCHES = 20_000, 5  # the figure is the fastest batch's mean: a batch a busy machine preempted reads high
NEAR_NS = 200.0  # below: the two CPUs share a last-level cache (this VM: 50-150 ns near, 300-400 ns far)


def core_to_core_ns(rounds: int = ROUNDS, batches: int = BATCHES) -> float | None:
    """Round trip between the first two CPUs this process may use (the lowest of `batches` batch means); None with
    fewer than two, or when the probe cannot be built or run (no clang): the benches print their figures without it."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return None
    try:
        exe = compiled_c(SOURCE)
        return min(float(subprocess.run([str(exe), str(cpus[0]), str(cpus[1]), str(rounds)], check=True,
                                        capture_output=True, text=True, timeout=60).stdout) for _ in range(batches))
    except (OSError, subprocess.SubprocessError):
        return None


def describe(ns: float | None) -> str:
    """'83 ns (a shared L3)': one core_to_core_ns figure and what it says."""
    if ns is None:
        return "not measured (one CPU, or no clang)"
    return f"{ns:.0f} ns ({'a shared L3' if ns < NEAR_NS else 'no shared L3'})"


if __name__ == "__main__":
    print(f"core-to-core round trip: {describe(core_to_core_ns())}")
