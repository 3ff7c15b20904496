"""The fused CPU encoder (models/bert_fused.py) against transformers on tiny seeded random BERTs: the
cross-encoder's logits, the encoder body's poolings, packing across several kernel calls, and the same
checks of rows and artifacts as the graph encoder's."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest

pytestmark = pytest.mark.slow

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tests.support.tiny_cross_encoder import LENGTHS, TINY, pairs, tiny_model, torch_out  # noqa: E402
from trio_gpuworker.models.bert_fused import FusedBertEncoder, FusedCrossEncoder  # noqa: E402


@pytest.fixture(scope="module", params=[1, 2])
def single(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple:
    model, art, cfg = tiny_model(tmp_path_factory.mktemp("fce"), 1, 0)
    return model, FusedCrossEncoder.load(art, cfg, threads=request.param), art, cfg, request.param


def test_scores_match_transformers(single: tuple) -> None:
    model, ce, _, _, _ = single
    ids, tts = pairs(np.random.default_rng(1), LENGTHS)
    seen: list[int] = []
    got = ce.score(ids, tts, progress=seen.append)
    assert got.dtype == np.float32 and got.shape == (len(ids),)
    np.testing.assert_allclose(got, torch_out(model, ids, tts).logits[:, 0].numpy(), atol=1e-4, rtol=0)
    assert seen == [len(ids)]
    np.testing.assert_array_equal(ce.score(ids, tts), got)  # a replay of the captured kernel
    np.testing.assert_allclose(ce.score(ids, None), torch_out(model, ids, None).logits[:, 0].numpy(),
                               atol=1e-4, rtol=0)
    assert ce.score([], None).shape == (0,)


def test_multi_label_logits(tmp_path: pathlib.Path) -> None:
    model, art, cfg = tiny_model(tmp_path, 3, 2)
    ce = FusedCrossEncoder.load(art, cfg)
    ids, tts = pairs(np.random.default_rng(3), LENGTHS)
    np.testing.assert_allclose(ce.logits(ids, tts), torch_out(model, ids, tts).logits.numpy(), atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match="num_labels=3"):
        ce.score(ids, tts)


def test_encoder_body_across_kernel_calls(single: tuple) -> None:
    """More rows than one call holds: they go in several calls, in order, each row whole."""
    model, _, art, cfg, threads = single
    enc = FusedBertEncoder.load(art, cfg, threads=threads)
    assert enc.dims == TINY["hidden_size"]
    rng = np.random.default_rng(4)
    ids, _ = pairs(rng, [int(n) for n in rng.integers(1, 65, 90)])
    h = torch_out(model.bert, ids, None).last_hidden_state.double().numpy()
    m = np.zeros(h.shape[:2])
    for i, a in enumerate(ids):
        m[i, : len(a)] = 1
    mean = (h * m[..., None]).sum(1) / m.sum(1, keepdims=True)
    seen: list[int] = []
    enc.call_tokens = 600  # pack fewer tokens per call than the kernel's buffers hold
    np.testing.assert_allclose(enc.embed(ids, "mean", False, seen.append), mean, atol=1e-4, rtol=0)
    assert len(seen) >= 4 and seen[-1] == len(ids) and seen == sorted(seen)
    np.testing.assert_allclose(enc.embed(ids, "cls", False), h[:, 0], atol=1e-4, rtol=0)
    unit = enc.embed(ids, "cls", True)
    np.testing.assert_allclose(unit, h[:, 0] / np.linalg.norm(h[:, 0], axis=1, keepdims=True), atol=1e-5, rtol=0)


def test_rejects_bad_rows_and_artifacts(single: tuple, tmp_path: pathlib.Path) -> None:
    _, ce, art, cfg, _ = single
    ok = np.array([2, 5, 3], np.int32)
    for rows, types, match in (([np.ones(65, np.int32)], None, "tokens"), ([np.zeros(0, np.int32)], None, "tokens"),
                               ([np.array([2, 97], np.int32)], None, "outside"),
                               ([ok], [np.array([0, 2, 0], np.int32)], "outside"),
                               ([ok], [np.zeros(2, np.int32)], "length"),
                               ([ok.astype(np.float32)], None, "1-D integer")):
        with pytest.raises(ValueError, match=match):
            ce.score(rows, types)
    with pytest.raises(ValueError, match="pooling"):
        FusedBertEncoder.load(art, cfg).embed([ok], "weightedmean", True)
    with pytest.raises(ValueError, match="not a file"):
        FusedCrossEncoder.load(tmp_path / "nope.safetensors", cfg)
    (cut := tmp_path / "cut.safetensors").write_bytes(art.read_bytes()[:-100])
    with pytest.raises(ValueError, match="truncated"):
        FusedBertEncoder.load(cut, cfg)
    with pytest.raises(ValueError, match="multiples of 32"):
        FusedBertEncoder.load(art, cfg | {"intermediate_size": 48})
