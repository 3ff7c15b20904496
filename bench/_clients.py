"""Concurrent HTTP clients in their own process (so they share neither the daemon's event loop nor its GIL):
each sends one text per POST /v1/embeddings until the list is done. Run by the benchmarks:

    python bench/_clients.py URL CONCURRENCY TEXTS.json   # prints {"latencies", "wall_s", "errors"} as JSON
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

# bench/http.py would shadow the standard library's `http` (httpx imports it): drop this folder from the path
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import httpx
import trio

MODEL = "all-MiniLM-L6-v2"


async def generate_load(url: str, concurrency: int, texts: list[str]) -> dict[str, object]:
    latencies: list[float] = []
    errors: list[int] = []
    queue = list(reversed(texts))
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:

        async def worker() -> None:
            while queue:
                text = queue.pop()
                t0 = time.perf_counter()
                r = await client.post("/v1/embeddings", json={"model": MODEL, "input": text})
                latencies.append(time.perf_counter() - t0)
                if r.status_code != 200:
                    errors.append(r.status_code)

        t0 = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for _ in range(concurrency):
                nursery.start_soon(worker)
        wall = time.perf_counter() - t0
    return {"latencies": latencies, "wall_s": wall, "errors": errors}


if __name__ == "__main__":
    url, concurrency, path = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
    print(json.dumps(trio.run(generate_load, url, concurrency, json.loads(path.read_text()))))
