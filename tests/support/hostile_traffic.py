"""Normal requests with hostile ones mixed in, from their own process, so the daemon under test does not share
its CPU with the client's work (the soak test and bench/http.py measure the daemon's /healthz under it).

    python -m tests.support.hostile_traffic URL CALLERS REQUESTS [HOSTILE_SHARE [MODEL]]
        ->  one JSON line: {code: count}
"""

from __future__ import annotations

import json
import random
import sys
from urllib.parse import urlsplit

import httpx
import trio

MODEL = "fake-embed"


def hostile(model: str) -> list[tuple[str, bytes]]:
    m = json.dumps(model).encode()
    return [
        ("/v1/embeddings", b'{"model":%s,"input":["x\\ud800"]}' % m),
        ("/v1/rerank", b'{"model":%s,"query":"\\udfff","documents":["a"]}' % m),
        ("/v1/embeddings", b'{"a":' + b"[" * 50_000 + b"]" * 50_000 + b"}"),
        ("/v1/embeddings", b'{"model":%s,"input":["a"],"encoding_format":"int8"}' % m),
        ("/v1/embeddings", b'{"model":%s,"input":' % m),
        ("/v1/embeddings", json.dumps({"model": model, "input": ["word " * 400_000]}).encode()),  # 2 MB, one text
        ("/v1/rerank", json.dumps({"model": model, "query": "q", "documents": ["doc " * 300] * 600}).encode()),
        ("/v1/completions", b'{"model":%s,"prompt":"hi","max_tokens":1e9}' % m),
        ("/v1/lanes/lane0%0a", b"{}"),
    ]


OVER_LIMIT = b"POST /v1/embeddings HTTP/1.1\r\nhost: x\r\ncontent-length: 5000000000\r\n\r\n"


async def over_the_limit(url: str) -> str:
    """A body declared far over max_body_bytes on a raw socket: answered before any of it is sent."""
    u = urlsplit(url)
    stream = await trio.open_tcp_stream(u.hostname or "127.0.0.1", u.port or 80)
    data = b""
    try:
        await stream.send_all(OVER_LIMIT)
        with trio.fail_after(5):
            while b"\r\n\r\n" not in data and (chunk := await stream.receive_some(4096)):
                data += chunk
    finally:
        await stream.aclose()
    return "request_too_large" if data.startswith(b"HTTP/1.1 413") else f"raw:{data[:20]!r}"


async def caller(http: httpx.AsyncClient, url: str, c: int, n: int, share: float, codes: dict[str, int],
                 model: str) -> None:
    rng = random.Random(c)
    bad = hostile(model)
    for r in range(n):
        x = rng.random()
        if x < share / 10:
            code = await over_the_limit(url)
        else:
            if x < share:
                path, body = bad[rng.randrange(len(bad))]
            elif x < (1 + share) / 2:
                path, body = "/v1/embeddings", json.dumps({"model": model, "input": [f"{c} {r}"] * 3}).encode()
            else:
                path, body = "/v1/rerank", json.dumps({"model": model, "query": "q",
                                                       "documents": [f"{c}", f"{r}"]}).encode()
            resp = await http.post(path, content=body, headers={"content-type": "application/json"})
            code = "ok" if resp.status_code == 200 else str(resp.json()["error"]["code"])
            if resp.status_code >= 500:
                code = f"{resp.status_code}:{code}"
        codes[code] = codes.get(code, 0) + 1


async def main(url: str, callers: int, requests: int, share: float, model: str = MODEL) -> dict[str, int]:
    codes: dict[str, int] = {}
    # idle connections are dropped before the server's keep-alive timeout (hypercorn's 5 s, httpx's default
    # expiry too): else, on a loaded machine, a POST can go out on a connection the server is closing just then
    limits = httpx.Limits(keepalive_expiry=2.0)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as http, trio.open_nursery() as nursery:
        for c in range(callers):
            nursery.start_soon(caller, http, url, c, requests, share, codes, model)
    return codes


if __name__ == "__main__":
    url, callers, requests = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    share = float(sys.argv[4]) if len(sys.argv) > 4 else 0.3
    model = sys.argv[5] if len(sys.argv) > 5 else MODEL
    print(json.dumps(trio.run(main, url, callers, requests, share, model)))
