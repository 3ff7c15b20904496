"""A real daemon, in-process, serving generate models on real workers: for the tests of the OpenAI and vLLM
completion routes and of the clients that call them."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import trio

from tests.support.config import REAL_WORKER, daemon_config
from tests.support.state import SESSION_STATE, short_dir
from trio_gpuworker import LaneConfig, ModelConfig
from trio_gpuworker.daemon.main import run_daemon


@asynccontextmanager
async def serving(where: Path, *models: ModelConfig) -> AsyncIterator[str]:
    """A daemon with one generate lane serving `models` (the session's kernel cache) under the library's own
    windows and HTTP limits: its base URL."""
    lane = LaneConfig("gen0", tuple(m.id for m in models))
    cfg = daemon_config(where, lanes=(lane,), models=models, state_dir=SESSION_STATE, runtime_dir=short_dir("gw-vllm-"),
                        timeout_s=120.0, http={"max_body_bytes": 8 << 20}, **REAL_WORKER)
    async with trio.open_nursery() as nursery:
        daemon = await nursery.start(run_daemon, cfg)
        yield daemon.binds[0]
        nursery.cancel_scope.cancel()
