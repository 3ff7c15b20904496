"""The Supervisor: lanes in one nursery, model routing, admin calls; the serving API is `ServingApi`."""

from __future__ import annotations

import math
from contextlib import AsyncExitStack
from dataclasses import replace
from functools import partial
from types import TracebackType
from typing import Any

import trio

from .._config import AdmissionPolicy, BatchPolicy, LaneConfig, ModelConfig, SupervisorConfig
from .._errors import (
    ClosedSupervisorError,
    InvalidRequest,
    LaneNotFound,
    ModelNotFound,
)
from .._proto import LaneState
from ._admission import Router, Scheduler
from ._api import ServingApi
from ._arena import ArenaManager
from ._batching import Batcher
from ._dataplane import DataPlane
from ._dispatch import EmbedDispatch
from ._events import EventBus
from ._gate import ModelGate
from ._generation import numbering
from ._jobs import LaneSettings, LoadSpec
from ._lane import Lane
from ._launcher import Launcher, ProcessLauncher
from ._models import DigestCache, load_spec
from ._spawn import default_runtime_dir, workers_dir
from ._tokenizers import Tokenizers


class Supervisor(ServingApi):
    """`async with Supervisor(config) as sup: vecs = await sup.embed(texts, model="all-MiniLM-L6-v2")`

    It owns its lanes, the router (lane choice and the drained set), admission (with an `admission` policy;
    the bare Python API runs without byte budgets) and the batcher (off unless `batching` enables it)."""

    def __init__(self, config: SupervisorConfig, *, admission: AdmissionPolicy | None = None,
                 batching: BatchPolicy | None = None, launcher: Launcher | None = None,
                 wait_for_lanes: bool = True, untuned: frozenset[str] = frozenset()) -> None:
        self.config = config
        # models whose lanes start on tinygrad's hand-coded kernels (beam 0) while a tuner searches in the
        # background; roll_over brings their configured beam in
        self.untuned = set(untuned)
        # True: `async with` returns once every lane's first start has settled. False: at once, while the lanes
        # start (the daemon listens meanwhile; a model none of its lanes serves yet gets ModelLoading)
        self._wait_for_lanes = wait_for_lanes
        self.runtime_dir = config.runtime_dir or default_runtime_dir(None, config.state_dir)
        self.events = EventBus()
        self.lanes: dict[str, Lane] = {}
        self.tokenizers = Tokenizers(lambda model: self.config.model(model))
        self._stack: AsyncExitStack | None = None
        self.arena: ArenaManager | None = None
        self.router = Router(config, self.lanes)
        self.scheduler = Scheduler(admission) if admission is not None else None
        self.dispatch = EmbedDispatch(self.router)
        self.gate = ModelGate()
        self.batcher = Batcher(batching or BatchPolicy(max_delay_s=0.0), send=self.dispatch,
                               slots=self.router.serving)
        self.dataplane: DataPlane | None = None  # rings, objects and steps; None without an arena
        self._nursery: trio.Nursery | None = None
        self._closed = False
        self._arena_env: dict[str, str] = {}
        self._generations = numbering()  # one numbering for all of this supervisor's lanes
        self._batcher_scope = trio.CancelScope()
        self._dataplane_scope = trio.CancelScope()
        self.launcher = launcher  # None: real worker processes (ProcessLauncher), made at start

    # --- lifecycle -----------------------------------------------------------------------------

    async def __aenter__(self) -> Supervisor:
        cfg = self.config
        workers_dir(self.runtime_dir)
        self._digests = DigestCache(cfg.state_dir / "digests.json")
        specs = {m.id: await load_spec(replace(m, beam=0) if m.id in self.untuned else m, self._digests)
                 for m in cfg.models}
        self._stack = AsyncExitStack()
        if cfg.arena_bytes:
            self.arena = self._stack.enter_context(ArenaManager(cfg.arena_bytes))
        env, fds = (self.arena.env(), self.arena.pass_fds) if self.arena is not None else ({}, ())
        if self.launcher is None:
            self.launcher = launcher = ProcessLauncher(self.runtime_dir, fds)
            self._stack.callback(launcher.close)  # after every worker is reaped: the nursery exits first
        self._arena_env = env
        self._nursery = await self._stack.enter_async_context(trio.open_nursery())
        try:
            await self._nursery.start(self._run_batcher)
            for lane_cfg in cfg.lanes:
                self.lanes[lane_cfg.id] = self._lane(lane_cfg, [specs[m] for m in lane_cfg.models])
            if self.arena is not None:
                self.dataplane = DataPlane(self.lanes, self.arena, self.events)
                await self._nursery.start(self._run_dataplane)
            for lane in self.lanes.values():
                await self._nursery.start(partial(lane.run, wait_for_start=self._wait_for_lanes))
        except BaseException as exc:
            await self._abort(exc)
            raise
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> bool | None:
        self.close()
        if exc is not None:
            await self._abort(exc)
            return None
        assert self._stack is not None
        return await self._stack.__aexit__(None, None, None)

    async def _abort(self, exc: BaseException) -> None:
        assert self._nursery is not None and self._stack is not None
        self.close()
        self._nursery.cancel_scope.cancel()  # workers are still killed and reaped: that path is shielded
        # the caller's exception propagates as itself, not wrapped in the nursery's ExceptionGroup
        await self._stack.__aexit__(None, None, None)

    def close(self) -> None:
        """Stop admitting; lanes finish what is queued and shut their workers down."""
        self._closed = self.router.closed = True
        self._batcher_scope.cancel()  # callers still waiting in a batch get ClosedSupervisorError
        self._dataplane_scope.cancel()
        for lane in self.lanes.values():
            lane.close()

    async def _run_dataplane(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        assert self.dataplane is not None
        with self._dataplane_scope:  # ends when the supervisor closes
            await self.dataplane.run(task_status=task_status)

    async def _run_batcher(self, *, task_status: trio.TaskStatus[Batcher] = trio.TASK_STATUS_IGNORED) -> None:
        with self._batcher_scope:
            await self.batcher.run(task_status=task_status)

    # --- routing -------------------------------------------------------------------------------

    def pick_lane(self, model: str) -> Lane:
        """The least loaded ready lane that serves `model`, is not quarantined and is not drained."""
        return self.router.pick(model)

    def reconfigure(self, config: SupervisorConfig, *, admission: AdmissionPolicy, batching: BatchPolicy) -> None:
        """Apply reloaded settings (SIGHUP): the model table, admission and batching. Lanes are added, removed
        and reloaded by their own calls."""
        self.config = self.router.config = config
        if self.scheduler is None:
            self.scheduler = Scheduler(admission)
        self.scheduler.policy = admission
        self.batcher.policy = batching

    def model_config(self, model: str) -> ModelConfig:
        """The configuration of model `model`; ModelNotFound when there is none."""
        return self.config.model(model)

    # --- admin -------------------------------------------------------------------------------

    async def add_lane(self, cfg: LaneConfig, specs: list[LoadSpec]) -> Lane:
        """Start a lane that was not in the configuration at start-up (SIGHUP)."""
        if self._closed or self._nursery is None:
            raise ClosedSupervisorError("the supervisor is shutting down")
        if cfg.id in self.lanes:
            raise InvalidRequest(f"lane {cfg.id!r} exists")
        lane = self.lanes[cfg.id] = self._lane(cfg, specs)
        if self.dataplane is not None:
            self.dataplane.attach(lane)
        await self._nursery.start(lane.run)
        return lane

    def _lane(self, cfg: LaneConfig, specs: list[LoadSpec]) -> Lane:
        return Lane(cfg, self.config, self.runtime_dir, specs, self.events, launcher=self.launcher,
                    generations=self._generations, arena_env=self._arena_env)

    async def remove_lane(self, lane_id: str) -> None:
        """Stop routing to a lane, let it finish what is queued, stop its worker, forget it."""
        lane = self.lanes.get(lane_id)
        if lane is None:
            raise LaneNotFound(f"no lane {lane_id!r}")
        self.router.drain(lane_id)
        lane.close()
        await lane.wait_state(LaneState.STOPPED)
        self.lanes.pop(lane_id, None)
        self.router.resume(lane_id)

    def forget_tokenizer(self, model: str) -> None:
        """Drop a cached tokenizer (its model's settings changed); the next request loads it again."""
        self.tokenizers.forget(model)

    async def reload_lane(self, lane_id: str, timeout: float | None = None, settings: LaneSettings | None = None,
                          *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Ordered restart of one lane's worker (no strike), with new `settings` if given (they take effect for
        the worker it starts); lifts its quarantine at once. Reports started once the reload is queued."""
        lane = self.lanes.get(lane_id)
        if lane is None:
            raise LaneNotFound(f"no lane {lane_id!r}")
        await lane.reload(timeout, settings, task_status=task_status)

    async def roll_over(self, model: str, *, timeout: float | None = None) -> list[str]:
        """Bring `model`'s configured settings (its tuned kernels, once a tuner has stored them) to every lane that
        serves it, one lane after the other so the others keep serving: each lane's worker is replaced by a fresh
        one without failing a request (Lane.roll_over). Returns the lanes rolled over."""
        mc = self.config.model(model)
        spec = await load_spec(mc, self._digests)
        done = []
        for lane in list(self.lanes.values()):
            if model not in lane.loads or lane.closing:
                continue
            lane.loads = {**lane.loads, model: spec}
            await lane.roll_over(timeout)
            done.append(lane.id)
        self.untuned.discard(model)
        return done

    def status(self) -> list[dict[str, Any]]:
        """Cached lane state; never touches a worker."""
        return [self.lane_status(lane) for lane in self.lanes.values()]

    def lane_status(self, lane: Lane) -> dict[str, Any]:
        """One lane's cached state, with whether the router has it drained and which kernels its models run."""
        status = lane.status()
        return {**status, "drained": lane.id in self.router.drained, "kernels": self._kernels(lane, status["beams"])}

    def _kernels(self, lane: Lane, beams: dict[str, int]) -> dict[str, str]:
        """Per model of the lane's active worker: "fused" (C kernels), "hand-coded" (tinygrad's, no beam set),
        "tuned" (BEAM-searched at the configured width) or "untuned" (a tuner has not brought them in yet)."""
        out = {}
        for model, beam in beams.items():
            try:
                mc = self.config.model(model)
            except ModelNotFound:
                continue  # removed by a reload; its lane is being reconfigured
            if mc.runtime_config.backend(lane.cfg.device) == "fused":
                out[model] = "fused"
            elif not mc.beam:
                out[model] = "hand-coded"
            else:
                out[model] = "tuned" if beam >= mc.beam else "untuned"
        return out

    def subscribe(self) -> trio.MemoryReceiveChannel[dict[str, Any]]:
        """A channel of the supervisor's events from now on (WORKER_CRASHED, RING_FAULT, ...), as dicts."""
        return self.events.subscribe()

    async def wait_started(self) -> None:
        """Until every lane's first start has settled: it serves, or that start failed (READY=1)."""
        for lane in list(self.lanes.values()):
            await lane.first_start.settled.wait()

    async def wait_ready(self, timeout: float = math.inf) -> None:
        """Until every lane is ready (tests and start-up notification)."""
        with trio.fail_after(timeout):
            for lane in self.lanes.values():
                await lane.wait_state(LaneState.READY, LaneState.BUSY)
