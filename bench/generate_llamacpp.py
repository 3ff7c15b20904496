"""The fused CPU decoder against llama.cpp on the same Q4_K_M files, in the same run: greedy, --tokens new tokens
after the same prompt ids, --threads threads on both sides, each side's decode loop in process (the fused decoder's
GreedyDecoder.generate; llama.cpp through llama-cpp-python's Llama.generate, the library its server runs).

Files (bench/_q4km.py): SmolLM2-135M-Instruct requantised to Q4_K_M by llama.cpp's quantiser, and random-weight
models of Qwen2.5-0.5B's and Llama-3.2-1B's shapes in llama.cpp's Q4_K_M mix. Each row gives tokens/s of the
decode (first token to last: the prompt's prefill is apart, in its own column) and the ratio fused / llama.cpp,
measured alternately in --runs rounds so both see the same load; the median of each is taken.

llama-cpp-python is a benchmark dependency only (never the worker's or the tests'): build it for this CPU with
    CMAKE_ARGS=-DGGML_NATIVE=ON pip install llama-cpp-python

    .venv/bin/python bench/generate_llamacpp.py [--tokens 64] [--threads 2] [--runs 3] [--models smollm2,qwen,llama]
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
from _common import scratch_dir
from _q4km import LLAMA32_1B, QWEN25_05B, requantise, write_random

from tests.support.reference_llama import gguf_path
from trio_gpuworker.models.llama_fused import FusedLlamaLM

PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 30, 2, 198, 1, 4093, 198, 2]  # a short chat-like prefix
CONTEXT = 256


def models(which: list[str], tmp: Path, threads: int) -> dict[str, Path]:
    out = {}
    if "smollm2" in which:
        out["SmolLM2-135M Q4_K_M (requantised)"] = requantise(gguf_path(), tmp / "smollm2-q4_k_m.gguf", threads)
    if "qwen" in which:
        out["Qwen2.5-0.5B shape, random Q4_K_M"] = write_random(tmp / "qwen-q4_k_m.gguf", QWEN25_05B)
    if "llama" in which:
        out["Llama-3.2-1B shape, random Q4_K_M"] = write_random(tmp / "llama-q4_k_m.gguf", LLAMA32_1B)
    return out


def fused_run(path: Path, threads: int) -> Callable[[int], tuple[float, float, list[int]]]:
    lm = FusedLlamaLM.load(path, max_context=CONTEXT, threads=threads)
    ids = np.array(PROMPT, np.int32)

    def run(n: int) -> tuple[float, float, list[int]]:
        first: list[float] = []
        t0 = time.perf_counter()
        got, _ = lm.generate(ids, n, lambda k: first.append(time.perf_counter()) if k == 1 else None,
                             ignore_eos=True)
        return first[0] - t0, time.perf_counter() - first[0], got

    return run


def llamacpp_run(path: Path, threads: int) -> Callable[[int], tuple[float, float, list[int]]]:
    import llama_cpp

    llm = llama_cpp.Llama(str(path), n_ctx=CONTEXT, n_threads=threads, n_threads_batch=threads, n_batch=CONTEXT,
                          verbose=False)

    def run(n: int) -> tuple[float, float, list[int]]:
        got: list[int] = []
        t0 = time.perf_counter()
        for tok in llm.generate(PROMPT, top_k=1, temp=0.0, reset=True):  # never stops at EOS itself
            if not got:
                t1 = time.perf_counter()
            got.append(int(tok))
            if len(got) == n:
                break
        return t1 - t0, time.perf_counter() - t1, got

    return run


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--models", default="smollm2,qwen,llama")
    args = p.parse_args()
    tmp = scratch_dir("gw-q4km-")
    files = models(args.models.split(","), tmp, args.threads)
    print(f"greedy, {len(PROMPT)}-token prompt, {args.tokens} new tokens, {args.threads} threads, median of "
          f"{args.runs} alternating runs, {os.cpu_count()} CPUs (load average {os.getloadavg()[0]:.2f} at start)")
    print(f"{'model':<36}{'decoder':<11}{'prefill ms':>11}{'tokens/s':>10}{'ratio':>8}  same tokens")
    for name, path in files.items():
        sides = {"fused": fused_run(path, args.threads), "llama.cpp": llamacpp_run(path, args.threads)}
        for run in sides.values():
            run(4)  # warm: page in the weights
        times: dict[str, list[tuple[float, float, list[int]]]] = {k: [] for k in sides}
        for _ in range(args.runs):
            for k, run in sides.items():
                times[k].append(run(args.tokens))
        rate = {k: statistics.median((args.tokens - 1) / r[1] for r in rows) for k, rows in times.items()}
        a, b = times["fused"][0][2], times["llama.cpp"][0][2]
        same = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
        for k, rows in times.items():
            ttft = statistics.median(r[0] for r in rows) * 1000
            agree = f"  first {same} of {len(a)}" if k == "fused" else ""
            print(f"{name:<36}{k:<11}{ttft:>11.0f}{rate[k]:>10.1f}{rate[k] / rate['llama.cpp']:>7.2f}x{agree}")
        del sides
    print("(tokens/s: (tokens - 1) / seconds from the first new token to the last; ratio against llama.cpp in the "
          "same run; same tokens: how many greedy tokens agree before the first that differs)")
    for f in tmp.glob("*.gguf"):
        f.unlink()


if __name__ == "__main__":
    main()
