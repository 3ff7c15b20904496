"""`gpuworkerctl tune MODEL`: BEAM-search a model's warm-up shapes ahead of time, on the operator's schedule.

It runs what a lane's LOAD runs, without the daemon: one worker on the device of the first lane serving the
model, with the daemon's state directory, so the search results land in the kernel cache (CACHEDB) and the
captured JITs in the JIT cache that every later worker, restart and standby of the daemon reads. The daemon
itself may keep serving meanwhile; its workers pick the results up at their next start.

BEAM tunes tinygrad-generated kernels only: the graph encoder and decoder (`encoder`/`decoder = "graph"`, the
default off CPU). The fused CPU encoder and decoder run their own C kernels instead, which BEAM does not search.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import trio

from .._config import LaneConfig
from .._errors import ConfigError
from .._kinds import EncoderRuntime
from ..models.shapes import tuned_shapes
from ..supervisor import Lane, Supervisor
from .admin import LaneAdmin
from .config import DaemonConfig
from .tuned import TunedRecord, tuner_device

TUNE_LANE = "tune"
LLAMA_WARMUP_STEPS = 4  # models/greedy.py warmup(), shared by both decoders: progress 1..4 over both captures


def planned_steps(cfg: DaemonConfig, model: str) -> int:
    """How many PROGRESS steps after the first the tuning LOAD reports: one per warm-up shape of an encoder (the
    configured `warmup_shapes`, else the tuned shapes), the greedy loop's warm-up steps for a decoder."""
    mc = cfg.supervisor.model(model)
    if not isinstance(mc.runtime_config, EncoderRuntime):
        return LLAMA_WARMUP_STEPS
    given = mc.runtime_config.warmup_shapes
    return len(given) if given else len(tuned_shapes(mc.max_tokens))


async def tune(cfg: DaemonConfig, model: str, beam: int | None = None,
               on_progress: Callable[[dict[str, Any]], None] | None = None, *, env: Mapping[str, str] | None = None,
               load_window_s: float | None = None, alongside: Callable[[Lane], Awaitable[None]] | None = None,
               record: TunedRecord | None = None) -> dict[str, Any]:
    """Load `model` once with BEAM `beam` (default: its configured `beam`) into the daemon's caches, and record it
    as tuned (tuned.py) when that is its configured beam. The daemon's background tuner adds its worker's `env`
    (priority, cores), a longer `load_window_s` (it pauses the search while requests run) and `alongside(lane)`,
    run beside the LOAD until it ends (the pacing). Errors are raised as themselves, never in a group."""
    sc = cfg.supervisor
    mc = sc.model(model)
    width = mc.beam if beam is None else beam
    if width < 1:
        raise ConfigError(f"models.{model}.beam is 0: nothing to tune (set beam = N there, or pass --beam N)")
    serving = next((ln for ln in sc.lanes if model in ln.models), None)
    lane = LaneConfig(TUNE_LANE, (), device=tuner_device(sc, model),
                      env={**(serving.env if serving else {}), **(env or {})})
    windows = sc.windows if load_window_s is None else replace(sc.windows, load_s=load_window_s)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="gw-tune-") as run_dir:
        tuned_cfg = replace(sc, lanes=(lane,), runtime_dir=Path(run_dir), windows=windows,
                            models=tuple(replace(m, beam=width) if m.id == model else m for m in sc.models))
        async with Supervisor(tuned_cfg) as sup:
            async with trio.open_nursery() as nursery:
                if alongside is not None:
                    nursery.start_soon(alongside, sup.lanes[TUNE_LANE])
                failed: Exception | None = None
                try:  # caught here, not raised in the nursery: a failed LOAD reaches the caller as itself
                    result = await LaneAdmin(sup).load_model(TUNE_LANE, model, on_progress=on_progress)
                except Exception as exc:
                    failed = exc
                nursery.cancel_scope.cancel()
            if failed is not None:
                raise failed
            log = sup.lanes[TUNE_LANE].log.tail(1 << 16)
    if width == mc.beam:
        (record or TunedRecord(sc.state_dir)).add(mc, lane.device)
    summary = next((ln.split(": ", 2)[-1] for ln in reversed(log.splitlines()) if f"beam {width}:" in ln),
                   "already tuned: the captured JITs were restored from the cache, nothing was compiled")
    return {"model": model, "beam": width, "configured_beam": mc.beam, "device": lane.device,
            "seconds": round(time.monotonic() - t0, 1), "summary": summary, "state_dir": str(sc.state_dir),
            "cold_load_ms": result.get("cold_load_ms")}
