"""Greedy generation with SmolLM2-135M-Instruct (Q4_1 GGUF), same prompts, one run: tokens/s and time
to first token of the daemon (Supervisor -> worker process, its device's default decoder), of both decoders
in process (fused: CPU's default; graph: tinygrad-generated kernels, what other devices run), and of the
independent numpy reference decoder (tests/support/reference_llama.py); then constrained decoding's cost: greedy and
sampled under a JSON Schema grammar (models/constraint.py) against the same unconstrained, interleaved.

    .venv/bin/python bench/generate.py [--max-tokens 32] [--daemon-only | --constrained-only]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DEV", "CPU")

import numpy as np
import trio
from _common import scratch_dir

from tests.support.reference_llama import NumpyLlama, gguf_path
from trio_gpuworker import Supervisor
from trio_gpuworker._proto import Generate
from trio_gpuworker.daemon.config import DEFAULT_LM, EMBEDDED_DEFAULT, parse_config
from trio_gpuworker.llm_tokenizer import ChatTokenizer
from trio_gpuworker.models.sampling import GREEDY, SamplingParams

QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.",
             "Explain in one sentence what a GPU does."]


def prompts(tok: ChatTokenizer) -> list[np.ndarray]:
    return [np.asarray(tok.encode(tok.apply_chat_template([{"role": "user", "content": q}])), np.int32)
            for q in QUESTIONS]


async def daemon_run(ids: list[np.ndarray], max_tokens: int) -> tuple[list[tuple[float, float, int]], ...]:
    """(seconds to first token, seconds total, tokens) per prompt, through the lane's worker process: GENERATE on
    the lane (first PROGRESS), then Supervisor.generate streamed (its first text delta, as an SSE client sees
    it, chat template and tokenization included)."""
    env = {"GPUWORKER_STATE_DIR": str(ROOT / ".state"), "GPUWORKER_RUNTIME_DIR": str(scratch_dir("gw-gen-"))}
    cfg = parse_config(EMBEDDED_DEFAULT, Path.cwd(), env).supervisor
    cfg = type(cfg)(**{**cfg.__dict__, "lanes": tuple(ln for ln in cfg.lanes if DEFAULT_LM in ln.models)})
    out = []
    async with Supervisor(cfg) as sup:
        lane = sup.pick_lane(DEFAULT_LM)
        for p in ids:
            first: list[float] = []
            t0 = time.perf_counter()
            reply = await lane.call(Generate(model_ref=DEFAULT_LM, max_tokens=max_tokens, raw=p.tobytes()),
                                    on_progress=lambda m: first.append(time.perf_counter()) if not first else None)
            out.append((first[0] - t0, time.perf_counter() - t0, reply.n_gen))
        streamed = []
        for q in QUESTIONS:
            first = []
            t0 = time.perf_counter()
            got = await sup.generate(messages=[{"role": "user", "content": q}], model=DEFAULT_LM,
                                     max_tokens=max_tokens,
                                     on_delta=lambda d: first.append(time.perf_counter()) if not first else None)
            streamed.append((first[0] - t0, time.perf_counter() - t0, got["n_gen"]))
    return out, streamed


def inprocess_run(ids: list[np.ndarray], max_tokens: int, decoder: str,
                  sampling: SamplingParams = GREEDY) -> list[tuple[float, float, int]]:
    from trio_gpuworker.models.llama import LlamaLM
    from trio_gpuworker.models.llama_fused import FusedLlamaLM

    lm = (FusedLlamaLM if decoder == "fused" else LlamaLM).load(gguf_path())  # warms up: captures both graphs
    out = []
    for p in ids:
        first: list[float] = []
        t0 = time.perf_counter()
        gen, _ = lm.generate(p, max_tokens, lambda n: first.append(time.perf_counter()) if n == 1 else None,
                             sampling=sampling)
        out.append((first[0] - t0, time.perf_counter() - t0, len(gen)))
    return out


# constrained decoding's bench: a JSON object whose one string the model fills until max_tokens, so every step
# is masked (the kernel's argmax checked against the grammar, the logits masked where it refuses one)
ANSWER_SCHEMA = ('start: %json {"x-guidance": {"whitespace_flexible": false}, "type": "object", '
                 '"properties": {"answer": {"type": "string"}}, "required": ["answer"], '
                 '"additionalProperties": false}')


def constrained_vs_plain(ids: list[np.ndarray], max_tokens: int, rounds: int = 3) -> str:
    """Constrained decoding's cost: the fused decoder loaded once, each prompt generated plain and under
    ANSWER_SCHEMA in turn (greedy, then sampled), `rounds` times, so load on a shared machine falls on both sides
    alike. Tokens/s over all runs, first token included, and the decode steps' alone (ms/token after the first)."""
    from trio_gpuworker.models.constraint import Grammars
    from trio_gpuworker.models.llama_fused import FusedLlamaLM

    lm = FusedLlamaLM.load(gguf_path())
    grammars = Grammars(ChatTokenizer.from_gguf(gguf_path()).tokenizer, lm.vocab_size, lm.eos_ids)
    grammars.constraint(ANSWER_SCHEMA)  # compiled once, as a worker keeps it
    rows: dict[tuple[str, bool], list[tuple[float, float, int]]] = {}
    for _ in range(rounds):
        for p in ids:
            for sampling in (GREEDY, SamplingParams(temperature=0.8, top_p=0.95, seed=1)):
                for constrained in (False, True):
                    first: list[float] = []
                    constraint = grammars.constraint(ANSWER_SCHEMA) if constrained else None
                    t0 = time.perf_counter()
                    gen, _ = lm.generate(p, max_tokens, lambda n: first.append(time.perf_counter()) if n == 1
                                         else None, sampling=sampling, constraint=constraint)
                    key = ("greedy" if sampling.greedy else "sampled", constrained)
                    rows.setdefault(key, []).append((first[0] - t0, time.perf_counter() - t0, len(gen)))
    out = []
    for what in ("greedy", "sampled"):
        (r0, _, s0), (r1, _, s1) = summary(rows[(what, False)]), summary(rows[(what, True)])
        n0, n1 = (sum(r[2] for r in rows[(what, c)]) for c in (False, True))
        out.append(f"constrained / unconstrained, {what} ({n1} / {n0} tokens): {r1 / r0:.2f}x tokens/s "
                   f"({r1:.1f} / {r0:.1f}), {s0 / s1:.2f}x per decode step ({s1:.2f} / {s0:.2f} ms)")
    return "\n".join(out) + "\n(target: constrained greedy >= 0.9x the tokens/s of unconstrained)"


def reference_run(ids: list[np.ndarray], n: int) -> list[tuple[float, float, int]]:
    ref = NumpyLlama(gguf_path())
    out = []
    for p in ids:
        t0 = time.perf_counter()
        ref.generate(list(p), 1)
        ttft = time.perf_counter() - t0
        t0 = time.perf_counter()
        ref.generate(list(p), n)
        out.append((ttft, time.perf_counter() - t0, n))
    return out


def summary(rows: list[tuple[float, float, int]]) -> tuple[float, float, float]:
    """(tokens/s over all prompts, median time to first token in ms, median ms per token after the first)."""
    return (sum(r[2] for r in rows) / sum(r[1] for r in rows), statistics.median(r[0] for r in rows) * 1000,
            statistics.median((r[1] - r[0]) / max(r[2] - 1, 1) for r in rows) * 1000)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--daemon-only", action="store_true", help="only the daemon's lane.call row, for A/B runs")
    p.add_argument("--constrained-only", action="store_true", help="only constrained decoding's ratios")
    args = p.parse_args()
    ids = prompts(ChatTokenizer.from_gguf(gguf_path()))
    if args.constrained_only:
        print(constrained_vs_plain(ids, args.max_tokens))
        return
    if args.daemon_only:
        rate, ttft, step = summary(trio.run(daemon_run, ids, args.max_tokens)[0])
        print(f"daemon (Supervisor -> worker, UDS): {rate:.1f} tokens/s, TTFT {ttft:.0f} ms, {step:.2f} ms/token")
        return
    daemon, streamed = trio.run(daemon_run, ids, args.max_tokens)
    sampled = SamplingParams(temperature=0.8, top_p=0.95, seed=1)
    results = {
        "in-process, fused decoder (CPU default)": inprocess_run(ids, args.max_tokens, "fused"),
        "in-process, fused, sampled T=0.8 top_p=.95": inprocess_run(ids, args.max_tokens, "fused", sampled),
        "in-process, graph decoder (other devices)": inprocess_run(ids, args.max_tokens, "graph"),
        "daemon (Supervisor -> worker, UDS)": daemon,
        "daemon, streamed (TTFT: first text delta)": streamed,
        "numpy reference decoder": reference_run(ids, min(args.max_tokens, 16)),
    }
    base = summary(results["numpy reference decoder"])[0]
    print(f"SmolLM2-135M-Instruct Q4_1, greedy, {len(ids)} chat prompts of {[len(i) for i in ids]} tokens, "
          f"max_tokens {args.max_tokens}, {os.cpu_count()} CPUs, DEV={os.environ['DEV']}")
    print(f"{'path':<44}{'tokens/s':>10}{'TTFT ms':>10}{'ms/token':>10}{'ratio':>8}")
    for name, rows in results.items():
        rate, ttft, step = summary(rows)
        print(f"{name:<44}{rate:>10.2f}{ttft:>10.0f}{step:>10.1f}{rate / base:>7.2f}x")
    print("(ratio = tokens/s / numpy reference; TTFT includes the prompt's prefill; tokens/s counts it too;"
          " ms/token = (total - TTFT) / (tokens - 1))")
    print(constrained_vs_plain(ids, args.max_tokens))


if __name__ == "__main__":
    main()
