"""SmolLM2-135M (Q4_1 GGUF) in tinygrad against an independent numpy forward of the same file.

Both decoders are checked: the CPU default (llama_fused.py) and the tinygrad-generated one (llama.py).
The reference shares no code with trio_gpuworker: weights come from the `gguf` package's reader and
dequantiser, RoPE is done with complex rotations, attention recomputes from a plain list cache.
"""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.slow

gguf = pytest.importorskip("gguf")

from tests.support.reference_llama import NumpyLlama, gguf_path  # noqa: E402
from trio_gpuworker._proto import V3_MAX_GEN_TOKENS as MAX_NEW_TOKENS  # noqa: E402
from trio_gpuworker.llm_tokenizer import ChatTokenizer  # noqa: E402
from trio_gpuworker.models.greedy import GreedyDecoder  # noqa: E402
from trio_gpuworker.models.llama import LlamaLM  # noqa: E402
from trio_gpuworker.models.llama_fused import FusedLlamaLM  # noqa: E402
from trio_gpuworker.models.sampling import SamplingParams, log_softmax  # noqa: E402

N_CHECK = 16


GGUF = gguf_path()


@pytest.fixture(scope="module")
def tok() -> ChatTokenizer:
    return ChatTokenizer.from_gguf(GGUF)


@pytest.fixture(scope="module", params=["fused", "graph"])
def lm(request: pytest.FixtureRequest) -> GreedyDecoder:
    """Both decoders: the CPU default (one C kernel per step) and the tinygrad-generated one other devices use."""
    return (FusedLlamaLM if request.param == "fused" else LlamaLM).load(GGUF)


@pytest.fixture(scope="module")
def ref() -> NumpyLlama:
    return NumpyLlama(GGUF)


PROMPTS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    # Long enough for two prefill chunks.
    [
        {"role": "system", "content": "You are a terse assistant who answers in one sentence."},
        {"role": "user", "content": "Explain why the sky is blue, mentioning Rayleigh scattering and sunsets."},
    ],
]


@pytest.mark.parametrize("messages", PROMPTS, ids=["capital", "haiku", "two-chunks"])
def test_greedy_matches_numpy_reference(
    lm: GreedyDecoder, ref: NumpyLlama, tok: ChatTokenizer, messages: list[dict[str, str]]
) -> None:
    ids = tok.encode(tok.apply_chat_template(messages))
    # A reference stop token ends our generation early; compare only what both sides produce.
    want, gaps = ref.generate(ids, N_CHECK)
    got, reason = lm.generate(np.array(ids, dtype=np.int32), N_CHECK)
    stop = next((i for i, t in enumerate(want) if t in lm.eos_ids), None)
    if stop is None:
        assert (got, reason) == (want, "length"), f"min top-2 logit gap {min(gaps):.4f}"
    else:
        assert (got, reason) == (want[:stop], "stop")
        assert stop >= 4, "prompt ends too early to be a useful check"


def test_plain_prompt_and_progress(lm: GreedyDecoder, ref: NumpyLlama, tok: ChatTokenizer) -> None:
    ids = tok.encode("def fibonacci(n):")
    seen: list[int] = []
    got, reason = lm.generate(np.array(ids, dtype=np.int32), N_CHECK, seen.append)
    assert reason == "length" and got == ref.generate(ids, N_CHECK)[0]
    assert seen == list(range(1, N_CHECK + 1))


def test_stop_excludes_eos_and_reports_stop(lm: GreedyDecoder, tok: ChatTokenizer) -> None:
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}]))
    seen: list[int] = []
    got, reason = lm.generate(np.array(ids, dtype=np.int32), MAX_NEW_TOKENS, seen.append)
    assert reason == "stop" and 0 < len(got) < MAX_NEW_TOKENS
    assert not set(got) & lm.eos_ids
    assert seen == list(range(1, len(got) + 1))
    assert "Paris" in tok.decode(got)


def test_length_limit(lm: GreedyDecoder, tok: ChatTokenizer) -> None:
    got, reason = lm.generate(np.array(tok.encode("Once upon a time"), dtype=np.int32), 1)
    assert reason == "length" and len(got) == 1


@pytest.mark.parametrize("bad", [0, -1])
def test_max_tokens_bounds(lm: GreedyDecoder, bad: int) -> None:
    with pytest.raises(ValueError, match="max_tokens"):
        lm.generate(np.array([1, 2, 3], dtype=np.int32), bad)


def test_logits_and_logprobs_match_the_reference(lm: GreedyDecoder, ref: NumpyLlama, tok: ChatTokenizer) -> None:
    """What sampling reads: each step's logits (here through logprobs at temperature 0) against the numpy
    reference's, and greedy unchanged by reading them."""
    ids = tok.encode(tok.apply_chat_template(PROMPTS[0]))
    want, _ = ref.generate(ids, 6)
    seen: list[tuple[int, tuple[float, list[tuple[int, float]]] | None]] = []
    got, _ = lm.generate(np.array(ids, dtype=np.int32), 6, sampling=SamplingParams(logprobs=3),
                         on_token=lambda t, lp: seen.append((t, lp)) is None and False)
    assert got == want[: len(got)] and [t for t, _ in seen] == got
    for step, (token, lp) in enumerate(seen):
        assert lp is not None
        ref_lp = log_softmax(ref.logits[step])
        assert lp[0] == pytest.approx(ref_lp[token], abs=2e-3)
        assert [i for i, _ in lp[1]][:1] == [token] and len(lp[1]) == 3


def test_seeded_sampling_is_reproducible(lm: GreedyDecoder, tok: ChatTokenizer) -> None:
    ids = np.array(tok.encode(tok.apply_chat_template(PROMPTS[1])), dtype=np.int32)
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=11)
    a, b = lm.generate(ids, 24, sampling=params), lm.generate(ids, 24, sampling=params)
    c = lm.generate(ids, 24, sampling=SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=12))
    assert a == b and a != c


def test_past_the_reference_limit(lm: GreedyDecoder, ref: NumpyLlama, tok: ChatTokenizer) -> None:
    ids = tok.encode("Once upon a time")
    got, reason = lm.generate(np.array(ids, dtype=np.int32), MAX_NEW_TOKENS + 16, ignore_eos=True)
    assert reason == "length" and len(got) == MAX_NEW_TOKENS + 16


def test_prompt_validation(lm: GreedyDecoder) -> None:
    with pytest.raises(ValueError, match="context"):
        lm.generate(np.ones(lm.max_context, dtype=np.int32), 1)
    with pytest.raises(ValueError, match="empty"):
        lm.generate(np.array([], dtype=np.int32), 1)
    with pytest.raises(ValueError, match="context"):
        lm.generate(np.ones(lm.max_context - 3, dtype=np.int32), 4)
    with pytest.raises(ValueError, match="outside"):
        lm.generate(np.array([1, lm.vocab_size], dtype=np.int32), 1)
    with pytest.raises(ValueError, match="outside"):
        lm.generate(np.array([-1, 5], dtype=np.int32), 1)
    with pytest.raises(ValueError, match="integers"):
        lm.generate(np.array([1.0, 5.0]), 1)


def test_eos_ids(lm: GreedyDecoder, tok: ChatTokenizer) -> None:
    assert lm.eos_ids == tok.eos_ids == {0, 2}  # <|endoftext|>, <|im_end|> (the GGUF's declared EOS)
