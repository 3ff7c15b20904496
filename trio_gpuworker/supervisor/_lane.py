"""A lane: at most one worker process at a time, one request in flight, supervision rules of §5."""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio

from .._config import LaneConfig, SupervisorConfig
from .._errors import (
    BrokenWorkerError,
    ClosedSupervisorError,
    DeadlineExceeded,
    EngineCrashed,
    GpuWorkerError,
    ProgressViolation,
    UnexpectedFrame,
    WorkerError,
)
from .._proto import INTERMEDIATE, TERMINAL, Fault, Message, ProgressValidator, StrikePolicy
from ._events import EventBus
from ._jobs import RELOAD, SERVING, Job, LaneState, LoadSpec
from ._logring import LogRing
from ._spawn import socket_path, worker_argv, worker_env
from ._worker import WorkerProcess, describe_exit

log = logging.getLogger("trio_gpuworker.lane")


class Lane:
    def __init__(self, cfg: LaneConfig, sup: SupervisorConfig, runtime_dir: Path, loads: list[LoadSpec],
                 bus: EventBus, arena_env: dict[str, str] | None = None, pass_fds: tuple[int, ...] = ()) -> None:
        self.cfg = cfg
        self.id = cfg.id
        self.sup = sup
        self.windows = sup.windows
        self.runtime_dir = runtime_dir
        self.loads = {spec.model_ref: spec for spec in loads}
        self.bus = bus
        self.log = LogRing(cfg.id, sup.log_ring_bytes)
        self.policy = StrikePolicy(sup.quarantine.strikes, sup.quarantine.cooldown_s)
        self._state = LaneState.STARTING
        self._state_changed = trio.Event()
        self.generation = 0
        self.pid: int | None = None
        self.models_loaded: list[str] = []
        self.load_errors: dict[str, str] = {}
        self.rss_mb: float | None = None
        self.last_exit: str | None = None
        self.restarts = 0
        self.queued = 0
        self._req_id = 0
        self._closing = False
        self._current: Job | None = None
        self._held: Job | None = None  # a job taken while quarantined, served by the next generation
        self._reloading: Job | None = None  # finished once the next generation has loaded
        self._wakeup = trio.Event()
        self._closed = trio.Event()
        self.last_error: str | None = None
        self._jobs_send, self._jobs_recv = trio.open_memory_channel[Job](math.inf)
        self._started: Callable[[], None] | None = None
        self._arena_env = arena_env or {}
        self._pass_fds = pass_fds
        self._wp: WorkerProcess | None = None  # the live generation, for notifications
        self.last_reaped: tuple[int, int] = (-1, 0)  # (pid, returncode) of the last reaped worker
        # called as hook(lane, generation, msg) for worker notifications, and hook(lane, generation, None)
        # once that generation's process is reaped (the data plane's crash fan-out and lease release)
        self.hooks: list[Callable[[Lane, int, Message | None], None]] = []

    @property
    def state(self) -> LaneState:
        return self._state

    @state.setter
    def state(self, value: LaneState) -> None:
        if value is not self._state:
            self._state = value
            self._state_changed.set()
            self._state_changed = trio.Event()

    async def wait_state(self, *states: LaneState) -> None:
        """Until the lane is in one of `states` (health probes, tests)."""
        while self._state not in states:
            await self._state_changed.wait()

    # --- caller side ---------------------------------------------------------------------------

    def cooldown_remaining(self) -> float | None:
        return self.policy.cooldown_remaining(trio.current_time())

    def quarantine_error(self, remaining: float) -> EngineCrashed:
        return EngineCrashed(
            f"lane {self.id} is quarantined after {self.policy.max_strikes} consecutive faults; "
            f"retry in {remaining:.0f} s", lane_id=self.id, generation=self.generation,
            cause=self.policy.last_fault.value if self.policy.last_fault else "crash",
            quarantined=True, cooldown_remaining_s=round(remaining, 3))

    async def call(self, t: str, fields: dict[str, Any], raw: bytes | None = None, *, timeout: float | None = None,
                   on_progress: Callable[[Message], None] | None = None,
                   on_settled: Callable[[], None] | None = None) -> Message:
        """Run one request on this lane's worker. The lane, not the caller, owns the stream: a caller
        that gives up (deadline or cancellation) leaves the reply to be drained by the lane.
        `on_settled()` runs once the lane is done with the request (or at once if it is refused here)."""
        job = Job(t, fields, raw, on_progress, on_settled=on_settled)
        if self._closing:
            job.finish(error=ClosedSupervisorError(f"lane {self.id} is shutting down"))
        elif (remaining := self.cooldown_remaining()) is not None:
            job.finish(error=self.quarantine_error(remaining))
        if job.error is not None:
            raise job.error
        self.queued += 1
        self._jobs_send.send_nowait(job)
        self._wakeup.set()
        try:
            with trio.move_on_after(math.inf if timeout is None else timeout):
                await job.done.wait()
        finally:
            if not job.done.is_set():
                job.abandoned = True
        if not job.done.is_set():
            raise DeadlineExceeded(f"{t} on lane {self.id} did not finish within {timeout:g} s")
        if job.error is not None:
            raise job.error
        assert job.result is not None
        return job.result

    async def reload(self, timeout: float | None = None) -> None:
        """Restart the worker in order (no strike) after the requests queued before this one; lifts quarantine.
        Returns once the new generation has loaded its models."""
        if self._closing:
            raise ClosedSupervisorError(f"lane {self.id} is shutting down")
        self.clear_quarantine()
        job = Job(RELOAD, {"generation": self.generation}, None)
        self.queued += 1
        self._jobs_send.send_nowait(job)
        self._wakeup.set()
        with trio.move_on_after(math.inf if timeout is None else timeout):
            await job.done.wait()
        if not job.done.is_set():
            raise DeadlineExceeded(f"reload of lane {self.id} did not finish within {timeout:g} s")
        if job.error is not None:
            raise job.error

    def clear_quarantine(self) -> None:
        """Unload/reload of the lane lifts quarantine at once."""
        self.policy.clear()
        self._wakeup.set()

    def close(self) -> None:
        """Stop admitting; jobs already queued are still served, then the worker is shut down."""
        self._closing = True
        self._closed.set()
        self._jobs_send.close()
        self._wakeup.set()

    # --- lane task -----------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        self._started = lambda: task_status.started()
        backoff = self.sup.restart.backoff_initial_s
        try:
            while not self._closing:
                if self.cooldown_remaining() is not None:
                    await self._sit_out_quarantine()
                    continue
                served = await self._run_generation()
                self._mark_started()
                if self._closing or self.cooldown_remaining() is not None or self._reloading is not None:
                    continue
                if served:
                    backoff = self.sup.restart.backoff_initial_s
                self.state = LaneState.RESTARTING
                self.restarts += 1
                with trio.move_on_after(backoff):
                    await self._closed.wait()
                backoff = min(backoff * self.sup.restart.backoff_factor, self.sup.restart.backoff_max_s)
        finally:
            self._mark_started()
            self.state = LaneState.STOPPED
            self.pid = None
            stopped = ClosedSupervisorError(f"lane {self.id} stopped")
            self._fail_queued(stopped)
            for job in (self._current, self._held, self._reloading):
                if job is not None:
                    job.finish(error=stopped)  # past the drain bound: answer rather than drop the caller
            self._current = self._held = self._reloading = None

    def _mark_started(self) -> None:
        if self._started is not None:
            started, self._started = self._started, None
            started()

    async def _sit_out_quarantine(self) -> None:
        """No worker runs while quarantined; queued requests fail fast. After the cool-down the next
        request (or a reload) starts a fresh worker with zero strikes."""
        self.state = LaneState.QUARANTINED
        self.pid = None
        while (remaining := self.cooldown_remaining()) is not None and not self._closing:
            self._fail_queued(self.quarantine_error(remaining))
            with trio.move_on_after(remaining):
                self._wakeup = trio.Event()
                await self._wakeup.wait()
        if self._closing:
            return
        self.state = LaneState.RESTARTING
        while self._held is None and not self._closing:
            try:
                self._held = await self._jobs_recv.receive()
            except trio.EndOfChannel:
                return

    def _fail_queued(self, error: GpuWorkerError) -> None:
        while True:
            try:
                job = self._jobs_recv.receive_nowait()
            except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
                break
            self.queued -= 1
            job.finish(error=error)

    async def _run_generation(self) -> bool:
        """Spawn, load, serve until closing or a fault. Returns True if a request was served."""
        self.generation += 1
        gen = self.generation
        self.state = LaneState.STARTING
        wp = WorkerProcess(lane_id=self.id, generation=gen, argv=worker_argv(self.cfg),
                           env=worker_env(self.cfg, self.sup.state_dir, gen, self._arena_env),
                           sock_path=socket_path(self.runtime_dir, self.id), max_frame=self.sup.max_frame,
                           kill_grace_s=self.windows.kill_grace_s,
                           drain_s=self.windows.exit_status_s, log=self.log, on_event=self._on_event,
                           pass_fds=self._pass_fds)
        served = False
        try:
            async with trio.open_nursery() as nursery:
                await wp.start(nursery, self.windows.setup_s)
                self._wp = wp
                if wp.fault is None:
                    self.pid = wp.pid
                    await self._load_all(wp)
                    if self._reloading is not None:
                        self._reloading.finish(result=Message("RELOADED", {"generation": wp.generation}))
                        self._reloading = None
                    self._mark_started()
                    nursery.start_soon(self._refresh_health)
                    served = await self._serve(wp)
                    await self._shutdown(wp)
                nursery.cancel_scope.cancel()
        finally:
            self._wp = None
            rc = await wp.close(self._patience(wp))
            self.last_exit = describe_exit(rc)
            self.pid = None
            self.models_loaded = []
            self.last_reaped = (wp.pid or -1, rc)
            for hook in list(self.hooks):
                hook(self, wp.generation, None)  # reaped: everything of this generation is gone
        self._after_generation(wp, rc)
        return served

    def _patience(self, wp: WorkerProcess) -> float:
        """How long a dying worker may take to exit by itself before the kill path."""
        if wp.ordered_stop:
            return self.windows.shutdown_s
        if wp.fault is not None and wp.fault.cause == "crash":
            return self.windows.exit_status_s  # an EOF usually means it is exiting: keep its real status
        return 0.0

    def _after_generation(self, wp: WorkerProcess, rc: int) -> None:
        fault = wp.fault
        if fault is None or fault.cause == "ordered":
            return
        err = EngineCrashed(
            f"worker of lane {self.id} (generation {wp.generation}) failed: {fault.detail}; {describe_exit(rc)}",
            lane_id=self.id, generation=wp.generation, cause=fault.cause,
            exit_code=rc if rc >= 0 else None, signal=-rc if rc < 0 else None,
            log_tail=self.log.tail(self.sup.log_tail_bytes))
        if fault.error is not None:
            err.__cause__ = fault.error
        if fault.cause == "crash":  # after a protocol fault or a hang nothing the worker sent is trusted
            self._salvage_reply(wp)
        self.policy.strike(Fault(fault.cause), trio.current_time())
        self.last_error = str(err)
        log.warning("%s", err, extra={"lane_id": self.id, "generation": wp.generation})
        for job in (self._current, self._held, self._reloading):
            if job is not None:
                job.finish(error=err)
        self._current = self._held = self._reloading = None
        self.bus.publish({"t": "WORKER_CRASHED", "lane_id": self.id, "generation": wp.generation,
                          "status": describe_exit(rc), "cause": fault.cause})

    def _salvage_reply(self, wp: WorkerProcess) -> None:
        """A worker may write its whole reply and exit before the serving task, cancelled with the generation,
        reads it: a complete terminal reply already received still goes to its caller."""
        job = self._current
        extras: list[Message] = []
        while job is not None:
            try:
                msg = wp.replies.receive_nowait()
            except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
                return
            if msg.get("req_id") != self._req_id:
                continue
            if msg.t in INTERMEDIATE.get(job.t, ()):
                extras.append(msg)
            elif msg.t == "ERR":
                job.finish(error=WorkerError(msg["code"], msg["msg"]))
            elif msg.t in TERMINAL.get(job.t, ()):
                job.finish(result=dataclasses.replace(msg, extras=tuple(extras)) if extras else msg)
            else:
                continue
            if job.done.is_set():
                self._current = job = None

    # --- models --------------------------------------------------------------------------------

    async def load_model(self, spec: LoadSpec, *, timeout: float | None = None,
                         on_progress: Callable[[Message], None] | None = None) -> Message:
        """LOAD on the running worker; later generations load it too. Lifts quarantine only on success."""
        fields = {"artifact_path": os.fspath(spec.artifact_path), "artifact_digest": spec.digest,
                  "format": spec.format, "runtime_config": spec.runtime_config, "model_ref": spec.model_ref}
        try:
            reply = await self.call("LOAD", fields, timeout=timeout, on_progress=on_progress)
        except WorkerError as exc:
            self.load_errors[spec.model_ref] = f"{exc.code}: {exc.msg}"
            raise
        self.loads[spec.model_ref] = spec
        self.load_errors.pop(spec.model_ref, None)
        if reply["model_ref"] not in self.models_loaded:
            self.models_loaded.append(reply["model_ref"])
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

    def _on_event(self, wp: WorkerProcess, msg: Message) -> None:
        for hook in list(self.hooks):
            hook(self, wp.generation, msg)
        if msg.t not in ("RING_READABLE", "RING_WRITABLE"):
            self.bus.publish({**msg.fields, "lane_id": self.id, "generation": wp.generation})

    async def notify(self, generation: int, t: str, fields: dict[str, Any]) -> None:
        """Send a notification (a wake hint) to the worker of `generation`, alongside any running request."""
        wp = self._wp
        if wp is None or wp.generation != generation or wp.fault is not None or wp.stream is None:
            raise BrokenWorkerError(f"lane {self.id} generation {generation} is not running")
        await wp.send(t, fields)

    async def _load_all(self, wp: WorkerProcess) -> None:
        for spec in list(self.loads.values()):
            job = Job("LOAD", {"artifact_path": os.fspath(spec.artifact_path), "artifact_digest": spec.digest,
                                "format": spec.format, "runtime_config": spec.runtime_config,
                                "model_ref": spec.model_ref}, None)
            self._current = job
            reply = await self._exchange(wp, job)
            self._current = None
            if reply.t == "ERR":
                self.load_errors[spec.model_ref] = f"{reply['code']}: {reply['msg']}"
            else:
                self.load_errors.pop(spec.model_ref, None)
                self.models_loaded.append(reply["model_ref"])

    async def _serve(self, wp: WorkerProcess) -> bool:
        served = False
        self.state = LaneState.READY
        while True:
            job, self._held = self._held, None
            if job is None:
                try:
                    job = await self._jobs_recv.receive()
                except trio.EndOfChannel:
                    return served
                self.queued -= 1
            if job.abandoned:
                job.finish()  # its caller is gone: never let it reach the worker
                continue
            if job.t == RELOAD:
                if job.fields["generation"] < wp.generation:
                    job.finish(result=Message("RELOADED", {"generation": wp.generation}))  # already fresh
                    continue
                self._reloading = job
                return served
            self._current = job
            self.state = LaneState.BUSY
            reply = await self._exchange(wp, job)
            self._current = None
            self.state = LaneState.READY
            if reply.t == "ERR":
                job.finish(error=WorkerError(reply["code"], reply["msg"]))
                continue
            if job.t in SERVING:
                self.policy.success()
                served = True
            job.finish(result=reply)

    async def _exchange(self, wp: WorkerProcess, job: Job) -> Message:
        """Write one request and read until its terminal reply, under the phase's silence window.
        On a fault the generation is cancelled and this never returns."""
        self._req_id += 1
        req_id = self._req_id
        progress = ProgressValidator(req_id, "setup")
        window = self._window(job.t, "load" if job.t == "LOAD" else "inference" if job.t in SERVING else "control")
        await wp.send(job.t, {**job.fields, "req_id": req_id}, job.raw)
        extras: list[Message] = []
        with trio.CancelScope(deadline=trio.current_time() + window) as watchdog:
            while True:
                msg = await wp.replies.receive()
                try:
                    if msg.t in INTERMEDIATE.get(job.t, ()) and msg.get("req_id") == req_id:
                        extras.append(msg)
                        continue
                    if msg.t == "PROGRESS":
                        phase = progress.accept(msg)
                        window = self._window(job.t, phase)
                        watchdog.deadline = trio.current_time() + window
                        if job.on_progress is not None and not job.abandoned:
                            job.on_progress(msg)
                        continue
                    if msg.get("req_id") != req_id:
                        raise UnexpectedFrame(f"{msg.t} for req_id {msg.get('req_id')} while {req_id} is current")
                    if msg.t != "ERR" and msg.t not in TERMINAL.get(job.t, ()):
                        raise UnexpectedFrame(f"{msg.t} is not a reply to {job.t}")
                except (ProgressViolation, UnexpectedFrame) as exc:
                    wp.fail("protocol", str(exc), exc)
                    await trio.sleep_forever()
                return dataclasses.replace(msg, extras=tuple(extras)) if extras else msg
        wp.fail("hang", f"{job.t} sent nothing for {window:g} s (silence window)")
        await trio.sleep_forever()
        raise AssertionError("unreachable")

    def _window(self, t: str, phase: str) -> float:
        w = self.windows
        if phase == "inference":
            return w.inference_s
        if phase == "control":
            return w.control_s
        return w.load_s if t == "LOAD" or phase == "load" else w.setup_s

    async def _shutdown(self, wp: WorkerProcess) -> None:
        """Ordered stop: SHUTDOWN, wait for the exit, then the kill path reaps whatever is left."""
        self.state = LaneState.STOPPING
        wp.ordered_stop = True
        with trio.move_on_after(self.windows.shutdown_s):
            try:
                await self._exchange(wp, Job("SHUTDOWN", {"mode": "graceful"}, None))
            except (trio.BrokenResourceError, OSError):
                return

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
        }
