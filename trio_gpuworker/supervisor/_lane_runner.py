"""What carries a lane lifecycle machine's effects out (supervisor/_lane.py owns one).

It spawns generations (through the lane's Launcher), starts an exchange per request the machine sends, sends
SHUTDOWN abort_in_flight, ends generations, answers callers, and feeds back what happened: HELLO, replies, faults,
reaps. Effects are carried out in order from one queue and never nested, so what callers see follows the
machine's order exactly, even when carrying one effect out feeds the machine again (a kill is a fault).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from typing import Any

import trio

from .._config import SupervisorConfig
from .._errors import InvalidRequest
from .._proto import (
    Abort,
    Crashed,
    Effect,
    ExecuteStep,
    Finish,
    Kill,
    LaneLifecycle,
    LaneState,
    LaneTicket,
    Load,
    Outcome,
    Reply,
    Send,
    Shutdown,
    Spawn,
    WireMessage,
    WorkerStopped,
)
from ._exchange import exchange
from ._generation import Generation, host, own_request
from ._jobs import Job, LaneSettings
from ._lane_report import LaneReport
from ._launcher import Launcher
from ._logring import LogRing
from ._spawn import worker_argv, worker_env
from ._worker import WorkerProcess

Hook = Callable[[Any, int, WireMessage | None], None]


class LaneRunner:
    def __init__(self, owner: Any, sup: SupervisorConfig, machine: LaneLifecycle, report: LaneReport,
                 launcher: Launcher, log: LogRing, bus: Any, arena_env: dict[str, str]) -> None:
        self.owner = owner  # what the hooks are told about (the Lane)
        self.lane_id, self.sup, self.windows, self.machine, self.report = report.id, sup, sup.windows, machine, report
        self.launcher, self.log, self.bus, self._arena_env = launcher, log, bus, arena_env
        self.gens: dict[int, Generation] = report.gens
        # hook(lane, generation, msg) for worker notifications, hook(lane, generation, None) once that generation
        # is reaped (the data plane's crash fan-out and lease release)
        self.hooks: list[Hook] = []
        self.last_reaped: tuple[int, int] = (-1, 0)  # (pid, returncode) of the last reaped worker
        self.nursery: trio.Nursery | None = None  # the lane task's: generations run in it
        self.changed = trio.Event()  # set (and replaced) after every batch of effects
        self.stopped = trio.Event()  # the machine reached STOPPED
        self.rearm = trio.Event()  # the machine's next deadline moved
        self.deadline = math.inf
        self._jobs: dict[int, Job] = {}  # ticket id -> whoever waits for its answer
        self._own: dict[int, Callable[[Finish], None]] = {}  # ticket id -> what the lane does with its own
        self._effects: deque[Effect] = deque()
        self._applying = False

    def register(self, ticket: LaneTicket, job: Job) -> Job:
        """Before the effects that came with `ticket` are fed: they may answer it at once (a refusal)."""
        self._jobs[ticket.id] = job
        return job

    def own_job(self, t: LaneTicket) -> Job:
        """The lane's own requests: its models' LOADs, standby applies, PING, SHUTDOWN."""
        gen = self.gens.get(t.gen or -1)
        job = self._jobs.setdefault(t.id, Job(t.kind, own_request(t.kind, t.model, self._settings(t).loads)))
        match job.request:
            case Shutdown() if gen is not None:
                gen.wp.ordered_stop = True
            case Load():
                self._own[t.id] = self._record_load
        return job

    def _settings(self, t: LaneTicket) -> LaneSettings:
        """The settings of the generation `t` is for: a LOAD loads what that generation was spawned with."""
        g = self.machine.gens.get(t.gen or -1)
        return g.settings if g is not None else self.machine.settings  # type: ignore[no-any-return]

    def _record_load(self, e: Finish) -> None:
        gen = self.gens.get(e.ticket.gen or -1)
        if gen is not None and e.ticket.model and e.outcome is Outcome.REPLY and isinstance(e.payload, Reply):
            gen.loaded(e.ticket.model, e.payload.msg)

    def feed(self, effects: list[Effect]) -> None:
        self._effects.extend(effects)
        if self._applying:
            return  # the loop below is running further up this stack: it takes these in order
        self._applying = True
        try:
            while self._effects:
                self._apply(self._effects.popleft())
        finally:
            self._applying = False
        self.changed.set()
        self.changed = trio.Event()
        if (deadline := self.machine.next_deadline()) != self.deadline:
            self.deadline = deadline
            self.rearm.set()
        if self.machine.state is LaneState.STOPPED:
            self.stopped.set()

    def _apply(self, e: Effect) -> None:
        if isinstance(e, Finish):
            job = self._jobs.pop(e.ticket.id, None)
            if job is not None:
                result, error = self.report.outcome(e)
                extras = e.payload.extras if isinstance(e.payload, Reply) else ()
                job.finish(result=result, error=error, extras=extras)
            if (own := self._own.pop(e.ticket.id, None)) is not None:
                own(e)
        elif isinstance(e, Send):
            gen = self.gens[e.gen]
            job = self._jobs.get(e.ticket.id) or self.own_job(e.ticket)
            if not _start(gen.nursery, self._exchange, gen, e.ticket, job):
                gen.wp.stop_now("its task is gone")  # the lane itself is being torn down
        elif isinstance(e, Spawn):
            self._spawn(e.gen, e.role.value)
        elif isinstance(e, Kill):
            self.gens[e.gen].wp.stop_now("stopped in order")
        elif isinstance(e, Abort):
            gen = self.gens[e.gen]
            gen.wp.ordered_stop = True
            if not _start(gen.nursery, self._abort, gen):
                gen.wp.stop_now("its task is gone")
        elif isinstance(e, Crashed):
            self.report.crashed(self.gens[e.gen], e.role.value)

    async def _exchange(self, gen: Generation, t: LaneTicket, job: Job) -> None:
        n, machine, first = gen.number, self.machine, self.report.first
        loading = isinstance(job.request, Load)
        if loading:
            first.loading(t.model)

        def progressed() -> None:
            if loading:
                first.progressed()
            machine.progress(n, t)

        try:
            reply = await exchange(gen.wp, job, self.windows, on_progress=progressed,
                                   extend=self.report.step_waits_on_us if isinstance(job.request, ExecuteStep)
                                   else None)
        except InvalidRequest as exc:  # failed local validation: this request alone, nothing was written
            self.feed(machine.replied(n, t, exc, success=False, refused=True, now=trio.current_time()))
            return
        self.feed(machine.replied(n, t, reply, success=not reply.msg.FAILS, now=trio.current_time()))

    async def _abort(self, gen: Generation) -> None:
        """SHUTDOWN abort_in_flight, out of band; a worker that has not stopped within shutdown_s is killed."""
        try:
            await gen.wp.send_message(Shutdown(mode="abort_in_flight"))
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            return  # it is gone already: the fault path ends it
        await trio.sleep(self.windows.shutdown_s)
        gen.wp.stop_now(f"abort_in_flight: still running after {self.windows.shutdown_s:g} s")

    # --- generations ---------------------------------------------------------------------------

    def _spawn(self, number: int, role: str) -> None:
        settings: LaneSettings = self.machine.gens[number].settings
        wp = WorkerProcess(lane_id=self.lane_id, generation=number, argv=worker_argv(settings.cfg),
                           env=worker_env(settings.cfg, self.sup.state_dir, number, self._arena_env),
                           launcher=self.launcher, max_frame=self.sup.max_frame,
                           kill_grace_s=self.windows.kill_grace_s, drain_s=self.windows.exit_status_s, log=self.log,
                           on_event=self._on_event,
                           on_fault=lambda fault: self.feed(self.machine.fault(number, fault.cause,
                                                                               trio.current_time())))
        gen = self.gens[number] = Generation(number, role, wp)
        gen.beams = {m: int(spec.runtime_config.get("beam", 0)) for m, spec in settings.loads.items()}
        # if the lane task is being torn down this spawns nothing: the lane's cancel answers everything
        _start(self.nursery, host, gen, self.windows,
               lambda: self.feed(self.machine.hello(number, trio.current_time())),
               lambda salvaged: self._reaped(gen, salvaged))

    def _reaped(self, gen: Generation, salvaged: Reply | None) -> None:
        assert gen.rc is not None
        self.last_reaped = (gen.wp.pid or -1, gen.rc)
        self.report.ended(gen)
        try:
            self.feed(self.machine.ended(gen.number, salvaged, trio.current_time()))
        finally:
            for hook in list(self.hooks):
                hook(self.owner, gen.number, None)  # reaped: everything of this generation is gone
            self.gens.pop(gen.number, None)

    def _on_event(self, wp: WorkerProcess, msg: WireMessage) -> None:
        for hook in list(self.hooks):
            hook(self.owner, wp.generation, msg)
        if isinstance(msg, WorkerStopped):
            self.feed(self.machine.said_stopped(wp.generation, trio.current_time()))
        if not msg.HINT:
            self.bus.publish({"t": msg.T, **msg.to_fields(), "lane_id": self.lane_id, "generation": wp.generation})


def _start(nursery: trio.Nursery | None, fn: Callable[..., Any], *args: Any) -> bool:
    """start_soon, or False when the nursery is closed (the lane task is being torn down)."""
    if nursery is None:
        return False
    try:
        nursery.start_soon(fn, *args)
    except RuntimeError:
        return False
    return True
