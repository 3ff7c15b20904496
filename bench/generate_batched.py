"""Batched generation through the daemon (Supervisor -> one SmolLM2 worker process, CPU's fused decoder), one run:
one client alone against N concurrent clients, whose requests the daemon decodes together (GENERATE_PACKED), and
against the same N clients sent as plain GENERATEs, which run one after another (what a worker without batching
gets). Every client asks the same chat prompts (rotated), greedy, streamed: per-token latency is the time between a
client's text deltas, (last delta - first delta) / (tokens - 1), as a streaming user sees it.

    .venv/bin/python bench/generate_batched.py [--clients 4] [--max-tokens 64] [--rounds 2] [--threads 2]

--threads sets the model's runtime_config `threads` (the cores one fused step uses), for the lone client and the
batch alike.
"""

from __future__ import annotations

import argparse
import dataclasses
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

from trio_gpuworker import Supervisor
from trio_gpuworker._proto import Generate
from trio_gpuworker.daemon.config import DEFAULT_LM, EMBEDDED_DEFAULT, parse_config

QUESTIONS = ["Write a short story about a lighthouse keeper.", "Explain how a bicycle works.",
             "Describe the water cycle for a child.", "Write a poem about autumn leaves.",
             "Give advice to a new programmer."]


class Client:
    """One client's requests: tokens, seconds, and per-token latencies (ms)."""

    def __init__(self) -> None:
        self.tokens, self.latency_ms = 0, []

    async def ask(self, sup: Supervisor, q: str, max_tokens: int, stream: bool) -> None:
        stamps: list[float] = []
        t0 = time.perf_counter()
        got = await sup.generate(messages=[{"role": "user", "content": q}], model=DEFAULT_LM, max_tokens=max_tokens,
                                 on_delta=(lambda d: stamps.append(time.perf_counter())) if stream else None)
        n = got["n_gen"]
        self.tokens += n
        if stream and len(stamps) > 1 and n > 1:
            self.latency_ms.append((stamps[-1] - stamps[0]) / (n - 1) * 1000)
        elif not stream:
            self.latency_ms.append((time.perf_counter() - t0) / max(n, 1) * 1000)

    async def ask_plain(self, sup: Supervisor, ids: np.ndarray, max_tokens: int) -> None:
        t0 = time.perf_counter()
        reply = await sup.pick_lane(DEFAULT_LM).call(Generate(model_ref=DEFAULT_LM, max_tokens=max_tokens,
                                                              raw=ids.tobytes()))
        self.tokens += reply.n_gen
        self.latency_ms.append((time.perf_counter() - t0) / max(reply.n_gen, 1) * 1000)


async def clients(sup: Supervisor, n: int, rounds: int, max_tokens: int, mode: str) -> tuple[float, list[float]]:
    """(aggregate tokens/s, each client's median per-token latency in ms) of `n` concurrent clients."""
    tok = sup.chat_tokenizer(DEFAULT_LM)
    cs = [Client() for _ in range(n)]

    async def run(i: int) -> None:
        for r in range(rounds):
            for k in range(len(QUESTIONS)):
                q = QUESTIONS[(i + k + r) % len(QUESTIONS)]
                if mode == "plain":
                    text = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
                    await cs[i].ask_plain(sup, np.asarray(tok.encode(text), dtype="<i4"), max_tokens)
                else:
                    await cs[i].ask(sup, q, max_tokens, stream=mode == "streamed")

    t0 = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for i in range(n):
            nursery.start_soon(run, i)
    wall = time.perf_counter() - t0
    return sum(c.tokens for c in cs) / wall, [statistics.median(c.latency_ms) for c in cs]


async def main_async(args: argparse.Namespace) -> None:
    env = {"GPUWORKER_STATE_DIR": str(ROOT / ".state"), "GPUWORKER_RUNTIME_DIR": str(scratch_dir("gw-genb-"))}
    cfg = parse_config(EMBEDDED_DEFAULT, Path.cwd(), env).supervisor
    models = tuple(dataclasses.replace(m, runtime_config={**m.runtime_config.to_map(), "threads": args.threads})
                   if args.threads and m.id == DEFAULT_LM else m for m in cfg.models)
    cfg = type(cfg)(**{**cfg.__dict__, "models": models,
                       "lanes": tuple(ln for ln in cfg.lanes if DEFAULT_LM in ln.models)})
    async with Supervisor(cfg) as sup:
        await sup.wait_started()
        await clients(sup, 1, 1, 8, "streamed")  # warm: tokenizer, first requests
        print(f"SmolLM2-135M-Instruct Q4_1, greedy chat, max_tokens {args.max_tokens}, {args.rounds} round(s) of "
              f"{len(QUESTIONS)} prompts per client, {os.cpu_count()} CPUs, DEV={os.environ['DEV']}, "
              f"threads {args.threads or 'default'}, "
              f"load average {os.getloadavg()[0]:.2f} at start")
        print(f"{'clients':<44}{'tokens/s':>10}{'ratio':>8}{'ms/token (each client)':>30}{'vs lone':>9}")
        for mode in ("streamed", "whole"):
            lone, (lone_ms,) = await clients(sup, 1, args.rounds, args.max_tokens, mode)
            many, many_ms = await clients(sup, args.clients, args.rounds, args.max_tokens, mode)
            print(f"{'1 client, ' + mode:<44}{lone:>10.1f}{1:>7.2f}x{lone_ms:>30.1f}{1:>8.2f}x")
            each = " ".join(f"{m:.1f}" for m in many_ms)
            print(f"{f'{args.clients} clients, {mode}, batched':<44}{many:>10.1f}{many / lone:>7.2f}x{each:>30}"
                  f"{max(many_ms) / lone_ms:>8.2f}x")
        plain, plain_ms = await clients(sup, args.clients, args.rounds, args.max_tokens, "plain")
        each = " ".join(f"{m:.1f}" for m in plain_ms)
        print(f"{f'{args.clients} clients, plain GENERATE (one at a time)':<44}{plain:>10.1f}{plain / lone:>7.2f}x"
              f"{each:>30}{max(plain_ms) / lone_ms:>8.2f}x")
        print(f"(ratio = tokens/s / the lone client's of the same mode; vs lone = the slowest client's ms/token / the "
              f"lone client's; streamed: between text deltas; whole/plain: request time / tokens; load average "
              f"{os.getloadavg()[0]:.2f} at the end)")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--threads", type=int, default=0, help="the model's runtime_config threads (0: the default)")
    trio.run(main_async, p.parse_args())


if __name__ == "__main__":
    main()
