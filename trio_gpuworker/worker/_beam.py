"""BEAM-tuned kernels at LOAD: tinygrad's kernel search, run for a model's warm-up shapes, at most one worker
at a time per kernel cache, and counted so a worker can say whether it searched or found everything cached.

tinygrad keeps BEAM results in CACHEDB (table beam_search, keyed by the kernel's AST and the beam width), so a
later worker, restart or standby compiling the same kernels reads them instead of searching. A search holds an
exclusive lock beside CACHEDB for one warm-up shape: replicas starting together take turns, and the second finds
the first's results cached. Its wait is bounded by one shape's search, so the LOAD watchdog (renewed by PROGRESS
after each shape) never fires on it; past LOCK_WAIT_S a worker searches anyway rather than wait forever.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from .._config import MAX_BEAM
from .._worker_env import KERNEL_CACHE

LOCK_WAIT_S = 300.0
_POLL_S = 0.25


@dataclass
class BeamStats:
    """What a LOAD's BEAM phase did: kernels searched (each one stored in CACHEDB) and seconds spent."""

    beam: int = 0
    searched: int = 0
    seconds: float = 0.0

    def describe(self) -> str:
        return (f"beam {self.beam}: {self.searched} kernel(s) searched in {self.seconds:.1f}s"
                if self.searched else f"beam {self.beam}: every kernel from the cache ({self.seconds:.1f}s)")


@contextlib.contextmanager
def _counting(stats: BeamStats) -> Iterator[None]:
    """Counts searches: tinygrad's beam_search stores its result (diskcache_put "beam_search") exactly when it
    searched, and returns early on a cache hit. Restored on exit."""
    from tinygrad.codegen.opt import search

    put = search.diskcache_put

    def counted(table: str, key: object, val: object, *a: object, **kw: object) -> object:
        if table == "beam_search":
            stats.searched += 1
        return put(table, key, val, *a, **kw)

    search.diskcache_put = counted
    try:
        yield
    finally:
        search.diskcache_put = put


@contextlib.contextmanager
def _lock(path: Path | None) -> Iterator[None]:
    if path is None:
        yield
        return
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        deadline = time.monotonic() + LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    break  # search without it: duplicate work, never a hung LOAD
                time.sleep(_POLL_S)
        yield
    finally:
        os.close(fd)  # releases the lock


def lock_path() -> Path | None:
    """The lock beside tinygrad's kernel cache (CACHEDB), shared by every worker of one state directory."""
    db = os.environ.get(KERNEL_CACHE)
    return Path(db).with_name(Path(db).name + ".beam.lock") if db else None


@contextlib.contextmanager
def beam_shape(beam: int, stats: BeamStats) -> Iterator[None]:
    """Compile (and capture) one warm-up shape with BEAM=`beam`; a no-op context for beam 0."""
    if not beam:
        yield
        return
    from tinygrad import Context

    t0 = time.monotonic()
    with _lock(lock_path()), _counting(stats), Context(BEAM=beam):
        yield
    stats.seconds += time.monotonic() - t0


def check_beam(value: object) -> int:
    """`beam` from LOAD's runtime_config: 0 (hand-coded kernels) to MAX_BEAM."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_BEAM:
        raise ValueError(f"beam must be an int within 0..{MAX_BEAM}, got {value!r}")
    return value
