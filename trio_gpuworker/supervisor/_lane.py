"""A lane (docs/architecture.md, 'Supervision rules'): at most one active worker (plus an idle warm standby with
`standby = true`), one
request in flight, the supervision rules, as the trio shell around one pure LaneLifecycle (_proto/_lifecycle.py).

Every decision (which generation gets which request, what becomes of the open and queued ones at a fault, a
reload, an abort or a close, when to promote, respawn or quarantine) is the machine's. The lane feeds it what
callers ask and what time it is; its LaneRunner carries the effects out and feeds back what workers do; its
LaneReport says how all of it reads from outside.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import trio

from .._config import LaneConfig, SupervisorConfig
from .._errors import BrokenWorkerError, DeadlineExceeded, EngineCrashed, WorkerError
from .._proto import (
    RELOAD,
    SERVING_STATES,
    Backoff,
    LaneLifecycle,
    LaneState,
    LaneTicket,
    Load,
    Loaded,
    Ping,
    Pong,
    Progress,
    StrikePolicy,
    Unload,
    WireMessage,
)
from ._generation import Generation, numbering
from ._jobs import Job, LaneSettings, LoadSpec, Reply
from ._lane_report import LaneReport, StandbyView
from ._lane_runner import Hook, LaneRunner
from ._launcher import Launcher, ProcessLauncher
from ._logring import LogRing
from ._startup import FirstStart


class Lane:
    def __init__(self, cfg: LaneConfig, sup: SupervisorConfig, runtime_dir: Path, loads: list[LoadSpec],
                 bus: Any, *, launcher: Launcher | None = None, generations: Callable[[], int] | None = None,
                 arena_env: dict[str, str] | None = None) -> None:
        self.id, self.sup, self.windows = cfg.id, sup, sup.windows
        self.log = LogRing(cfg.id, sup.log_ring_bytes)
        self.policy = StrikePolicy(sup.quarantine.strikes, sup.quarantine.cooldown_s)
        r = sup.restart
        self.machine = LaneLifecycle(LaneSettings.of(cfg, loads), policy=self.policy,
                                     new_generation=generations or numbering(),
                                     backoff=Backoff(r.backoff_initial_s, r.backoff_factor, r.backoff_max_s))
        self.gens: dict[int, Generation] = {}
        self.step_waits: list[Callable[[], bool]] = []  # is an EXECUTE_STEP waiting on us (the data plane says)
        self.report = LaneReport(self.id, sup, self.machine, self.gens, self.log, bus, self.step_waits)
        self.runner = LaneRunner(self, sup, self.machine, self.report, launcher or ProcessLauncher(runtime_dir),
                                 self.log, bus, arena_env or {})

    # --- what callers read ----------------------------------------------------------------------

    @property
    def state(self) -> LaneState:
        return self.machine.state

    @property
    def generation(self) -> int:
        return self.machine.generation

    @property
    def closing(self) -> bool:
        return self.machine.closing

    @property
    def settings(self) -> LaneSettings:
        """The lane's settings now: what its next generation is spawned with (the machine holds them)."""
        return self.machine.settings  # type: ignore[no-any-return]

    @property
    def cfg(self) -> LaneConfig:
        return self.settings.cfg

    @property
    def loads(self) -> Mapping[str, LoadSpec]:
        return self.settings.loads

    @loads.setter
    def loads(self, value: Mapping[str, LoadSpec]) -> None:
        """An admin LOAD or UNLOAD: the live generations and every later one load these."""
        self.machine.retarget(self.settings.with_loads(value))

    @property
    def hooks(self) -> list[Hook]:
        return self.runner.hooks

    @property
    def last_reaped(self) -> tuple[int, int]:
        return self.runner.last_reaped

    @property
    def pid(self) -> int | None:
        gen = self.report.active()
        return gen.wp.pid if gen is not None else None

    @property
    def models_loaded(self) -> list[str]:
        return self.status()["models"]

    @property
    def load_errors(self) -> dict[str, str]:
        return self.status()["load_errors"]

    @property
    def queued(self) -> int:
        return len(self.machine.tickets.queue)

    @property
    def restarts(self) -> int:
        return self.machine.restarts

    @property
    def rss_mb(self) -> float | None:
        return self.report.rss_mb

    @property
    def last_exit(self) -> str | None:
        return self.report.last_exit

    @property
    def last_error(self) -> str | None:
        return self.report.last_error

    @property
    def standby(self) -> StandbyView | None:
        return self.report.standby if self.cfg.standby else None

    @property
    def first_start(self) -> FirstStart:
        return self.report.first

    def starting_first(self) -> dict[str, Any] | None:
        """Where the lane's first start is (phase, model, steps, elapsed_s); None once it has settled."""
        return self.report.first.describe(self.state, trio.current_time())

    def cooldown_remaining(self) -> float | None:
        return self.report.cooldown_remaining()

    def quarantine_error(self, remaining: float) -> EngineCrashed:
        return self.report.quarantine_error(remaining)

    def status(self) -> dict[str, Any]:
        return self.report.status()

    async def wait_state(self, *states: LaneState) -> None:
        """Until the lane is in one of `states` (health probes, tests)."""
        while self.state not in states:
            await self.runner.changed.wait()

    # --- the lane task -----------------------------------------------------------------------

    async def run(self, *, wait_for_start: bool = True, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                  ) -> None:
        """Start the first generation, report started once it serves or has failed (`wait_for_start=False`: once
        its spawn is under way, so lanes started in a row number their generations in order), run until closed."""
        runner = self.runner
        try:
            async with trio.open_nursery() as nursery:
                runner.nursery = nursery
                nursery.start_soon(self._timers)
                nursery.start_soon(self._refresh_health)
                self.report.first.begin(trio.current_time())
                runner.feed(self.machine.start(trio.current_time()))
                if not wait_for_start:
                    task_status.started()
                await self.wait_state(*(s for s in LaneState if s not in (LaneState.STARTING, LaneState.LOADING)))
                self.report.first.settle(trio.current_time())
                if wait_for_start:
                    task_status.started()
                await runner.stopped.wait()
                nursery.cancel_scope.cancel()
        finally:
            runner.feed(self.machine.cancel())  # past the drain bound: answer rather than drop any caller
            runner.stopped.set()

    def close(self) -> None:
        """Stop admitting; what is queued is still served, then the workers are shut down."""
        self.runner.feed(self.machine.close(trio.current_time()))

    async def _timers(self) -> None:
        """Backoffs, standby respawns and the cool-down's end: the machine says when, this wakes it then."""
        runner = self.runner
        while True:
            with trio.move_on_at(runner.deadline):
                await runner.rearm.wait()
            runner.rearm = trio.Event()
            runner.feed(self.machine.tick(trio.current_time()))

    async def _refresh_health(self) -> None:
        """Background PING while idle keeps rss_mb and models current; health requests never PING."""
        while True:
            await trio.sleep(self.sup.health_interval_s)
            ticket, effects = self.machine.ping(trio.current_time())
            if ticket is None:
                continue
            job = self.runner.register(ticket, Job(Ping.T, Ping()))
            self.runner.feed(effects)
            await job.done.wait()
            if isinstance(pong := job.result, Pong):
                self.report.rss_mb = pong.rss_mb
                if (gen := self.gens.get(ticket.gen or -1)) is not None:
                    gen.models = list(pong.models_loaded)

    # --- callers -------------------------------------------------------------------------------

    async def call(self, request: WireMessage, *, timeout: float | None = None,
                   on_progress: Callable[[WireMessage], None] | None = None,
                   on_settled: Callable[[], None] | None = None,
                   on_result: Callable[[Reply | None, BaseException | None], None] | None = None,
                   on_started: Callable[[], None] | None = None,
                   generation: int | None = None) -> Reply:
        """Run one request (its class, built without req_id: the lane numbers it) on this lane's worker and return
        its terminal reply as its class; ERR is raised as WorkerError. The lane, not the caller, owns the stream:
        a caller that gives up (deadline or cancellation) leaves the reply to be drained by the lane.
        `on_progress(msg)` gets each PROGRESS (and TEXT_DELTA). `on_settled()` runs once the lane is done with the
        request (or at once if it is refused here); `on_result(reply, error)` then too, with its answer, whether
        or not the caller still waits. With `generation`, only that worker generation may get it (it names that
        generation's rings or device handles): BrokenWorkerError once that one has ended. `on_started()` runs when
        the request is written to a worker (the end of its queue wait)."""
        job = await self._run(request, timeout, on_progress, on_settled, on_result, on_started, generation)
        assert job.result is not None
        return job.result

    async def call_gathering(self, request: WireMessage, *, timeout: float | None = None,
                             generation: int | None = None, on_started: Callable[[], None] | None = None,
                             on_settled: Callable[[], None] | None = None,
                             ) -> tuple[Reply, tuple[WireMessage, ...]]:
        """`call`, and the intermediate replies that came before the terminal one (EXECUTE_STEP's
        OBJECT_PRODUCED), in order."""
        job = await self._run(request, timeout, None, on_settled, None, on_started, generation)
        assert job.result is not None
        return job.result, job.extras

    async def _run(self, request: WireMessage, timeout: float | None,
                   on_progress: Callable[[WireMessage], None] | None, on_settled: Callable[[], None] | None,
                   on_result: Callable[[Reply | None, BaseException | None], None] | None,
                   on_started: Callable[[], None] | None, generation: int | None) -> Job:
        t = request.T
        job = Job(t, request, on_progress, on_settled=on_settled, on_result=on_result, on_started=on_started)
        ticket, effects = self.machine.submit(t, trio.current_time(), generation)
        self.runner.register(ticket, job)
        self.runner.feed(effects)
        await self._wait(job, ticket, timeout, f"{t} on lane {self.id}")
        return job

    async def reload(self, timeout: float | None = None, settings: LaneSettings | None = None, *,
                     task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Restart both workers in order (no strike) after the requests queued before this one, the fresh ones
        with `settings` (None: as they are); lifts a quarantine. Reports started once the reload is queued (later
        requests are served after it); returns once the new generation has loaded its models."""
        ticket, effects = self.machine.reload(trio.current_time(), settings)
        job = self.runner.register(ticket, Job(RELOAD, None))
        self.runner.feed(effects)
        task_status.started()
        await self._wait(job, ticket, timeout, f"reload of lane {self.id}")

    async def _wait(self, job: Job, ticket: LaneTicket, timeout: float | None, what: str) -> None:
        gave_up = False
        try:
            with trio.move_on_after(math.inf if timeout is None else timeout):
                await job.done.wait()
        finally:
            if not job.done.is_set():  # deadline or cancellation: a queued request is dropped now, an open one
                gave_up = True  # drains on the lane (abandon() may finish the job at once), or is cancelled
                job.abandon()
                self.runner.feed(self.machine.abandon(ticket, trio.current_time()))
        if gave_up:
            raise DeadlineExceeded(f"{what} did not finish within {timeout:g} s")
        if job.error is not None:
            raise job.error

    async def roll_over(self, timeout: float | None = None) -> int:
        """Replace the active worker by a fresh one that loads `loads` as they are now (tuned kernels), failing and
        delaying no request: it loads beside the active one, takes over between two requests, and the old one
        stops in order. Returns the new generation's number; BrokenWorkerError when the lane is closing or
        quarantined, or the roll-over did not complete within `timeout` (its successor is then stopped)."""
        before = self.generation
        self.runner.feed(self.machine.roll_over(trio.current_time()))
        with trio.move_on_after(math.inf if timeout is None else timeout):
            while self.machine.rolling:
                await self.runner.changed.wait()
        if self.machine.rolling:
            self.runner.feed(self.machine.stop_rolling(trio.current_time()))
            raise BrokenWorkerError(f"lane {self.id}: the roll-over did not complete within {timeout:g} s")
        if self.generation == before or self.state not in SERVING_STATES:
            raise BrokenWorkerError(f"lane {self.id} is {self.state.value}: nothing was rolled over")
        return self.generation

    def hold(self, generation: int, on: bool) -> None:
        """Generation `generation` holds work that later requests pinned to it continue (a batch's live sequences),
        or no longer does: a roll-over or ordered reload waits for it (see `LaneLifecycle.hold`)."""
        self.runner.feed(self.machine.hold(generation, on, trio.current_time()))

    @property
    def handing_over(self) -> bool:
        """A roll-over or reload waits for held work to end: nothing new should be added to it."""
        return self.machine.handing_over

    def lift_quarantine(self) -> None:
        """Lift a quarantine at once (an unload does, a reload does): a fresh worker with zero strikes starts."""
        self.runner.feed(self.machine.lift_quarantine(trio.current_time()))

    def abort_in_flight(self) -> None:
        """Stop the active worker now with SHUTDOWN abort_in_flight (no strike): the request in flight ends with
        worker_shutting_down, queued ones go to the fresh worker started next."""
        self.runner.feed(self.machine.abort(trio.current_time()))

    async def notify(self, generation: int, msg: WireMessage) -> None:
        """Send a notification (a wake hint) to generation `generation`, alongside any running request."""
        gen = self.gens.get(generation)
        wp = gen.wp if gen is not None else None
        if wp is None or wp.fault is not None or wp.stream is None:
            raise BrokenWorkerError(f"lane {self.id} generation {generation} is not running")
        try:
            await wp.send_message(msg)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            raise BrokenWorkerError(f"lane {self.id} generation {generation}: {exc}") from exc

    # --- models --------------------------------------------------------------------------------

    async def load_model(self, spec: LoadSpec, *, timeout: float | None = None,
                         on_progress: Callable[[Progress], None] | None = None) -> Loaded:
        """LOAD on the active worker, then on the standby, before it is acknowledged; later generations load it
        too. A failed LOAD is recorded and raised (WorkerError)."""
        try:
            reply = await self.call(spec.request(), timeout=timeout, on_progress=on_progress)  # type: ignore[arg-type]
        except WorkerError as exc:
            if (gen := self.report.active()) is not None:
                gen.load_errors[spec.model_ref] = f"{exc.code}: {exc.message}"
            raise
        assert isinstance(reply, Loaded)  # the RequestTracker lets no other reply end a LOAD
        self.loads = {**self.loads, spec.model_ref: spec}
        if (gen := self.report.active()) is not None:
            gen.loaded(spec.model_ref, reply)
            gen.beams[spec.model_ref] = int(spec.runtime_config.get("beam", 0))
        await self._apply_to_standby(Load.T, spec.model_ref)
        return reply

    async def unload_model(self, model_ref: str, *, timeout: float | None = None) -> None:
        """UNLOAD on both workers; later generations no longer load it. An unload lifts the lane's quarantine."""
        self.loads = {m: s for m, s in self.loads.items() if m != model_ref}
        self.lift_quarantine()
        try:
            await self.call(Unload(model_ref=model_ref), timeout=timeout)
        except WorkerError as exc:
            if exc.code != "model_not_loaded":
                raise
        if (gen := self.report.active()) is not None and model_ref in gen.models:
            gen.models.remove(model_ref)
        await self._apply_to_standby(Unload.T, model_ref)

    async def standby_call(self, kind: str, model: str | None = None) -> Reply | None:
        """LOAD / UNLOAD / PING on the warm standby, through the lifecycle like any request (so never beside
        another on its connection). None without a standby that could answer."""
        ticket, effects = self.machine.apply_to_standby(kind, model, trio.current_time())
        if ticket is None:
            return None
        job = self.runner.register(ticket, self.runner.own_job(ticket))
        self.runner.feed(effects)
        await job.done.wait()
        return job.result

    async def _apply_to_standby(self, kind: str, model: str) -> None:
        if self.machine.standby is None:
            return
        if await self.standby_call(kind, model) is None:  # it failed (an ERR included) or could not answer
            self.runner.feed(self.machine.replace_standby(trio.current_time()))  # its successor loads them as they are
