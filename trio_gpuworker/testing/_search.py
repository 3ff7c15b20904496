"""Searching seeds, in worker processes ("spawn" pickles what runs there by module, so it lives here), and
shrinking a failing schedule (docs/testing.md, 'Thousands of seeds')."""

from __future__ import annotations

import concurrent.futures
import contextlib
import multiprocessing
import shutil
import tempfile
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path

from ._schedule import Schedule, make_schedule
from ._simulation import Scenario, WorldShape, simulate
from ._world import run_schedule

Setup = Callable[[], AbstractContextManager[object]]  # entered around the runs of each process (a patch to test)
CHUNK = 200  # seeds per task of the process pool


@dataclass(frozen=True)
class _Schedules:
    max_steps: int

    def __call__(self, seed: int, directory: Path) -> list[str]:
        return run_schedule(make_schedule(seed, self.max_steps), directory)


@dataclass(frozen=True)
class _Scenario:
    scenario: Scenario
    shape: WorldShape

    def __call__(self, seed: int, directory: Path) -> list[str]:
        return simulate(self.scenario, seed, self.shape, directory=directory)


Run = Callable[[int, Path], list[str]]


def _chunk(args: tuple[Run, list[int], Setup | None]) -> list[tuple[int, str]]:
    run, seeds, setup = args
    base = Path(tempfile.mkdtemp(prefix="gpuworker-sim-"))
    failing = []
    try:
        with setup() if setup is not None else contextlib.nullcontext():
            for seed in seeds:
                if found := run(seed, base):
                    failing.append((seed, found[0]))
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return failing


def _search(run: Run, seeds: Iterable[int], jobs: int, setup: Setup | None) -> list[tuple[int, str]]:
    order = list(seeds)
    parts = [(run, order[a:a + CHUNK], setup) for a in range(0, len(order), CHUNK)]
    if jobs <= 1:
        return [f for part in parts for f in _chunk(part)]
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=ctx) as pool:
        return [f for found in pool.map(_chunk, parts) for f in found]


def search(scenario: Scenario, seeds: Iterable[int], shape: WorldShape | None = None, *, jobs: int = 1,
           setup: Setup | None = None) -> list[tuple[int, str]]:
    """Run `scenario` once per seed; each failing seed with its first finding. With `jobs` > 1 the seeds are shared
    among that many processes: `scenario` and `setup` must then be importable by name (module-level)."""
    return _search(_Scenario(scenario, shape or WorldShape()), seeds, jobs, setup)


def search_schedules(seeds: Iterable[int], *, max_steps: int = 14, jobs: int = 1,
                     setup: Setup | None = None) -> list[tuple[int, str]]:
    """Each seed's schedule (`make_schedule(seed, max_steps)`) played; each failing seed with its first finding."""
    return _search(_Schedules(max_steps), seeds, jobs, setup)


def shrink(schedule: Schedule, directory: Path) -> Schedule:
    """ddmin over the steps: drop chunks, then single steps, while the schedule still fails."""
    def fails(s: Schedule) -> bool:
        return bool(run_schedule(s, directory))

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


__all__ = ["search", "search_schedules", "shrink"]
