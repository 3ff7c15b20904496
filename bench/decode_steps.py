"""The fused decoder's steps alone, in process (models/llama_fused.py, SmolLM2 Q4_1, DEV=CPU): one decode step of
1, 2, 3 and 4 sequences (the batched graph from 2 on), a 32-token prefill chunk and the whole prefill of a 40-token
prompt (a chat prompt of bench/generate_batched.py, which each joining client costs the batch), as the median of
--runs runs of 16 steps each, with each step's time against the one-sequence step measured in the same run. What batched
generation can gain is bounded here: four sequences in a step cost `4 seqs / 1 seq` of one sequence's step.
Each row also gives its float32 multiply-adds per second (the weights' products: every row through every layer,
and the logits of each row that predicts) and their share of the most that the `threads` CPUs can issue, measured in
the same run by bench/fma_peak.py: how far a step is from what this host's FMA units allow.

    .venv/bin/python bench/decode_steps.py [--threads 1] [--runs 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DEV", "CPU")

import numpy as np
from fma_peak import describe, first_cpus, fma_peak

from tests.support.reference_llama import gguf_path
from trio_gpuworker.models.greedy import BATCH, PREFILL_CHUNK
from trio_gpuworker.models.llama_fused import FusedLlamaLM

PROMPT = 60  # tokens already cached in each sequence's slot before the timed steps
CHAT_PROMPT = 40  # about the tokens of one of bench/generate_batched.py's chat prompts: its prefill, whole
STEPS = 16


def timed(step: Callable[[int], object], runs: int) -> float:
    """Median seconds per call of step(i) over `runs` runs of STEPS calls."""
    per_run = []
    for _ in range(runs):
        t0 = time.perf_counter()
        for i in range(STEPS):
            step(i)
        per_run.append((time.perf_counter() - t0) / STEPS)
    return statistics.median(per_run)


def multiply_adds(lm: FusedLlamaLM, rows: int, predicting: int) -> int:
    """The weights' multiply-adds of a step of `rows` rows, `predicting` of which compute logits (as _forward
    counts them: q, k, v, o, gate, up and down per row and layer, the output matrix per predicting row)."""
    qkv = (lm.n_heads + 2 * lm.n_kv) * lm.head_dim
    return rows * lm.n_layers * lm.dim * (qkv + lm.dim + 3 * lm.ff) + predicting * lm.dim * lm.vocab_size


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--threads", type=int, default=1, help="runtime_config threads of the decoder")
    p.add_argument("--runs", type=int, default=5)
    args = p.parse_args()
    lm = FusedLlamaLM.load(gguf_path(), threads=args.threads)
    prompt = np.arange(1, PROMPT + 1, dtype=np.int32)
    for slot in range(BATCH + 1):  # slot 0 is the one-sequence decode's, 1..BATCH the batch's
        lm.prefill(prompt, slot)
    chunk = np.arange(1, PREFILL_CHUNK + 1, dtype=np.int32)
    # positions stay below the prompt's end + STEPS, so every run attends to about as many cached rows
    one = timed(lambda i: lm._decode_step(5, PROMPT + i, 0), args.runs)
    rows = [("1 sequence", one)]
    for k in range(2, BATCH + 1):
        slots = list(range(1, k + 1))
        rows.append((f"{k} sequences", timed(lambda i, k=k, s=slots: lm._batched_step(list(range(5, 5 + k)),
                                                                                     [PROMPT + i] * k, s),
                                             args.runs)))
    prefill = timed(lambda i: lm._prefill_step(chunk, 0, PREFILL_CHUNK - 1, 0), max(1, args.runs // 2))
    chat = np.arange(1, CHAT_PROMPT + 1, dtype=np.int32)

    def whole_prefill(i: int) -> None:
        lm.forget_prompts()  # the whole prompt each time, not the reuse of the last one's prefix
        lm.prefill(chat, 0)

    whole = timed(whole_prefill, max(1, args.runs // 2))
    peak = fma_peak(first_cpus(args.threads))
    print(f"{os.cpu_count()} CPUs, DEV=CPU, fused decoder, threads {args.threads}, load average "
          f"{os.getloadavg()[0]:.2f}; median of {args.runs} runs of {STEPS} steps; the most {args.threads} CPU(s) "
          f"issue: {describe(peak)} float32 multiply-adds")
    print(f"{'step':<22} {'ms':>8} {'/ 1 seq':>8} {'tokens/s':>9} {'/ 1 seq':>8} {'G mul-add/s':>12} {'of peak':>8}")

    def line(name: str, t: float, k: int, macs: int) -> None:
        share = f"{macs / t / peak:>7.0%}" if peak else f"{'-':>7}"
        print(f"{name:<22} {t * 1e3:>8.2f} {t / one:>7.2f}x {k / t:>9.1f} {k * one / t:>7.2f}x "
              f"{macs / t / 1e9:>12.1f} {share}")

    for name, t in rows:
        k = int(name.split()[0])
        line(name, t, k, multiply_adds(lm, k, k))
    line(f"prefill, {PREFILL_CHUNK} tokens", prefill, PREFILL_CHUNK, multiply_adds(lm, PREFILL_CHUNK, 1))
    chunks = -(-CHAT_PROMPT // PREFILL_CHUNK)
    line(f"prefill, {CHAT_PROMPT}-token prompt", whole, CHAT_PROMPT, multiply_adds(lm, CHAT_PROMPT, chunks))
    print("(ms per step; tokens/s = the step's rows / its time; / 1 seq against the one-sequence step; of peak = the "
          "step's multiply-adds per second / the most its CPUs issue)")


if __name__ == "__main__":
    main()
