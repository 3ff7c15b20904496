"""bench/core_to_core.c, the placement probe bench/ring.py, bench/ring_step.py and bench/ring_ceiling.py print: it
measures a round trip, and a CPU it may not run on is refused at once (a thread left unpinned would leave the other
spinning)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

SOURCE = Path(__file__).resolve().parent.parent / "bench" / "core_to_core.c"


@pytest.fixture
def probe(tmp_path: Path) -> Path:
    exe = tmp_path / "core_to_core"
    subprocess.run(["clang", "-O2", "-Wall", "-Werror", "-pthread", str(SOURCE), "-o", str(exe)], check=True)
    return exe


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_round_trip_between_two_cpus(probe: Path) -> None:
    a, b = sorted(os.sched_getaffinity(0))[:2]
    out = subprocess.run([str(probe), str(a), str(b), "20000"], capture_output=True, text=True, timeout=30, check=True)
    ns = float(out.stdout)
    assert 1.0 < ns < 100_000.0  # a cache line between two cores: tens to hundreds of ns, never zero


def test_cpu_outside_the_affinity_is_refused(probe: Path) -> None:
    allowed = os.sched_getaffinity(0)
    outside = next(c for c in range(1024) if c not in allowed)
    for args in ([min(allowed), outside], [outside, min(allowed)]):
        done = subprocess.run([str(probe), *map(str, args), "1000"], capture_output=True, text=True, timeout=10)
        assert done.returncode == 2 and "cannot run on CPU" in done.stderr


def test_bad_arguments_are_refused(probe: Path) -> None:
    for args in ([], ["0", "1"], ["0", "1", "0"], ["-1", "0", "10"], ["x", "0", "10"], ["0", "1x", "10"],
                 ["0", "0", "ten"]):
        done = subprocess.run([str(probe), *args], capture_output=True, text=True, timeout=10)
        assert done.returncode == 2 and done.stderr
