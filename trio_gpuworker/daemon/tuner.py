"""Serve first, tune in the background (docs/operations.md, 'Tuning in the background'): lanes whose kernels BEAM would
change start on tinygrad's
hand-coded ones; a tuner searches meanwhile in a worker of its own at low priority, paused while requests run;
once its kernels are in the cache, each lane rolls over to a worker that loads them, without failing a request.

What needs it: a model with a `beam` whose kernels are tinygrad-generated on its lane's device
(`ModelConfig.tunes_on`: the graph encoder and decoder; the CPU default's fused C kernels have nothing to tune)
and that no earlier search recorded (tuned.py). A tuner that fails is logged; the lanes keep serving untuned.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable
from typing import Any

import trio

from .._errors import GpuWorkerError
from .._worker_env import CPUS, NICE
from ..supervisor import Lane, LaneState, Supervisor
from .config import DaemonConfig
from .pacing import POLL_S, Pacer
from .tune import planned_steps, tune
from .tuned import TunedRecord, tuner_device

log = logging.getLogger("trio_gpuworker.daemon")

TUNER_NICE = 19  # serving keeps the cores' priority
TUNER_LOAD_WINDOW_S = 3600.0  # the tuning LOAD's silence window: its search is paused while requests run
ROLL_OVER_TIMEOUT_S = 600.0  # per lane: the tuned worker's LOAD (cached kernels) and the hand-over
PROGRESS_LOG_S = 10.0  # at most one "tuning ..." line this often


def to_tune(cfg: DaemonConfig, record: TunedRecord) -> list[str]:
    """The models whose lanes should start untuned while the tuner runs."""
    sc = cfg.supervisor
    return [m.id for m in sc.models if m.tunes_on(tuner_device(sc, m.id)) and not record.has(m, tuner_device(sc, m.id))]


def tuner_cpu() -> str:
    """The one core the tuner's worker may use: the last this daemon may run on."""
    return str(max(os.sched_getaffinity(0)))


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)  # the worker leads its own session: its compilers stop and go on with it
    except (ProcessLookupError, PermissionError):
        pass


class BackgroundTuner:
    """Tunes `models` one after the other once the lanes serve, then rolls their lanes over."""

    def __init__(self, cfg: DaemonConfig, models: list[str], record: TunedRecord,
                 on_tuned: Callable[[str], None] | None = None) -> None:
        self.cfg, self.models, self.record, self.on_tuned = cfg, list(models), record, on_tuned
        self.progress: dict[str, dict[str, Any]] = {m: {"phase": "waiting"} for m in models}
        self.finished = trio.Event()  # every model tuned and rolled over, or failed (its lanes stay untuned)

    def describe(self) -> str | None:
        """One clause for STATUS= and the log while something is being tuned; None otherwise."""
        for model, p in self.progress.items():
            if p["phase"] == "tuning":
                return f"tuning {model} kernels: {p['done']}/{p['total']}; serving meanwhile with untuned kernels"
            if p["phase"] == "rolling over":
                return f"rolling {model}'s lanes over to tuned kernels"
        return None

    async def run(self, sup: Supervisor) -> None:
        await sup.wait_started()
        for model in self.models:
            await self._one(sup, model)
        self.finished.set()

    async def _one(self, sup: Supervisor, model: str) -> None:
        mc, device = self.cfg.supervisor.model(model), tuner_device(self.cfg.supervisor, model)
        total, t0, said = planned_steps(self.cfg, model), time.monotonic(), [0.0]
        p = self.progress[model] = {"phase": "tuning", "done": 0, "total": total}
        log.info("tuning %s kernels for this %s (beam %d, %d shape(s)) in the background, at low priority; "
                 "serving meanwhile with untuned kernels", model, device, mc.beam, total)

        def progress(step: dict[str, Any]) -> None:
            done = min(max(int(step.get("completed") or 0) - 1, 0), total)  # the first PROGRESS is the setup
            p["done"] = done
            now = time.monotonic()
            if done and now - said[0] >= PROGRESS_LOG_S:
                said[0] = now
                left = (now - t0) / done * (total - done)
                log.info("tuning %s kernels for this %s: %d/%d, about %s left; serving meanwhile with untuned "
                         "kernels", model, device, done, total, _minutes(left))

        pacer = Pacer()
        try:
            await tune(self.cfg, model, on_progress=progress, env={NICE: str(TUNER_NICE), CPUS: tuner_cpu()},
                       load_window_s=TUNER_LOAD_WINDOW_S, alongside=lambda lane: self._pace(sup, lane, pacer),
                       record=self.record)
        except Exception as exc:  # a tuner is an optimisation: whatever ends it, the node keeps serving
            p.update(phase="failed", error=str(exc))
            log.warning("tuning %s failed after %.0f s; its lanes keep the untuned kernels: %s", model,
                        time.monotonic() - t0, exc, exc_info=not isinstance(exc, GpuWorkerError | OSError))
            return
        searched = time.monotonic() - t0
        p.update(phase="rolling over", done=total)
        try:
            lanes = await sup.roll_over(model, timeout=ROLL_OVER_TIMEOUT_S)
        except GpuWorkerError as exc:
            p.update(phase="failed", error=str(exc))
            log.warning("%s: tuned kernels are cached but a lane did not roll over (%s); it takes them at its "
                        "next restart", model, exc)
            return
        p.update(phase="tuned", seconds=round(searched, 1), paused_s=round(pacer.paused_s, 1))
        if self.on_tuned is not None:
            self.on_tuned(model)
        log.info("%s: tuned kernels took over on lane(s) %s (searched in %.0f s, %.0f s of it paused for "
                 "requests)", model, ", ".join(lanes) or "none", searched, pacer.paused_s)

    async def _pace(self, serving: Supervisor, tuner: Lane, pacer: Pacer) -> None:
        """SIGSTOP / SIGCONT the tuner's worker as the pacer says, from the states of `serving`'s lanes."""
        stopped: int | None = None
        try:
            while True:
                busy = any(ln.state is LaneState.BUSY for ln in serving.lanes.values())
                pause = pacer.paused(busy, trio.current_time())
                pid = tuner.pid
                if pause and stopped is None and pid is not None:
                    _signal_group(pid, signal.SIGSTOP)
                    stopped = pid
                elif not pause and stopped is not None:
                    _signal_group(stopped, signal.SIGCONT)
                    stopped = None
                await trio.sleep(POLL_S)
        finally:
            if stopped is not None:
                _signal_group(stopped, signal.SIGCONT)


def _minutes(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.0f} min"


__all__ = ["ROLL_OVER_TIMEOUT_S", "TUNER_LOAD_WINDOW_S", "TUNER_NICE", "BackgroundTuner", "TunedRecord", "to_tune"]
