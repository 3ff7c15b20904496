"""Batched decoding (models/batched.py) on the fused decoder: every sequence of a batch gets bit for bit the ids it gets
alone from generate(), whatever its prompt length, the step it joins at, and the sequences beside it.

generate() alone is itself checked against the numpy reference (tests/test_llama_fidelity.py); here the real
SmolLM2 weights run both ways in one process.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.support.reference_llama import gguf_path
from trio_gpuworker import _cores
from trio_gpuworker._cores import CoreLedger
from trio_gpuworker._kinds import AUTO_THREADS
from trio_gpuworker.llm_tokenizer import ChatTokenizer
from trio_gpuworker.models.batched import Batch, generate_together
from trio_gpuworker.models.greedy import BATCH, PREFILL_CHUNK
from trio_gpuworker.models.llama_fused import FusedLlamaLM
from trio_gpuworker.models.sampling import SamplingParams

pytestmark = pytest.mark.slow

N_NEW = 20
QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.", "def fibonacci(n):",
             "List three colours.",
             "Explain why the sky is blue, mentioning Rayleigh scattering, sunsets, the ocean and the eye, "
             "in one long sentence."]


@pytest.fixture(scope="module")
def lm() -> FusedLlamaLM:
    return FusedLlamaLM.load(gguf_path(), max_context=512)


@pytest.fixture(scope="module")
def prompts() -> list[np.ndarray]:
    tok = ChatTokenizer.from_gguf(gguf_path())
    out = [np.array(tok.encode(tok.apply_chat_template([{"role": "user", "content": q}])), np.int32)
           for q in QUESTIONS]
    out.append(np.array(tok.encode("def fibonacci(n):"), np.int32))  # a short plain prompt: one partial chunk
    assert max(len(p) for p in out) > PREFILL_CHUNK, "a prompt of two prefill chunks"
    assert len({len(p) for p in out}) >= 4, "prompts of different lengths"
    return out


@pytest.fixture(scope="module")
def alone(lm: FusedLlamaLM, prompts: list[np.ndarray]) -> list[tuple[list[int], str]]:
    return [lm.generate(p, N_NEW) for p in prompts]


@pytest.mark.parametrize("join_every", [0, 1, 5], ids=["together", "one-per-step", "every-five-steps"])
def test_each_sequence_equals_generating_it_alone(lm: FusedLlamaLM, prompts: list[np.ndarray],
                                                  alone: list[tuple[list[int], str]], join_every: int) -> None:
    """More prompts than slots: the later ones join when earlier ones finish and free theirs."""
    assert len(prompts) > BATCH
    got = generate_together(lm, prompts, N_NEW, join_at=lambda i: i * join_every)
    assert got == alone
    assert {r for _, r in alone} == {"stop", "length"}, "both ends of a sequence are covered"


def test_two_threads_compute_what_one_does(lm: FusedLlamaLM, prompts: list[np.ndarray],
                                           alone: list[tuple[list[int], str]]) -> None:
    """A step split over two threads (each matmul by output rows, attention by rows) is bit for bit one thread's:
    the same ids alone and in a batch, the same logits."""
    lm.generate(prompts[0], 3)
    want = lm._logits().copy()
    lm.threads = 2
    try:
        assert [lm.generate(p, N_NEW) for p in prompts] == alone
        assert generate_together(lm, prompts, N_NEW, join_at=lambda i: i) == alone
        lm.generate(prompts[0], 3)
        assert lm._logits().view(np.uint32).tolist() == want.view(np.uint32).tolist()
    finally:
        lm.threads = 1


def test_auto_threads_follow_the_node_step_by_step_and_compute_what_one_does(
        lm: FusedLlamaLM, prompts: list[np.ndarray], alone: list[tuple[list[int], str]], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The default (AUTO_THREADS): each step asks the node's core ledger. Another worker going busy and idle every
    step moves this one between two threads and one, and the ids are still one thread's."""
    mine, other = CoreLedger(tmp_path / "cores", 2), CoreLedger(tmp_path / "cores", 2)
    monkeypatch.setattr(_cores, "_LEDGER", [mine])
    asked: list[int] = []

    def on_token(token: int, lp: object) -> bool:
        asked.append(int(np.frombuffer(lm._host.uop.buffer.as_memoryview(force_zero_copy=True), np.uint64)[4]))
        other.busy(not other._flags[other.slot])
        return False

    lm.threads = AUTO_THREADS
    mine.busy(True)
    try:
        assert [lm.generate(p, N_NEW, on_token=on_token) for p in prompts] == alone
        assert set(asked) == {1, 2}
    finally:
        lm.threads = 1
        mine.close()
        other.close()


def test_a_sequence_that_leaves_frees_its_slot(lm: FusedLlamaLM, prompts: list[np.ndarray],
                                               alone: list[tuple[list[int], str]]) -> None:
    batch = Batch(lm)
    seqs = [batch.join(p, N_NEW) for p in prompts[:BATCH]]
    assert batch.full
    with pytest.raises(RuntimeError):
        batch.join(prompts[BATCH], N_NEW)
    for _ in range(3):
        batch.step()
    batch.leave(seqs[1])  # its caller left
    late = batch.join(prompts[BATCH], N_NEW)
    assert late.slot == seqs[1].slot
    while batch.live:
        batch.step()
    assert seqs[1].finish is None and len(seqs[1].ids) == 4  # its first token and three steps, then no more
    assert seqs[1].ids == alone[1][0][:4]
    for s, want in zip([seqs[0], seqs[2], seqs[3], late], [alone[0], alone[2], alone[3], alone[BATCH]], strict=True):
        assert (s.ids, s.finish) == want


def test_sampling_and_stop_callbacks_per_sequence(lm: FusedLlamaLM, prompts: list[np.ndarray]) -> None:
    """Seeded sampling in a batch draws what it draws alone (each sequence has its own sampler), and a sequence's
    on_token stop ends that sequence only."""
    params = [SamplingParams(temperature=0.8, top_p=0.9, top_k=0, seed=s, logprobs=None) for s in (1, 2)]
    want = [lm.generate(prompts[0], N_NEW, sampling=p) for p in params]
    batch = Batch(lm)
    sampled = [batch.join(prompts[0], N_NEW, sampling=p) for p in params]
    stopper = batch.join(prompts[2], N_NEW, on_token=lambda t, lp: True)
    assert stopper.finish == "stop" and len(stopper.ids) == 1 and stopper not in batch.live
    while batch.live:
        batch.step()
    assert [(s.ids, s.finish) for s in sampled] == want


def test_bad_prompts_are_refused_before_taking_a_slot(lm: FusedLlamaLM) -> None:
    batch = Batch(lm)
    for bad, n in ((np.array([], np.int32), 4), (np.array([lm.vocab_size], np.int32), 4),
                   (np.array([1, 2], np.int32), 0), (np.array([1] * 500, np.int32), 100)):
        with pytest.raises(ValueError):
            batch.join(bad, n)
    assert not batch.full and not batch.live
