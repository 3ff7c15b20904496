"""The simulated world (docs/testing.md, 'The simulated world'): the real Supervisor (lanes, router, batcher, data
plane) on in-process fake engines under MockClock(autojump_threshold=0), driven by a scenario, its invariants
checked whenever the scenario asks and at the end. A seed fixes the whole run: the fault plans the worker
generations draw, the scenario's own randomness and trio's scheduling. Returns the violations found (empty: the run
passed)."""

from __future__ import annotations

import gc
import logging
import random
import shutil
import sys
import tempfile
import traceback
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio
import trio.testing

from .. import LaneConfig, ModelConfig, QuarantinePolicy, RestartPolicy, Supervisor, SupervisorConfig, Windows
from .._errors import GpuWorkerError
from .._proto import GenState, LaneState
from ..supervisor import Lane
from ._launcher import SimLauncher, SimProc
from ._plan import FaultPlan
from ._schedule import drawn_plan

MODEL = "sim-a"  # the model every simulated lane serves
WINDOWS = Windows(inference_s=5.0, setup_s=10.0, control_s=10.0, load_s=10.0, kill_grace_s=1.0, shutdown_s=2.0,
                  exit_status_s=0.1)
# every request ends within this much simulated time of its start, whatever the workers do (it may wait for a
# queue, a restart with backoff and a standby's load, each bounded by a window)
BOUND = 12 * max(WINDOWS.inference_s, WINDOWS.load_s) + 2 * WINDOWS.kill_grace_s + 8.0
DRAIN_S = 5.0  # the SIGTERM drain bound at the end of every run
SETTLE_S = 3 * WINDOWS.control_s  # an orphan's uninstall and a hung worker's PING window, then its kill
# a run that has not ended this long (simulated) after its scenario hangs somewhere, and one that takes this many
# scheduler batches spins: either is a finding, not a run that never ends
HORIZON_S = BOUND + SETTLE_S + DRAIN_S + 4 * WINDOWS.shutdown_s + 60.0
SCENARIO_HORIZON_S = 3600.0  # a scenario of one's own ends within this much simulated time, its end included
MAX_BATCHES = 500_000  # scheduler batches (one per I/O wait: cheaper to count than task steps)
WEDGED_BATCHES = 10_000  # batches after the horizon's cancel with a task still shielded: the run is wedged


@dataclass(frozen=True)
class WorldShape:
    """The world a simulation runs: how many lanes serve MODEL (lane0 with a warm standby, if `standby`), the
    strikes that quarantine a lane, and the chance that a worker generation misbehaves on each serving request
    (its plan drawn from the seed), unless `plan` fixes every generation's."""

    lanes: int = 1
    standby: bool = False
    strikes: int = 2
    fault_rate: float = 0.0
    plan: FaultPlan | None = None

    def config(self, directory: Path) -> SupervisorConfig:
        """The supervisor's configuration, its artifact and state under `directory`."""
        artifact = directory / "sim.bin"
        if not artifact.exists():
            artifact.write_bytes(b"sim weights")
        lanes = tuple(LaneConfig(f"lane{i}", (MODEL,), standby=self.standby and i == 0) for i in range(self.lanes))
        return SupervisorConfig(
            lanes=lanes, models=(ModelConfig(MODEL, artifact, digest="0" * 64),), state_dir=directory / "state",
            runtime_dir=directory / "run", windows=WINDOWS, quarantine=QuarantinePolicy(self.strikes, 20.0),
            restart=RestartPolicy(0.1, 2.0, 2.0), arena_bytes=4 << 20, health_interval_s=3.0, max_batch_items=64)


@dataclass
class Simulation:
    """One run of the simulated world, as its scenario sees it: the supervisor, the launcher (each worker it started
    in `launcher.procs`), the seed's own random numbers, and what was found wrong so far (`found`)."""

    seed: int
    rng: random.Random
    found: list[str]
    sup: Supervisor | None = None
    launcher: SimLauncher | None = None
    injected: set[int] = field(default_factory=set)  # generations that misbehaved or that the scenario killed
    events: trio.MemoryReceiveChannel[dict[str, Any]] | None = None
    finished: bool = False

    @property
    def supervisor(self) -> Supervisor:
        """The Supervisor under test."""
        assert self.sup is not None
        return self.sup

    def misbehaved(self, generation: int, what: str) -> None:
        """A worker generation did as its plan said (a fault it may be struck for)."""
        self.injected.add(generation)

    def worker(self, lane: Lane, standby: bool = False) -> SimProc | None:
        """The lane's active worker (or its standby), counted as one the scenario harms: its strikes are due."""
        m = lane.machine
        g = m.standby if standby and m.standby is not None else m.active
        proc = self.launcher.procs.get((lane.id, g.number)) if g is not None and self.launcher is not None else None
        if proc is not None and g is not None:
            self.injected.add(g.number)
        return proc

    def kill(self, lane: Lane, standby: bool = False) -> None:
        """kill -9 the lane's worker (or its standby)."""
        if (proc := self.worker(lane, standby)) is not None:
            proc.crash()

    def hang(self, lane: Lane, standby: bool = False) -> None:
        """The lane's worker (or its standby) stops reading, writing and answering, as a SIGSTOP would."""
        if (proc := self.worker(lane, standby)) is not None:
            proc.worker.hung.set()

    def watch(self, nursery: trio.Nursery) -> None:
        """Start, in `nursery`, the watchers that check invariants between the scenario's checks (none here)."""

    def pending(self) -> list[str]:
        """What the scenario started and nothing has answered yet (for the report of a run that did not end)."""
        return []

    async def idle(self) -> None:
        """Until nothing the scenario started is in flight."""
        await trio.lowlevel.checkpoint()

    def check(self) -> None:
        """The lanes as /v1/lanes reports them agree with their machines, and only faults were struck."""
        sup, found = self.supervisor, self.found
        while self.events is not None:
            try:
                ev = self.events.receive_nowait()
            except (trio.WouldBlock, trio.EndOfChannel):
                break
            if ev["t"] == "WORKER_CRASHED" and ev["generation"] not in self.injected:
                found.append(f"healthy worker struck: {ev}")
        for status in sup.status():
            lane = sup.lanes[str(status["lane_id"])]
            found.extend(self._lane_findings(lane, status))

    def _lane_findings(self, lane: Lane, status: dict[str, Any]) -> list[str]:
        m, out = lane.machine, []
        where = f"{lane.id} ({m.state.value})"
        if status["state"] != m.state.value or status["generation"] != m.generation:
            out.append(f"{where}: /v1/lanes says {status['state']} g{status['generation']}, the machine "
                       f"{m.state.value} g{m.generation}")
        a = m.active
        if m.state is LaneState.BUSY and (a is None or a.open is None or a.open.internal):
            out.append(f"{where}: busy without a request open on its active generation")
        if m.state in (LaneState.READY, LaneState.BUSY) and (a is None or a.state is not GenState.READY):
            out.append(f"{where}: serving without a ready active generation")
        if m.state in (LaneState.RESTARTING, LaneState.QUARANTINED, LaneState.STOPPED) and a is not None:
            out.append(f"{where}: an active generation while it should have none")
        if m.state is LaneState.QUARANTINED and (m.standby is not None or m.tickets.queue):
            out.append(f"{where}: quarantined with a standby or queued requests")
        if a is not None and a.number in lane.gens and self.launcher is not None:
            proc = self.launcher.procs.get((lane.id, a.number))
            if proc is not None and status["pid"] != proc.pid:
                out.append(f"{where}: /v1/lanes pid {status['pid']} is not its active worker's {proc.pid}")
        return out

    async def finish(self) -> None:
        """The end of the run, as the daemon's SIGTERM ends it: invariants checked, what is in flight drained (for
        DRAIN_S at most) or aborted, the supervisor closed. After the scenario, unless it finished itself (to end,
        inside its own nursery, what only the close ends: a pull parked on a ring)."""
        self.check()
        await self.sigterm(DRAIN_S)
        self.supervisor.close()  # as the daemon does after its drain; a parked pull ends only here
        self.finished = True

    async def sigterm(self, drain_s: float) -> None:
        """As the daemon's SIGTERM does: wait (bounded) for what is in flight, abort what still runs, then the
        supervisor closes (stop admitting, shut every worker down in order)."""
        with trio.move_on_after(drain_s):
            await self.idle()
        for lane in self.supervisor.lanes.values():
            if lane.state in (LaneState.BUSY, LaneState.DRAINING):
                lane.abort_in_flight()

    async def check_settled(self, settle_s: float = SETTLE_S) -> None:
        """Once everything the scenario started has ended and the lanes had `settle_s` to settle (an orphaned
        ring's uninstall, a hung worker's PING window and kill), no ring end and no arena lease is left: whatever a
        call did was undone, however its caller left (its deadline, an outer cancel scope, a failing sibling)."""
        await trio.sleep(settle_s)
        sup = self.supervisor
        dp = sup.dataplane
        if dp is not None and dp.ends:
            self.found.append(f"ring ends left once every step had ended: {sorted(dp.ends)}")
        if sup.arena is not None and sup.arena.live():
            self.found.append(f"arena leases left once every step had ended: "
                              f"{[le.ring_id for le in sup.arena.live()]}")

    def check_end(self) -> None:
        """After the supervisor closed: every lane stopped, no ring, device handle or arena lease left."""
        sup = self.supervisor
        for lane in sup.lanes.values():
            if lane.state is not LaneState.STOPPED:
                self.found.append(f"{lane.id}: {lane.state.value} after the supervisor closed")
        dp = sup.dataplane
        if dp is not None and dp.ends:
            self.found.append(f"ring ends left: {sorted(dp.ends)}")
        if dp is not None and dp.steps.handles.count():
            self.found.append(f"device handles left: {dp.steps.handles.count()}")
        if sup.arena is not None and sup.arena.live():
            self.found.append(f"arena leases left: {[le.ring_id for le in sup.arena.live()]}")


Scenario = Callable[[Simulation], Awaitable[None]]


def simulate(scenario: Scenario, seed: int, shape: WorldShape | None = None, *, directory: Path | None = None,
             horizon_s: float = SCENARIO_HORIZON_S) -> list[str]:
    """Run `scenario` in the world `shape` describes, seeded by `seed`; what it found wrong (empty: nothing). The
    scenario's own exceptions are findings too, as is a run that has not ended within `horizon_s` simulated
    seconds. Its state goes under `directory` (default: a temporary one)."""
    own = directory is None
    where = Path(tempfile.mkdtemp(prefix="gpuworker-sim-")) if directory is None else directory
    try:
        world = Simulation(seed, random.Random(seed ^ 0x5EED), [])
        return run_world(world, scenario, shape or WorldShape(), where, horizon_s)
    finally:
        if own:
            shutil.rmtree(where, ignore_errors=True)


class _Spin(trio.abc.Instrument):
    def __init__(self, scope: trio.CancelScope) -> None:
        self.scope, self.steps = scope, 0
        self.cancelled_at: int | None = None  # the batch at which the horizon (or the batch bound) cancelled it

    def before_io_wait(self, timeout: float) -> None:
        self.steps += 1
        if self.steps == MAX_BATCHES:
            self.scope.cancel()
        if self.cancelled_at is None and self.scope.cancel_called:
            self.cancelled_at = self.steps

    def wedged(self) -> bool:
        return self.cancelled_at is not None and self.steps - self.cancelled_at > WEDGED_BATCHES


class _Wedged(Exception):
    """The run went on after its horizon cancelled it: a task waits, shielded, for what nothing will answer."""


def _sim_clock(spin: _Spin) -> trio.testing.MockClock:
    """The autojump clock, which ends a run wedged past its horizon: with nothing runnable and no deadline left,
    the event loop would poll forever, in real time, for what never comes. The loop asks the clock how long to
    sleep only when nothing is runnable, so that is where a wedged run is ended (MockClock is final: the
    question is answered by the instance's own function)."""
    clock = trio.testing.MockClock(autojump_threshold=0)
    sleep_time = clock.deadline_to_sleep_time

    def deadline_to_sleep_time(deadline: float) -> float:
        if spin.wedged():
            raise _Wedged(f"the run wedged: {WEDGED_BATCHES} scheduler batches after its horizon it still waits")
        return sleep_time(deadline)

    clock.deadline_to_sleep_time = deadline_to_sleep_time  # type: ignore[method-assign]
    return clock


def run_world(world: Simulation, scenario: Scenario, shape: WorldShape, directory: Path, horizon_s: float) -> list[str]:
    """`world` run through `scenario` under a fresh trio run; its findings."""
    logging.getLogger("trio_gpuworker").setLevel(logging.CRITICAL)  # faults are the point here, not news
    trio._core._run._r.seed(world.seed)  # the scheduler's own tie-breaks, so the seed fixes the whole run
    scope = trio.CancelScope()
    spin, wedged = _Spin(scope), False
    try:
        trio.run(_bounded, world, scenario, shape, directory, horizon_s, scope, clock=_sim_clock(spin),
                 instruments=[spin])
    except trio.TrioInternalError as exc:
        if not isinstance(exc.__cause__, _Wedged):
            raise
        world.found.append(f"{exc.__cause__}; never answered: {world.pending()}")
        wedged = True
    except BaseException as exc:
        world.found.append(f"escaped: {''.join(traceback.format_exception(exc))}")
    if wedged:  # (once the exception, which holds their frames, is gone)
        _abandon_quietly()
    return world.found


def _abandon_quietly() -> None:
    """A wedged run's tasks are abandoned mid-wait: their coroutines, collected now, fail to unwind outside trio.
    That is the run's end, already reported, not news."""
    hook = sys.unraisablehook
    sys.unraisablehook = lambda unraisable: None
    try:
        gc.collect()
    finally:
        sys.unraisablehook = hook


async def _bounded(world: Simulation, scenario: Scenario, shape: WorldShape, directory: Path, horizon_s: float,
                   scope: trio.CancelScope) -> None:
    scope.deadline = trio.current_time() + horizon_s
    with scope:
        await _run(world, scenario, shape, directory)
    if scope.cancelled_caught:
        world.found.append(f"the run did not end: {trio.current_time():.1f} s simulated (horizon {horizon_s:g} s), "
                           f"{MAX_BATCHES} scheduler batches at most; never answered: {world.pending()}")


async def _run(world: Simulation, scenario: Scenario, shape: WorldShape, directory: Path) -> None:
    async with trio.open_nursery() as sim:
        plan = shape.plan or (lambda spec: drawn_plan(world.seed, shape.fault_rate, spec.generation))
        launcher = SimLauncher(sim, plan, world.misbehaved)
        world.launcher = launcher
        async with Supervisor(shape.config(directory), launcher=launcher) as sup:
            world.sup = sup
            world.watch(sim)
            world.events = sup.subscribe()
            try:
                await scenario(world)
            except GpuWorkerError as exc:
                world.found.append(f"the scenario failed: {type(exc).__name__}: {exc}")
            except Exception as exc:
                world.found.append(f"the scenario raised: {''.join(traceback.format_exception(exc))}")
            if not world.finished:
                await world.finish()
        world.check()
        world.check_end()
        if launcher.running():
            world.found.append(f"worker processes outlived the supervisor: {[p.pid for p in launcher.running()]}")
        sim.cancel_scope.cancel()


__all__ = ["BOUND", "DRAIN_S", "HORIZON_S", "MODEL", "SETTLE_S", "WINDOWS", "Scenario", "Simulation", "WorldShape",
           "run_world", "simulate"]
