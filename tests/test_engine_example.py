"""docs/engines.md's example engine, taken from the page itself: at most 60 lines, served under a real Supervisor
(HELLO, LOAD with its digest, EMBED_BATCH, RERANK), killed, and served again by the lane's next generation."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.support.config import supervisor_config
from tests.support.engine_example import example
from tests.support.supervision import restarted
from trio_gpuworker import LaneConfig, ModelConfig, RestartPolicy, Supervisor, SupervisorConfig, WorkerError
from trio_gpuworker._proto import Generate, Rerank, Scores

DIMS = 16


def bag_of_words(rows: list[np.ndarray]) -> np.ndarray:
    out = np.zeros((len(rows), DIMS), np.float32)
    for vector, ids in zip(out, rows, strict=True):
        np.add.at(vector, ids % DIMS, 1.0)
    return out / np.linalg.norm(out, axis=1, keepdims=True)


def test_the_example_fits_in_sixty_lines() -> None:
    assert len(example().splitlines()) <= 60


def config(tmp_path: Path) -> SupervisorConfig:
    engine = tmp_path / "bow_engine.py"
    engine.write_text(example())
    artifact = tmp_path / "bow.json"
    artifact.write_text(json.dumps({"dims": DIMS}))
    lane = LaneConfig("bow-0", ("bow",), worker_command=(sys.executable, str(engine)))
    return supervisor_config(tmp_path, lanes=(lane,), models=(ModelConfig("bow", artifact),), restart=RestartPolicy())


async def embed(sup: Supervisor, rows: list[np.ndarray]) -> np.ndarray:
    return await sup.embed_ids(rows, model="bow", pooling="mean", normalize=True)


async def test_the_example_serves_crashes_and_recovers(tmp_path: Path) -> None:
    rows = [np.array([1, 2, 3, 17], np.int32), np.array([5], np.int32)]
    async with Supervisor(config(tmp_path)) as sup:
        lane = sup.lanes["bow-0"]
        assert lane.models_loaded == ["bow"] and lane.generation == 1
        np.testing.assert_allclose(await embed(sup, rows), bag_of_words(rows), rtol=1e-6)
        query, doc, other = [1, 2], [2, 1], [9]
        ids = np.array(query + doc + other, "<i4").tobytes()
        reply = await lane.call(Rerank(model_ref="bow", query_n_tokens=2,
                                       candidates=[{"n_tokens": 2}, {"n_tokens": 1}], raw=ids))
        assert isinstance(reply, Scores) and reply.method == "bag_of_words_cosine"
        np.testing.assert_allclose(np.frombuffer(reply.raw, "<f4"), [1.0, 0.0], atol=1e-6)

        assert lane.pid is not None
        os.kill(lane.pid, signal.SIGKILL)
        await restarted(lane, after=1)
        assert lane.generation == 2 and "SIGKILL" in lane.last_error and lane.policy.strikes == 1
        np.testing.assert_allclose(await embed(sup, rows), bag_of_words(rows), rtol=1e-6)
        assert lane.policy.strikes == 0  # a served reply clears the strike


async def test_the_example_advertises_and_serves_only_what_it_implements(tmp_path: Path) -> None:
    async with Supervisor(config(tmp_path)) as sup:
        lane = sup.lanes["bow-0"]
        hello = lane.gens[lane.generation].wp.hello
        assert hello is not None
        assert hello.engine == {"engine": "bag-of-words", "version": "1.0", "build_flags": []}
        with pytest.raises(WorkerError) as info:
            await lane.call(Generate(model_ref="bow", max_tokens=4, raw=np.array([1, 2], "<i4").tobytes()))
        assert info.value.code == "unsupported_request"
        assert lane.generation == 1 and lane.policy.strikes == 0  # a typed refusal, not a fault
