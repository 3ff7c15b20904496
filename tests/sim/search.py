"""Searching seeds (in worker processes: spawn pickles functions by module, so they live here, not in
__main__) and shrinking a failing schedule."""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import shutil
import tempfile
from pathlib import Path

from tests.sim.mutations import mutated
from tests.sim.run import run_schedule
from tests.sim.schedule import Schedule, make_schedule


def _chunk(args: tuple[int, int, int, str | None]) -> list[tuple[int, str]]:
    first, last, steps, mutation = args
    base = Path(tempfile.mkdtemp(prefix="gpuworker-sim-"))
    failing = []
    try:
        with mutated(mutation):
            for seed in range(first, last):
                found = run_schedule(make_schedule(seed, steps), base)
                if found:
                    failing.append((seed, found[0]))
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return failing


def run_seeds(first: int, last: int, *, jobs: int, steps: int, mutation: str | None = None,
              chunk: int = 200) -> list[tuple[int, str]]:
    parts = [(a, min(a + chunk, last), steps, mutation) for a in range(first, last, chunk)]
    if jobs <= 1:
        return [f for part in parts for f in _chunk(part)]
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=ctx) as pool:
        return [f for found in pool.map(_chunk, parts) for f in found]


def shrink(schedule: Schedule, base: Path) -> Schedule:
    """ddmin over the steps: drop chunks, then single steps, while the schedule still fails."""
    def fails(s: Schedule) -> bool:
        return bool(run_schedule(s, base))

    keep, n = list(range(len(schedule.steps))), 2
    while len(keep) >= 2:
        size = -(-len(keep) // n)
        for i in range(0, len(keep), size):
            candidate = keep[:i] + keep[i + size:]
            if fails(schedule.without(candidate)):
                keep, n = candidate, max(n - 1, 2)
                break
        else:
            if n >= len(keep):
                break
            n = min(len(keep), 2 * n)
    return schedule.without(keep)


__all__ = ["run_seeds", "shrink"]
