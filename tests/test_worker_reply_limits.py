"""A reply larger than the negotiated max_frame is a typed ERR from the real worker: no crash, no strike."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from tests.support.config import embedded_default
from tests.support.state import SESSION_STATE, short_dir
from trio_gpuworker import Supervisor, WorkerError
from trio_gpuworker._proto import EmbedBatch
from trio_gpuworker.daemon.config import DEFAULT_MODEL

pytestmark = pytest.mark.slow
STATE = SESSION_STATE  # the session's shared kernel and JIT caches
MAX_FRAME = 64 * 1024


async def test_oversized_vectors_reply_is_a_typed_error_and_no_strike() -> None:
    env = {"GPUWORKER_STATE_DIR": str(STATE), "GPUWORKER_RUNTIME_DIR": str(short_dir("gw-reply-"))}
    cfg = embedded_default(env).supervisor
    lanes = tuple(lane for lane in cfg.lanes if DEFAULT_MODEL in lane.models)
    cfg = dataclasses.replace(cfg, lanes=lanes, models=tuple(m for m in cfg.models if m.id == DEFAULT_MODEL),
                              max_frame=MAX_FRAME, max_batch_items=16)
    async with Supervisor(cfg) as sup:
        lane = next(iter(sup.lanes.values()))
        n = 64  # 64 x 384 float32 = 96 KiB of vectors from 64 x 4 token ids
        ids = np.tile(np.array([101, 7592, 2088, 102], dtype="<i4"), n)
        fields = {"model_ref": DEFAULT_MODEL, "pooling": "mean", "normalize": True,
                  "items": [{"id": i, "n_tokens": 4} for i in range(n)]}
        with pytest.raises(WorkerError) as info:
            await lane.call(EmbedBatch(**fields, raw=ids.tobytes()))
        assert info.value.code == "reply_too_large"
        assert lane.generation == 1 and lane.policy.strikes == 0
        vecs = await sup.embed(["still serving"], model=DEFAULT_MODEL)
        assert vecs.shape == (1, 384) and abs(float(np.linalg.norm(vecs[0])) - 1.0) < 1e-4
        assert lane.generation == 1 and lane.policy.strikes == 0
