"""A lane: one active worker process at a time (plus an idle standby with `standby = true`), one request in
flight, the supervision rules of §5."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio

from .._config import LaneConfig, SupervisorConfig
from .._errors import (
    BrokenWorkerError,
    ClosedSupervisorError,
    EngineCrashed,
    GpuWorkerError,
    InvalidRequest,
    WorkerError,
)
from .._proto import Fault, Message, StrikePolicy
from ._events import EventBus
from ._exchange import exchange, salvage
from ._generation import Generation, host
from ._jobs import RELOAD, SERVING, Job, LaneState, LoadSpec
from ._lane_queue import LaneQueue
from ._logring import LogRing
from ._spawn import socket_path, worker_argv, worker_env
from ._standby import StandbyKeeper
from ._worker import WorkerProcess, describe_exit

log = logging.getLogger("trio_gpuworker.lane")


class Lane(LaneQueue):
    def __init__(self, cfg: LaneConfig, sup: SupervisorConfig, runtime_dir: Path, loads: list[LoadSpec],
                 bus: EventBus, arena_env: dict[str, str] | None = None, pass_fds: tuple[int, ...] = ()) -> None:
        super().__init__(cfg.id, StrikePolicy(sup.quarantine.strikes, sup.quarantine.cooldown_s))
        self.cfg = cfg
        self.sup = sup
        self.windows = sup.windows
        self.runtime_dir = runtime_dir
        self.loads = {spec.model_ref: spec for spec in loads}
        self.bus = bus
        self.log = LogRing(cfg.id, sup.log_ring_bytes)
        self._spawned = 0  # generations are numbered in spawn order, standbys included
        self.active: Generation | None = None
        self.standby = StandbyKeeper(self) if cfg.standby else None
        self.pid: int | None = None
        self.models_loaded: list[str] = []
        self.load_errors: dict[str, str] = {}
        self.rss_mb: float | None = None
        self.last_exit: str | None = None
        self.restarts = 0
        self._current: Job | None = None
        self._reloading: Job | None = None  # finished once the next generation has loaded
        self._idle_scope: trio.CancelScope | None = None  # cancelled to stop serving between requests
        self.last_error: str | None = None
        self._started: Callable[[], None] | None = None
        self._arena_env = arena_env or {}
        self._pass_fds = pass_fds
        self._nursery: trio.Nursery | None = None
        self.last_reaped: tuple[int, int] = (-1, 0)  # (pid, returncode) of the last reaped worker
        # called as hook(lane, generation, msg) for worker notifications, and hook(lane, generation, None)
        # once that generation's process is reaped (the data plane's crash fan-out and lease release)
        self.hooks: list[Callable[[Lane, int, Message | None], None]] = []

    @property
    def requests_sent(self) -> int:
        """The last req_id the active worker was issued (requests that failed local validation count)."""
        return self.active.requests.last_req_id if self.active is not None else 0

    # --- lane task -----------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        self._started = lambda: task_status.started()
        backoff = self.sup.restart.backoff_initial_s
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                nursery.start_soon(self._refresh_health)
                if self.standby is not None:
                    nursery.start_soon(self.standby.run)
                while not self._closing:
                    if self.cooldown_remaining() is not None:
                        await self._sit_out_quarantine()
                        continue
                    promoted = None
                    if self.standby is not None and self._reloading is not None:
                        await self.standby.stop()  # a reload restarts both: the standby has the old settings
                    elif self.standby is not None:
                        promoted = self.standby.take()
                    served = await self._run_active(promoted or self.spawn())
                    self._mark_started()
                    if self._closing or self.cooldown_remaining() is not None or self._reloading is not None:
                        continue
                    if served:
                        backoff = self.sup.restart.backoff_initial_s
                    self.restarts += 1
                    if self.standby is not None and self.standby.ready:
                        continue  # promoted at once: no backoff, the failed request already has its answer
                    self.state = LaneState.RESTARTING
                    with trio.move_on_after(backoff):
                        await self._closed.wait()
                    backoff = min(backoff * self.sup.restart.backoff_factor, self.sup.restart.backoff_max_s)
                if self.standby is not None:
                    await self.standby.stop()
                nursery.cancel_scope.cancel()  # the health refresher and the standby keeper
        finally:
            self._mark_started()
            self.state = LaneState.STOPPED
            self.pid = None
            stopped = ClosedSupervisorError(f"lane {self.id} stopped")
            self._fail_queued(stopped)
            for job in (self._current, self._reloading):
                if job is not None:
                    job.finish(error=stopped)  # past the drain bound: answer rather than drop the caller
            self._current = self._reloading = None

    def _mark_started(self) -> None:
        if self._started is not None:
            started, self._started = self._started, None
            started()

    async def _sit_out_quarantine(self) -> None:
        """No worker runs while quarantined (the standby is stopped too); queued requests fail fast. Once the
        cool-down is over (or a reload lifts it) a fresh worker starts with zero strikes at once: the router
        sends no traffic to a lane that is not ready, so waiting for a request could leave it out for good."""
        self.state = LaneState.QUARANTINED
        self.pid = None
        if self.standby is not None:
            await self.standby.stop()
        while (remaining := self.cooldown_remaining()) is not None and not self._closing:
            self._fail_queued(self.quarantine_error(remaining))
            with trio.move_on_after(remaining):
                self._wakeup = trio.Event()
                await self._wakeup.wait()

    def spawn(self, *, standby: bool = False) -> Generation:
        """Start a worker process in the lane's nursery: it connects, completes HELLO and loads the lane's
        models (`ready`), and runs until it faults or is stopped in order."""
        assert self._nursery is not None
        self._spawned += 1
        number = self._spawned
        wp = WorkerProcess(lane_id=self.id, generation=number, argv=worker_argv(self.cfg),
                           env=worker_env(self.cfg, self.sup.state_dir, number, self._arena_env),
                           sock_path=socket_path(self.runtime_dir, f"{self.id}.{number}"),
                           max_frame=self.sup.max_frame, kill_grace_s=self.windows.kill_grace_s,
                           drain_s=self.windows.exit_status_s, log=self.log, on_event=self._on_event,
                           pass_fds=self._pass_fds)
        gen = Generation(wp, standby=standby)
        self._nursery.start_soon(host, gen, self.windows, lambda: self.loads.values(), self._reaped)
        return gen

    def _reaped(self, gen: Generation) -> None:
        assert gen.rc is not None
        self.last_reaped = (gen.wp.pid or -1, gen.rc)
        for hook in list(self.hooks):
            hook(self, gen.number, None)  # reaped: everything of this generation is gone

    async def _run_active(self, gen: Generation) -> bool:
        """Serve on `gen` until closing, a reload or a fault. Returns True if a request was served."""
        self.active = gen
        self.generation = gen.number
        gen.standby = False
        self.pid = gen.wp.pid
        if not gen.ready.is_set():
            self.state = LaneState.STARTING
            await gen.ready.wait()
        with trio.CancelScope() as scope:
            gen.wp.cancel_on_fault(scope)
            if gen.wp.fault is None:
                self.pid, self.models_loaded, self.load_errors = gen.wp.pid, gen.models, dict(gen.load_errors)
                if self._reloading is not None:
                    self._reloading.finish(result=Message("RELOADED", {"generation": gen.number}))
                    self._reloading = None
                self._mark_started()
                await self._serve(gen)
        if gen.wp.fault is None:
            self.state = LaneState.STOPPING
        gen.stop_requested.set()
        with trio.CancelScope(shield=True):  # the host reaps in a shielded scope too: this wait is short
            await gen.reaped.wait()
        assert gen.rc is not None
        self.active = None
        self.last_exit = describe_exit(gen.rc)
        self.pid = None
        self.models_loaded = []
        self._after_generation(gen)
        return gen.served

    def _after_generation(self, gen: Generation) -> None:
        fault = gen.wp.fault
        if fault is None or fault.cause == "ordered":
            return
        if fault.cause == "crash" and self._current is not None and salvage(gen.wp, self._current, gen.requests):
            self._current = None  # after a protocol fault or a hang nothing the worker sent is trusted
        err = self.strike(gen)
        for job in (self._current, self._reloading):
            if job is not None:
                job.finish(error=err)
        self._current = self._reloading = None

    def fault_error(self, gen: Generation) -> EngineCrashed:
        fault, rc = gen.wp.fault, gen.rc
        assert fault is not None
        role = "standby worker" if gen.standby else "worker"
        err = EngineCrashed(
            f"{role} of lane {self.id} (generation {gen.number}) failed: {fault.detail}; {describe_exit(rc)}",
            lane_id=self.id, generation=gen.number, cause=fault.cause,
            exit_code=rc if rc is not None and rc >= 0 else None, signal=-rc if rc is not None and rc < 0 else None,
            log_tail=self.log.tail(self.sup.log_tail_bytes))
        if fault.error is not None:
            err.__cause__ = fault.error
        return err

    def strike(self, gen: Generation) -> EngineCrashed:
        """Count a genuine fault of `gen` (active or standby), log it and tell subscribers. A strike that
        quarantines the lane stops it serving at the next request boundary, standby or not."""
        fault = gen.wp.fault
        assert fault is not None
        err = self.fault_error(gen)
        quarantined = self.policy.strike(Fault(fault.cause), trio.current_time())
        self.last_error = str(err)
        log.warning("%s", err, extra={"lane_id": self.id, "generation": gen.number})
        self.bus.publish({"t": "WORKER_CRASHED", "lane_id": self.id, "generation": gen.number,
                          "status": describe_exit(gen.rc), "cause": fault.cause, "standby": gen.standby})
        if quarantined and self._idle_scope is not None:
            self._idle_scope.cancel()
        return err

    # --- models --------------------------------------------------------------------------------

    async def load_model(self, spec: LoadSpec, *, timeout: float | None = None,
                         on_progress: Callable[[Message], None] | None = None) -> Message:
        """LOAD on the running worker; later generations load it too. Lifts quarantine only on success."""
        try:
            reply = await self.call("LOAD", spec.load_fields(), timeout=timeout, on_progress=on_progress)
        except WorkerError as exc:
            self.load_errors[spec.model_ref] = f"{exc.code}: {exc.msg}"
            raise
        self.loads[spec.model_ref] = spec
        self.load_errors.pop(spec.model_ref, None)
        if reply["model_ref"] not in self.models_loaded:
            self.models_loaded.append(reply["model_ref"])
        if self.standby is not None:  # both workers have it before the load is acknowledged
            await self.standby.apply("LOAD", spec.load_fields())
        return reply

    async def unload_model(self, model_ref: str, *, timeout: float | None = None) -> None:
        """UNLOAD; later generations no longer load it. An unload lifts the lane's quarantine (§5)."""
        self.loads.pop(model_ref, None)
        self.clear_quarantine()
        try:
            await self.call("UNLOAD", {"model_ref": model_ref}, timeout=timeout)
        except WorkerError as exc:
            if exc.code != "model_not_loaded":
                raise
        if model_ref in self.models_loaded:
            self.models_loaded.remove(model_ref)
        if self.standby is not None:
            await self.standby.apply("UNLOAD", {"model_ref": model_ref})

    def _on_event(self, wp: WorkerProcess, msg: Message) -> None:
        for hook in list(self.hooks):
            hook(self, wp.generation, msg)
        if msg.t not in ("RING_READABLE", "RING_WRITABLE"):
            self.bus.publish({**msg.fields, "lane_id": self.id, "generation": wp.generation})

    async def abort_in_flight(self) -> None:
        """Stop the worker now, faulting the request in flight: SHUTDOWN abort_in_flight goes out of band (no
        req_id), so it passes that request. An ordered stop: no strike; the lane then starts a fresh worker."""
        wp = self.active.wp if self.active is not None else None
        if wp is None or wp.fault is not None or wp.stream is None:
            return
        wp.ordered_stop = True
        await wp.send("SHUTDOWN", {"mode": "abort_in_flight"})

    async def notify(self, generation: int, t: str, fields: dict[str, Any]) -> None:
        """Send a notification (a wake hint) to the worker of `generation`, alongside any running request."""
        wp = self.active.wp if self.active is not None else None
        if wp is None or wp.generation != generation or wp.fault is not None or wp.stream is None:
            raise BrokenWorkerError(f"lane {self.id} generation {generation} is not running")
        await wp.send(t, fields)

    async def _serve(self, gen: Generation) -> None:
        """Take jobs one at a time until closing, a reload, or a quarantine; a fault cancels this."""
        self.state = LaneState.READY
        while True:
            if self.cooldown_remaining() is not None:
                return  # quarantined by a standby's strike: the lane sits the cool-down out
            job = None
            with trio.CancelScope() as self._idle_scope:  # such a strike ends the wait for work too
                try:
                    job = await self._jobs_recv.receive()
                except trio.EndOfChannel:
                    return
            self._idle_scope = None
            if job is None:
                continue
            self.queued -= 1
            if job.abandoned:
                job.finish()  # its caller is gone: never let it reach the worker
                continue
            if job.t == RELOAD:
                if job.fields["generation"] < gen.number:
                    job.finish(result=Message("RELOADED", {"generation": gen.number}))  # already fresh
                    continue
                self._reloading = job
                return
            self._current = job
            self.state = LaneState.BUSY
            try:
                reply = await exchange(gen.wp, job, gen.requests, self.windows)
            except InvalidRequest as exc:  # failed local validation: this request alone, nothing was sent
                reply = None
                job.finish(error=exc)
            self._current = None
            self.state = LaneState.READY
            if reply is None:
                continue
            if reply.t == "ERR":
                job.finish(error=WorkerError(reply["code"], reply["msg"]))
                continue
            if job.t in SERVING and reply.t != "STEP_FAILED":  # a failed reply is not drained serving work
                self.policy.success()
                gen.served = True  # the restart backoff starts over after this generation, even if it then fails
            job.finish(result=reply)

    async def _refresh_health(self) -> None:
        """Background PING while idle keeps rss_mb and models current; health requests never PING."""
        interval = self.sup.health_interval_s
        while True:
            await trio.sleep(interval)
            if self.queued or self.state != LaneState.READY:
                continue
            try:
                pong = await self.call("PING", {}, timeout=self.windows.control_s)
            except GpuWorkerError:
                continue  # a failing worker is handled by the lane itself; health stays cached
            self.rss_mb = pong["rss_mb"]
            self.models_loaded = list(pong["models_loaded"])

    # --- status --------------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        remaining = self.cooldown_remaining()
        return {
            "lane_id": self.id,
            "state": self.state.value,
            "generation": self.generation,
            "pid": self.pid,
            "strikes": self.policy.strikes,
            "quarantined_until": time.time() + remaining if remaining is not None else None,
            "cooldown_remaining_s": remaining,
            "models": list(self.models_loaded),
            "load_errors": dict(self.load_errors),
            "rss_mb": self.rss_mb,
            "queued": self.queued,
            "restarts": self.restarts,
            "last_exit": self.last_exit,
            "last_error": self.last_error,
            "device": self.cfg.device,
            "standby": self.standby.describe() if self.standby is not None else None,
            "standby_enabled": self.standby is not None,
        }
