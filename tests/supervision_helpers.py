"""Builders shared by the supervisor tests that drive scripted fake workers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import trio

from trio_gpuworker import (
    LaneConfig,
    LaneState,
    ModelConfig,
    QuarantinePolicy,
    RestartPolicy,
    SupervisorConfig,
    Windows,
)
from trio_gpuworker.supervisor import Lane

FAST = Windows(inference_s=2.0, setup_s=5.0, control_s=5.0, load_s=5.0, kill_grace_s=0.5, shutdown_s=2.0)
MODEL = "fake-embed"
# the data-plane tests' lane "dp": real workers serving no model (echo roles), their object spec and windows
SPEC = {"kind": "tensor", "max_extent": 1 << 24, "alignment": 4, "dtype": "float32", "shape": [],
        "sequence_policy": "strict"}
DATAPLANE_WINDOWS = Windows(inference_s=20, setup_s=30, control_s=30, load_s=30, kill_grace_s=1, shutdown_s=5)


def fake_config(tmp_path: Path, *commands: tuple[str, ...], windows: Windows = FAST, strikes: int = 2,
                cooldown_s: float = 600.0, backoff_s: float = 0.05) -> SupervisorConfig:
    artifact = tmp_path / "fake.bin"
    artifact.write_bytes(b"fake weights")
    lanes = tuple(LaneConfig(f"lane{i}", (MODEL,), worker_command=cmd) for i, cmd in enumerate(commands))
    return SupervisorConfig(
        lanes=lanes, models=(ModelConfig(MODEL, artifact),), state_dir=tmp_path / "state",
        runtime_dir=tmp_path / "run", windows=windows, quarantine=QuarantinePolicy(strikes, cooldown_s),
        restart=RestartPolicy(backoff_s, backoff_s * 4, 2.0))


def dataplane_config(tmp_path: Path, *, arena_bytes: int = 64 << 20, **lane: Any) -> SupervisorConfig:
    """One lane "dp" of a real worker with no model (`lane`: its LaneConfig fields), restarted at once."""
    return SupervisorConfig(lanes=(LaneConfig("dp", (), **lane),), models=(), state_dir=tmp_path / "state",
                            runtime_dir=tmp_path / "run", windows=DATAPLANE_WINDOWS, arena_bytes=arena_bytes,
                            restart=RestartPolicy(backoff_initial_s=0.05, backoff_max_s=0.2))


def rows(*lengths: int, base: int = 1) -> list[np.ndarray]:
    return [np.arange(base, base + n, dtype=np.int32) for n in lengths]


def expected_fake_rows(rs: list[np.ndarray]) -> np.ndarray:
    """The fake worker's vector for row i is [sum(ids), n_tokens, i, req_id]; compare the first three."""
    return np.array([[r.sum(), len(r), i] for i, r in enumerate(rs)], dtype=np.float32)


async def restarted(lane: Lane, after: int, within: float = 20.0) -> None:
    """Until `lane` serves with a generation newer than `after` (a crash has no event a test can wait on)."""
    with trio.fail_after(within):
        while lane.generation == after:  # noqa: ASYNC110
            await trio.sleep(0.02)
        await lane.wait_state(LaneState.READY)
