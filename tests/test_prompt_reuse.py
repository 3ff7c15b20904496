"""A prompt that shares a prefix with the last one prefilled into a cache slot runs only from where they part
(FusedLlamaLM.reused), and computes bit for bit what a full prefill does; a step written over a held position ends
the record; a batch's joining prompt takes the free slot that holds most of it. (A model restored from the JIT
cache holds no record: tests/test_hugepages.py.)"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from gguf import GGMLQuantizationType as T  # noqa: E402

from tests.support.tiny_gguf import write_llama  # noqa: E402
from trio_gpuworker.models.batched import Batch  # noqa: E402
from trio_gpuworker.models.greedy import PREFILL_CHUNK  # noqa: E402
from trio_gpuworker.models.llama_fused import FusedLlamaLM  # noqa: E402

rng = np.random.default_rng(11)
PROMPT = rng.integers(3, 250, PREFILL_CHUNK + 13).astype(np.int32)  # two prefill chunks
N_NEW = 6


@pytest.fixture(scope="module")
def lm(tmp_path_factory: pytest.TempPathFactory) -> FusedLlamaLM:
    path = write_llama(tmp_path_factory.mktemp("gguf") / "k.gguf", {"attn_q": T.Q4_K, "ffn_down": T.Q6_K}, tied=True)
    return FusedLlamaLM.load(Path(path), max_context=128, warmup=False)


def _starts(lm: FusedLlamaLM, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The positions each prefill chunk starts at, from now on."""
    starts: list[int] = []
    step = lm._prefill_step

    def spy(tokens: np.ndarray, start: int, last: int, slot: int = 0) -> int:
        starts.append(start)
        return step(tokens, start, last, slot)

    monkeypatch.setattr(lm, "_prefill_step", spy)
    return starts


def _run(lm: FusedLlamaLM, prompt: np.ndarray) -> tuple[list[int], bytes]:
    """The greedy tokens and the prompt's last logits (bits)."""
    got, _ = lm.generate(prompt, N_NEW, ignore_eos=True)
    lm.prefill(prompt)
    return got, lm._logits().tobytes()


def test_a_repeated_or_extended_prompt_runs_from_where_it_parts(lm: FusedLlamaLM,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    lm.forget_prompts()
    fresh = _run(lm, PROMPT)
    starts = _starts(lm, monkeypatch)
    assert _run(lm, PROMPT) == fresh
    assert starts == [len(PROMPT) - 1] * 2  # generate's prefill and _run's: the last row alone

    other = np.concatenate([PROMPT[:37], [5, 6, 7]]).astype(np.int32)
    starts.clear()
    got = _run(lm, other)
    assert starts[0] == 37
    lm.forget_prompts()
    assert _run(lm, other) == got  # bit for bit what a full prefill computes


def test_a_step_over_a_held_position_ends_the_record(lm: FusedLlamaLM, monkeypatch: pytest.MonkeyPatch) -> None:
    lm.forget_prompts()
    lm.generate(PROMPT, N_NEW, ignore_eos=True)
    assert lm.reused(PROMPT, 0) == len(PROMPT) - 1
    lm.score_prompt(PROMPT[:5], 1)  # decode steps at positions 0..3 of slot 0
    assert lm.reused(PROMPT, 0) == 0
    starts = _starts(lm, monkeypatch)
    lm.generate(PROMPT, N_NEW, ignore_eos=True)
    assert starts == [0, PREFILL_CHUNK]
    # generated tokens go past the prompt: the record stays
    assert lm.reused(PROMPT, 0) == len(PROMPT) - 1


def test_a_joining_prompt_takes_the_slot_that_holds_most_of_it(lm: FusedLlamaLM) -> None:
    lm.forget_prompts()
    alone, _ = lm.generate(PROMPT, N_NEW, ignore_eos=True)
    batch = Batch(lm)
    other = batch.join(rng.integers(3, 250, 20).astype(np.int32), N_NEW, ignore_eos=True)
    first = batch.join(PROMPT, N_NEW, ignore_eos=True)
    while batch.live:
        batch.step()
    assert first.ids == alone
    again = batch.join(PROMPT, N_NEW, ignore_eos=True)
    assert again.slot == first.slot != other.slot
    while batch.live:
        batch.step()
    assert again.ids == alone

