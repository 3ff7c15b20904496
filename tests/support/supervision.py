"""What the supervisor tests that drive scripted fake workers share: the rows they send and the fake worker's
answers to them, the data-plane lane's object spec, and waits on a lane's worker (restarted, still alive)."""

from __future__ import annotations

import os

import numpy as np
import trio

from trio_gpuworker import LaneState
from trio_gpuworker.supervisor import Lane

# the data-plane tests' lane "dp" (tests/support/config.py): the objects its rings carry
SPEC = {"kind": "tensor", "max_extent": 1 << 24, "alignment": 4, "dtype": "float32", "shape": [],
        "sequence_policy": "strict"}


def rows(*lengths: int, base: int = 1) -> list[np.ndarray]:
    """Rows of token ids `base, base+1, ...`, one of each length."""
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


def pid_alive(pid: int) -> bool:
    """Whether a process `pid` exists (a reaped worker's does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
