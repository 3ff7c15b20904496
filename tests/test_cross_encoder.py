"""BertCrossEncoder (and the shared bucketed BERT driver) against transformers on tiny seeded random weights."""

from __future__ import annotations

import os
import pathlib

import numpy as np
import pytest

pytestmark = pytest.mark.slow
# Never reach for the network: huggingface_hub reads this once, at its import (which may be in another test module).
os.environ.setdefault("HF_HUB_OFFLINE", "1")

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tests.support.tiny_cross_encoder import LENGTHS, TINY, pairs, tiny_model, torch_out  # noqa: E402
from trio_gpuworker.models.bert import BertEncoder  # noqa: E402
from trio_gpuworker.models.cross_encoder import BertCrossEncoder  # noqa: E402
from trio_gpuworker.models.shapes import MAX_BATCH_TOKENS, plan_batches  # noqa: E402


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, BertCrossEncoder, pathlib.Path, dict]:
    model, art, cfg = tiny_model(tmp_path_factory.mktemp("ce1"), 1, 0)
    return model, BertCrossEncoder.load(art, cfg), art, cfg


def test_scores_match_transformers(single: tuple) -> None:
    model, ce, _, _ = single
    rng = np.random.default_rng(1)
    ids, tts = pairs(rng, LENGTHS)
    seen: list[int] = []
    got = ce.score(ids, tts, progress=seen.append)
    want = torch_out(model, ids, tts).logits[:, 0].numpy()
    assert got.dtype == np.float32 and got.shape == (len(ids),)
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    assert seen == [4, 11]  # one PROGRESS per micro-batch, longest first: (64 tokens x 4), (16 x 8, one padding)
    # Replays of the now-captured TinyJits give the same numbers.
    for _ in range(2):
        np.testing.assert_array_equal(ce.score(ids, tts), got)
    # No token types means all zeros, as in HF.
    np.testing.assert_allclose(
        ce.score(ids, None), torch_out(model, ids, None).logits[:, 0].numpy(), atol=1e-4, rtol=0
    )
    assert ce.score([], None).shape == (0,)


def test_multi_label_logits(tmp_path: pathlib.Path) -> None:
    model, art, cfg = tiny_model(tmp_path, 3, 2)
    ce = BertCrossEncoder.load(art, cfg)
    ids, tts = pairs(np.random.default_rng(3), LENGTHS)
    np.testing.assert_allclose(ce.logits(ids, tts), torch_out(model, ids, tts).logits.numpy(), atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match="num_labels=3"):
        ce.score(ids, tts)


def test_encoder_body_matches_bert_model(single: tuple) -> None:
    # The same body serves BertEncoder; a BertForSequenceClassification checkpoint loads through the "bert." prefix.
    model, _, art, cfg = single
    enc = BertEncoder.load(art, cfg)
    assert enc.dims == TINY["hidden_size"]
    ids, _ = pairs(np.random.default_rng(4), LENGTHS)
    h = torch_out(model.bert, ids, None).last_hidden_state.double().numpy()
    m = np.zeros(h.shape[:2])
    for i, a in enumerate(ids):
        m[i, : len(a)] = 1
    mean = (h * m[..., None]).sum(1) / m.sum(1, keepdims=True)
    np.testing.assert_allclose(enc.embed(ids, "mean", False), mean, atol=1e-4, rtol=0)
    np.testing.assert_allclose(enc.embed(ids, "cls", False), h[:, 0], atol=1e-4, rtol=0)
    unit = enc.embed(ids, "cls", True)
    np.testing.assert_allclose(unit, h[:, 0] / np.linalg.norm(h[:, 0], axis=1, keepdims=True), atol=1e-5, rtol=0)


def test_rejects_bad_rows(single: tuple) -> None:
    _, ce, _, _ = single
    ok = np.array([2, 5, 3], np.int32)
    with pytest.raises(ValueError, match="tokens"):
        ce.score([np.ones(65, np.int32)], None)
    with pytest.raises(ValueError, match="tokens"):
        ce.score([np.zeros(0, np.int32)], None)
    with pytest.raises(ValueError, match="outside"):
        ce.score([np.array([2, 97], np.int32)], None)
    with pytest.raises(ValueError, match="outside"):
        ce.score([ok], [np.array([0, 2, 0], np.int32)])
    with pytest.raises(ValueError, match="length"):
        ce.score([ok], [np.zeros(2, np.int32)])
    with pytest.raises(ValueError, match="1-D integer"):
        ce.score([ok.astype(np.float32)], None)
    with pytest.raises(ValueError, match="pooling"):
        BertEncoder.load(*single[2:]).embed([ok], "weightedmean", True)


def test_load_errors(single: tuple, tmp_path: pathlib.Path) -> None:
    from safetensors.numpy import load_file, save_file

    _, _, art, cfg = single
    with pytest.raises(ValueError, match="not a file"):
        BertCrossEncoder.load(tmp_path / "nope.safetensors", cfg)
    (junk := tmp_path / "junk.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}garbage")
    with pytest.raises(ValueError):
        BertCrossEncoder.load(junk, cfg)
    tensors = load_file(art)
    save_file({k: v for k, v in tensors.items() if k != "classifier.bias"}, missing := tmp_path / "missing.safetensors")
    with pytest.raises(ValueError, match="lacks"):
        BertCrossEncoder.load(missing, cfg)
    BertEncoder.load(missing, cfg)  # the encoder does not need the classifier head
    key = "bert.encoder.layer.1.intermediate.dense.weight"
    save_file(tensors | {key: tensors[key][:-1]}, shaped := tmp_path / "shaped.safetensors")
    with pytest.raises(ValueError, match="ill-shaped"):
        BertEncoder.load(shaped, cfg)
    for bad in (
        {"hidden_size": 30},
        {"hidden_act": "swish"},
        {"num_hidden_layers": 0},
        {"model_type": "roberta"},
        {"position_embedding_type": "relative_key"},
        {"vocab_size": "97"},
    ):
        with pytest.raises(ValueError, match="config"):
            BertEncoder.load(art, cfg | bad)
    with pytest.raises(ValueError, match="num_labels"):
        BertCrossEncoder.load(art, cfg | {"num_labels": 0})
    with pytest.raises(ValueError, match=r"lacks|ill-shaped"):
        BertCrossEncoder.load(art, cfg | {"num_labels": 2})


@pytest.mark.parametrize("n", [*range(1, 70), 100, 1000])
def test_plan_batches_covers_rows_with_known_sizes(n: int) -> None:
    sizes = (1, 4, 8, 16, 32)
    plan = plan_batches(n, sizes)
    assert sum(t for t, _ in plan) == n
    assert all(b in sizes and 1 <= t <= b and b - t <= t / 2 for t, b in plan)
    # with a BEAM-tuned size, remainders of at least a third of it are padded up to it
    tuned = plan_batches(n, sizes, tuned=16)
    assert sum(t for t, _ in tuned) == n and all(b in sizes and 1 <= t <= b for t, b in tuned)
    assert all(b == 16 for t, b in tuned if 16 / 3 <= t <= 16)
    assert all(b - t <= t / 2 for t, b in tuned if b != 16)


def test_truncated_artifact(single: tuple, tmp_path: pathlib.Path) -> None:
    _, _, art, cfg = single
    (cut := tmp_path / "cut.safetensors").write_bytes(art.read_bytes()[:-100])
    with pytest.raises(ValueError, match="truncated"):
        BertEncoder.load(cut, cfg)


def test_warmup(single: tuple) -> None:
    _, ce, _, _ = single
    shapes = ce.all_shapes()
    assert shapes[0] == (16, 1) and (64, 8) in shapes and (64, 16) not in shapes
    assert all(L * B <= MAX_BATCH_TOKENS or B == 1 for L, B in shapes)
    seen: list[int] = []
    ce.warmup([(16, 8)], progress=seen.append)
    assert seen == [1]
    with pytest.raises(ValueError, match="shape"):
        ce.warmup([(17, 8)])
