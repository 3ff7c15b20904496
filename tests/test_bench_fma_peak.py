"""bench/fma_peak.c, the float32 multiply-add ceiling bench/decode_steps.py compares its steps with: it reports a
rate, and a width the CPU lacks, a CPU it may not run on or a malformed argument is refused at once."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

import pytest

SOURCE = Path(__file__).resolve().parent.parent / "bench" / "fma_peak.c"

pytestmark = pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 FMA only")


def has_flags(*flags: str) -> bool:
    with open("/proc/cpuinfo") as f:
        words = set(next((line for line in f if line.startswith("flags")), "").split())
    return all(flag in words for flag in flags)


@pytest.fixture
def probe(tmp_path: Path) -> Path:
    exe = tmp_path / "fma_peak"
    subprocess.run(["clang", "-O2", "-Wall", "-Werror", "-pthread", str(SOURCE), "-o", str(exe)], check=True)
    return exe


@pytest.mark.parametrize("width,flags", [(256, ("avx2", "fma")), (512, ("avx512f",))])
def test_a_rate_on_each_cpu_and_on_all(probe: Path, width: int, flags: tuple[str, ...]) -> None:
    if not has_flags(*flags):
        done = subprocess.run([str(probe), str(width), "1000", "0"], capture_output=True, text=True, timeout=30)
        assert done.returncode == 2 and f"no {width}-bit FMA" in done.stderr
        return
    cpus = sorted(os.sched_getaffinity(0))[:2]
    for run_on in ([cpus[0]], cpus):
        out = subprocess.run([str(probe), str(width), "200000", *map(str, run_on)], capture_output=True, text=True,
                             timeout=60, check=True)
        rate = float(out.stdout)
        # a timed rate, whatever the machine: from a starved CI core's 0.1 G/s to far past any core's 100 G/s (zero
        # or infinity would mean the chains were optimised away or not timed)
        assert 1e8 < rate < 1e13


def test_a_cpu_outside_the_affinity_is_refused(probe: Path) -> None:
    allowed = os.sched_getaffinity(0)
    outside = next(c for c in range(1024) if c not in allowed)
    done = subprocess.run([str(probe), "256", "1000", str(min(allowed)), str(outside)], capture_output=True,
                          text=True, timeout=10)
    assert done.returncode == 2 and "cannot run on CPU" in done.stderr


def test_bad_arguments_are_refused(probe: Path) -> None:
    for args in ([], ["256", "1000"], ["128", "1000", "0"], ["256x", "1000", "0"], ["256", "0", "0"],
                 ["256", "ten", "0"], ["256", "1000", "x"], ["256", "1000", "-1"]):
        done = subprocess.run([str(probe), *args], capture_output=True, text=True, timeout=10)
        assert done.returncode == 2 and done.stderr
