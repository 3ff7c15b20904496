"""Bounded soak: several lanes x many concurrent callers x randomly injected worker faults."""

from __future__ import annotations

import os
import random
from pathlib import Path

import numpy as np
import trio

from tests.fakes import fake_command
from tests.supervision_helpers import MODEL, fake_config
from trio_gpuworker import GpuWorkerError, Supervisor, Windows

LANES, CALLERS, REQUESTS, TIMEOUT_S = 3, 12, 20, 3.0


def children_of(pid: int) -> list[int]:
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                kids.append(int(entry))
    return kids


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def test_soak_with_random_faults(tmp_path: Path) -> None:
    windows = Windows(inference_s=0.5, setup_s=5, control_s=5, load_s=5, kill_grace_s=0.2, shutdown_s=2)
    commands = [fake_command(fault_rate=0.1, seed=lane) for lane in range(LANES)]
    cfg = fake_config(tmp_path, *commands, windows=windows, cooldown_s=0.5, backoff_s=0.02)
    fds_before, kids_before = open_fds(), children_of(os.getpid())
    outcomes: dict[str, int] = {}
    worst = 0.0

    async with Supervisor(cfg) as sup:
        async def caller(c: int) -> None:
            nonlocal worst
            rng = random.Random(c)
            for r in range(REQUESTS):
                # content unique to (caller, request): a reply that reaches the wrong caller cannot match
                rows = [np.full(rng.randint(1, 9), 1000 * c + r + i, dtype=np.int32) for i in range(rng.randint(1, 4))]
                t0 = trio.current_time()
                try:
                    out = await sup.embed_ids(rows, model=MODEL, pooling="mean", normalize=True, timeout=TIMEOUT_S)
                except GpuWorkerError as exc:
                    outcomes[exc.code] = outcomes.get(exc.code, 0) + 1
                else:
                    want = np.array([[row.sum(), len(row), i] for i, row in enumerate(rows)], dtype=np.float32)
                    np.testing.assert_array_equal(out[:, :3], want)
                    outcomes["ok"] = outcomes.get("ok", 0) + 1
                worst = max(worst, trio.current_time() - t0)

        async with trio.open_nursery() as nursery:
            for c in range(CALLERS):
                nursery.start_soon(caller, c)
        crashed = sum(lane.generation - 1 for lane in sup.lanes.values())

    print(outcomes, "restarts:", crashed, "worst:", round(worst, 2))
    assert sum(outcomes.values()) == CALLERS * REQUESTS
    assert outcomes.get("ok", 0) > CALLERS * REQUESTS // 3, outcomes
    assert crashed > 0 and outcomes.get("engine_crashed", 0) > 0, outcomes  # faults really happened
    assert set(outcomes) <= {"ok", "engine_crashed", "deadline_exceeded"}, outcomes
    assert worst <= TIMEOUT_S + 1.0
    assert children_of(os.getpid()) == kids_before
    assert open_fds() == fds_before
    assert list((tmp_path / "run" / "gpuworker" / "workers").iterdir()) == []
