"""Where the two CPUs a data-plane bench runs on sit relative to each other, measured: the core-to-core round trip
of bench/core_to_core.c (one cache line bounced between two pinned threads). On this VM it reads 50-120 ns while its
two vCPUs share an L3 and 300-400 ns while they do not; the host moves them between the two while the VM runs. A
shared-memory ring's copies and cross-CPU wake-ups go through it (or not), so bench/ring.py, bench/ring_step.py and
bench/ring_ceiling.py print it at the start and the end of a run: compare figures only between runs of one placement.

    .venv/bin/python bench/placement.py
"""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

SOURCE = Path(__file__).resolve().parent / "core_to_core.c"
ROUNDS = 100_000
NEAR_NS = 150.0  # below: the two CPUs share a last-level cache (this VM: 50-120 ns near, 300-400 ns far)
_binary: list[Path] = []


def _compiled() -> Path:
    if not _binary:
        tmp = Path(tempfile.mkdtemp(prefix="gw-c2c-"))
        atexit.register(shutil.rmtree, tmp, True)
        exe = tmp / "core_to_core"
        subprocess.run(["clang", "-O2", "-pthread", str(SOURCE), "-o", str(exe)], check=True)
        _binary.append(exe)
    return _binary[0]


def core_to_core_ns(rounds: int = ROUNDS) -> float | None:
    """Mean round trip between the first two CPUs this process may use; None with fewer than two, or when the
    probe cannot be built or run (no clang): the benches print their figures without it."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return None
    try:
        out = subprocess.run([str(_compiled()), str(cpus[0]), str(cpus[1]), str(rounds)], check=True,
                             capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    return float(out.stdout)


def describe(ns: float | None) -> str:
    """'83 ns (a shared L3)': one core_to_core_ns figure and what it says."""
    if ns is None:
        return "not measured (one CPU, or no clang)"
    return f"{ns:.0f} ns ({'a shared L3' if ns < NEAR_NS else 'no shared L3'})"


if __name__ == "__main__":
    print(f"core-to-core round trip: {describe(core_to_core_ns())}")
