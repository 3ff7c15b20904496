"""/v1/embeddings under concurrent load: throughput and p50/p99 latency with dynamic batching off and on,
in one run, against the real MiniLM worker. The load generator is a separate process on loopback (so it
does not share the daemon's event loop or GIL); each client sends one short sentence per request.

    .venv/bin/python bench/http.py [--concurrency 16] [--requests 160] [--delay-ms 2] [--worker both]

Prints both phases and the ratios (batching on / off), for the MiniLM worker and for the scripted fake
worker, which answers at once and so shows what batching saves on the daemon side alone.

    .venv/bin/python bench/http.py --case healthz [--worker fake] [--concurrency 8] [--requests 40]

/healthz latency (p50/p99/max, polled every 5 ms) while 8 MB single-input embeddings and the hostile mix of
tests/support/hostile_traffic.py run from another process; the target is p99 < 50 ms. Also the daemon's peak RSS.
"""

from __future__ import annotations

import sys
from pathlib import Path

# This file is named http.py: keep its folder behind the standard library on sys.path, or `import http`
# (hypercorn, httpx) would find this script.
HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
sys.path.insert(0, str(HERE.parent))
sys.path.append(str(HERE))

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("DEV", "CPU")

import httpx
import trio
from _common import minilm_daemon_config, sentences

from trio_gpuworker import BatchPolicy
from trio_gpuworker.daemon.config import DEFAULT_MODEL
from trio_gpuworker.daemon.logs import setup_logging
from trio_gpuworker.daemon.main import run_daemon

WARM_SIZES = (1, 4, 8, 16, 32)  # the encoder's batch buckets: compile each once before measuring
FAKE_SCALE = 10  # the fake worker answers at once: more requests for a stable figure


def config(listen: str, worker: str):
    lane_extra = ""
    if worker == "fake":  # a scripted worker that answers at once: what the daemon itself costs
        from tests.support.fakes import fake_command

        lane_extra = f"worker_command = {json.dumps(list(fake_command()))}\n"
    return minilm_daemon_config(listen, lane_extra)


# --- the load generator (a child process) ----------------------------------------------------------


async def generate_load(url: str, concurrency: int, requests: int) -> dict[str, object]:
    texts = sentences(requests, seed=11, lo=4, hi=10)  # short: one length bucket
    latencies: list[float] = []
    errors: list[int] = []
    queue = list(enumerate(texts))
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:

        async def worker() -> None:
            while queue:
                _, text = queue.pop()
                t0 = time.perf_counter()
                r = await client.post("/v1/embeddings", json={"model": DEFAULT_MODEL, "input": text})
                latencies.append(time.perf_counter() - t0)
                if r.status_code != 200:
                    errors.append(r.status_code)

        t0 = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for _ in range(concurrency):
                nursery.start_soon(worker)
        wall = time.perf_counter() - t0
    return {"latencies": latencies, "wall_s": wall, "errors": errors}


def load_main(argv: list[str]) -> None:
    url, concurrency, requests = argv[0], int(argv[1]), int(argv[2])
    print(json.dumps(trio.run(generate_load, url, concurrency, requests)))


# --- the daemon side ---------------------------------------------------------------------------------


def quantile(xs: list[float], q: float) -> float:
    return statistics.quantiles(xs, n=100, method="inclusive")[int(q * 100) - 1]


async def phase(url: str, concurrency: int, requests: int) -> dict[str, float]:
    r = await trio.run_process([sys.executable, __file__, "--load", url, str(concurrency), str(requests)],
                               capture_stdout=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    out = json.loads(r.stdout)
    if out["errors"]:
        raise RuntimeError(f"{len(out['errors'])} requests failed: {sorted(set(out['errors']))}")
    lat = out["latencies"]
    return {"throughput": len(lat) / out["wall_s"], "p50_ms": 1000 * quantile(lat, 0.50),
            "p99_ms": 1000 * quantile(lat, 0.99)}


async def bench_worker(worker: str, concurrency: int, requests: int, delay_ms: float) -> dict[str, dict[str, float]]:
    async with trio.open_nursery() as nursery:
        daemon = await nursery.start(run_daemon, config("127.0.0.1:0", worker))
        sup, binds = daemon.sup, daemon.binds
        url = binds[0]
        batcher = sup.batcher
        if worker == "real":
            rows = await sup.tokenize_async(sentences(32, seed=3, lo=4, hi=10), model=DEFAULT_MODEL)
            t0 = time.perf_counter()
            for n in WARM_SIZES:
                await sup.embed_ids(rows[:n], model=DEFAULT_MODEL, pooling="mean", normalize=True)
            print(f"warm-up (compiling batch shapes {WARM_SIZES}): {time.perf_counter() - t0:.1f} s")
        await phase(url, concurrency, concurrency)  # connections, client import, first requests

        results = {}
        for name, delay in (("off", 0.0), ("on", delay_ms / 1000)):
            batcher.policy = BatchPolicy(max_items=batcher.policy.max_items, max_delay_s=delay)
            before = batcher.batches
            results[name] = await phase(url, concurrency, requests)
            sent = batcher.batches - before
            results[name]["rows_per_batch"] = requests / sent if sent else 1.0
        nursery.cancel_scope.cancel()
    return results


# --- /healthz under hostile load -----------------------------------------------------------------------

HEALTHZ_POLL_S = 0.005
BIG_INPUT_CHARS = 8_000_000  # the 8 MB input that once stalled /healthz for 27 s


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def bench_healthz(worker: str, concurrency: int, requests: int) -> None:
    big = json.dumps({"model": DEFAULT_MODEL, "input": ["word " * (BIG_INPUT_CHARS // 5)]}).encode()
    health: list[float] = []
    codes: dict[str, int] = {}
    rss_before = rss_peak = rss_mb()
    async with trio.open_nursery() as nursery:
        daemon = await nursery.start(run_daemon, config("127.0.0.1:0", worker))
        sup, binds = daemon.sup, daemon.binds
        url = binds[0]
        done = trio.Event()

        async def poll(client: httpx.AsyncClient) -> None:
            nonlocal rss_peak
            while not done.is_set():
                t0 = time.perf_counter()
                await client.get("/healthz")
                health.append(time.perf_counter() - t0)
                rss_peak = max(rss_peak, rss_mb())
                await trio.sleep(HEALTHZ_POLL_S)

        async def big_inputs() -> None:  # from a child, like the rest of the load
            script = (f"import httpx,sys; c=httpx.Client(base_url={url!r}, timeout=600); b=sys.stdin.buffer.read()\n"
                      f"for _ in range({max(1, requests // 10)}): print(c.post('/v1/embeddings', content=b, "
                      "headers={'content-type':'application/json'}).status_code)")
            r = await trio.run_process([sys.executable, "-c", script], stdin=big, capture_stdout=True)
            for code in r.stdout.split():
                codes[f"8MB:{code.decode()}"] = codes.get(f"8MB:{code.decode()}", 0) + 1

        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            await client.get("/healthz")
            async with trio.open_nursery() as polling:  # the poller ends before its client closes
                polling.start_soon(poll, client)
                async with trio.open_nursery() as load:
                    load.start_soon(big_inputs)
                    r = await trio.run_process(
                        [sys.executable, "-m", "tests.support.hostile_traffic", url, str(concurrency), str(requests),
                         "0.3", DEFAULT_MODEL], capture_stdout=True,
                        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
                    codes.update(json.loads(r.stdout))
                done.set()
            strikes = sum(s["strikes"] for s in sup.status())
        nursery.cancel_scope.cancel()
    h = sorted(health)
    print(f"/healthz while 8 MB inputs and hostile requests run ({worker} worker, {concurrency} clients x "
          f"{requests} requests, {os.cpu_count()} CPUs): n={len(h)} p50={1000 * h[len(h) // 2]:.1f} ms "
          f"p99={1000 * quantile(h, 0.99):.1f} ms max={1000 * h[-1]:.1f} ms (target p99 < 50 ms)")
    print(f"  answers: {dict(sorted(codes.items()))}; strikes: {strikes}; daemon RSS {rss_before:.0f} -> peak "
          f"{rss_peak:.0f} MiB")


def report(title: str, results: dict[str, dict[str, float]]) -> None:
    print(title)
    print(f"  {'batching':<10}{'req/s':>10}{'p50 ms':>10}{'p99 ms':>10}{'rows/EMBED_BATCH':>18}")
    for name, r in results.items():
        print(f"  {name:<10}{r['throughput']:>10.1f}{r['p50_ms']:>10.1f}{r['p99_ms']:>10.1f}"
              f"{r['rows_per_batch']:>18.1f}")
    on, off = results["on"], results["off"]
    print(f"  ratio on/off: throughput {on['throughput'] / off['throughput']:.2f}x, "
          f"p50 {on['p50_ms'] / off['p50_ms']:.2f}x, p99 {on['p99_ms'] / off['p99_ms']:.2f}x")


async def bench(workers: list[str], concurrency: int, requests: int, delay_ms: float) -> None:
    runs = {w: await bench_worker(w, concurrency, requests * (FAKE_SCALE if w == "fake" else 1), delay_ms)
            for w in workers}
    print(f"one sentence per request, {concurrency} concurrent clients in a separate process, loopback, 1 lane, "
          f"{os.cpu_count()} CPUs, DEV={os.environ['DEV']}, batch delay {delay_ms:g} ms")
    for w, results in runs.items():
        n = requests * (FAKE_SCALE if w == "fake" else 1)
        report(f"{'MiniLM worker (tinygrad)' if w == 'real' else 'fake worker (daemon + IPC cost only)'}, "
               f"{n} requests:", results)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--load":
        load_main(sys.argv[2:])
        return
    p = argparse.ArgumentParser()
    p.add_argument("--concurrency", type=int, default=None, help="default 16 (batching), 8 (healthz)")
    p.add_argument("--requests", type=int, default=None, help="default 160 (batching), 40 (healthz)")
    p.add_argument("--delay-ms", type=float, default=2.0)
    p.add_argument("--worker", choices=("real", "fake", "both"), default="both",
                   help="the MiniLM worker, the scripted fake (daemon cost alone), or both")
    p.add_argument("--case", choices=("batching", "healthz"), default="batching")
    args = p.parse_args()
    setup_logging("plain", "warning")
    if args.case == "healthz":
        trio.run(bench_healthz, "real" if args.worker == "real" else "fake", args.concurrency or 8,
                 args.requests or 40)
        return
    workers = ["real", "fake"] if args.worker == "both" else [args.worker]
    trio.run(bench, workers, args.concurrency or 16, args.requests or 160, args.delay_ms)


if __name__ == "__main__":
    main()
