"""The float32 multiply-adds per second this host's CPUs can issue at most, measured: bench/fma_peak.c runs
independent FMA chains in registers on one pinned thread per CPU, 256 and 512 bits wide, and the faster width
counts. No float32 kernel on these CPUs can go faster, so a decoder step's multiply-adds over its time, against
this, say how far a step is from the hardware's ceiling (bench/decode_steps.py prints that share).

    .venv/bin/python bench/fma_peak.py
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from _common import compiled_c

SOURCE = Path(__file__).resolve().parent / "fma_peak.c"
ITERATIONS = 20_000_000  # per thread: about 0.2 s of one core at 12 FMAs of 8 lanes per iteration
RUNS = 5  # the figure is the fastest run: a run a busy machine preempted reads low
WIDTHS = (256, 512)


def fma_peak(cpus: list[int], iterations: int = ITERATIONS, runs: int = RUNS) -> float | None:
    """Multiply-adds per second of one thread on each of `cpus` together (the fastest run of the faster width);
    None when the probe cannot be built or run here (no clang, no x86 FMA)."""
    try:
        exe = compiled_c(SOURCE)
    except (OSError, subprocess.SubprocessError):
        return None
    best = None
    for width in WIDTHS:
        for _ in range(runs):
            try:
                done = subprocess.run([str(exe), str(width), str(iterations), *map(str, cpus)], check=True,
                                      capture_output=True, text=True, timeout=120)
            except subprocess.CalledProcessError:
                break  # this CPU lacks the width
            except (OSError, subprocess.SubprocessError):
                return None
            rate = float(done.stdout)
            best = rate if best is None else max(best, rate)
    return best


def first_cpus(n: int) -> list[int]:
    """The first `n` CPUs this process may run on (fewer if it has fewer)."""
    return sorted(os.sched_getaffinity(0))[:n]


def describe(rate: float | None) -> str:
    return "not measured (no clang, or no x86 FMA)" if rate is None else f"{rate / 1e9:.1f} G/s"


if __name__ == "__main__":
    cpus = sorted(os.sched_getaffinity(0))
    print(f"float32 multiply-adds, the most these CPUs issue (bench/fma_peak.c, fastest of {RUNS} runs, 256 and 512 "
          "bits wide):")
    for cpu in cpus:
        print(f"  CPU {cpu} alone: {describe(fma_peak([cpu]))}")
    if len(cpus) > 1:
        print(f"  all {len(cpus)} CPUs together: {describe(fma_peak(cpus))}")
