"""Run one schedule: the real Supervisor (lanes, router, batcher, data plane) on SimLauncher workers under
MockClock(autojump_threshold=0), every step a task of its own, invariants checked before every step and at the
end. Returns the violations found (empty: the schedule passed)."""

from __future__ import annotations

import logging
import random
import traceback
from pathlib import Path

import trio
import trio.testing

from tests.sim import actions as act
from tests.sim.launcher import SimLauncher
from tests.sim.schedule import Schedule
from trio_gpuworker import (
    LaneConfig,
    ModelConfig,
    QuarantinePolicy,
    RestartPolicy,
    Supervisor,
    SupervisorConfig,
)
from trio_gpuworker._proto import GenState, LaneState

DRAIN_S = 5.0  # the SIGTERM drain bound at the end of every schedule


def config(schedule: Schedule, base: Path) -> SupervisorConfig:
    artifact = base / "sim.bin"
    if not artifact.exists():
        artifact.write_bytes(b"sim weights")
    lanes = tuple(LaneConfig(f"lane{i}", ("sim-a",), standby=schedule.standby and i == 0)
                  for i in range(schedule.lanes))
    return SupervisorConfig(
        lanes=lanes, models=(ModelConfig("sim-a", artifact, digest="0" * 64),), state_dir=base / "state",
        runtime_dir=base / "run", windows=act.WINDOWS, quarantine=QuarantinePolicy(schedule.strikes, 20.0),
        restart=RestartPolicy(0.1, 2.0, 2.0), arena_bytes=4 << 20, health_interval_s=3.0, max_batch_items=64)


# a run that has not ended this long (simulated) after its last step hangs somewhere, and one that takes this many
# task steps spins: either is a finding, not a test that never ends
HORIZON_S = act.BOUND + act.SETTLE_S + DRAIN_S + 4 * act.WINDOWS.shutdown_s + 60.0
MAX_BATCHES = 500_000  # scheduler batches (one per I/O wait: cheaper to count than task steps)


class _Spin(trio.abc.Instrument):
    def __init__(self, scope: trio.CancelScope) -> None:
        self.scope, self.steps = scope, 0

    def before_io_wait(self, timeout: float) -> None:
        self.steps += 1
        if self.steps == MAX_BATCHES:
            self.scope.cancel()


def run_schedule(schedule: Schedule, base: Path) -> list[str]:
    logging.getLogger("trio_gpuworker").setLevel(logging.CRITICAL)  # faults are the point here, not news
    trio._core._run._r.seed(schedule.seed)  # the scheduler's own tie-breaks, so the seed fixes the whole run
    found: list[str] = []
    scope = trio.CancelScope()
    try:
        trio.run(_bounded, schedule, base, found, scope, clock=trio.testing.MockClock(autojump_threshold=0),
                 instruments=[_Spin(scope)])
    except BaseException as exc:
        found.append(f"escaped: {''.join(traceback.format_exception(exc))}")
    return found


async def _bounded(schedule: Schedule, base: Path, found: list[str], scope: trio.CancelScope) -> None:
    last = schedule.steps[-1].at if schedule.steps else 0.0
    scope.deadline = trio.current_time() + last + HORIZON_S
    worlds: list[act.World] = []
    with scope:
        await _run(schedule, base, found, worlds)
    if scope.cancelled_caught:
        waiting = [str(e.step) for w in worlds for e in w.ledger if e.done is None]
        found.append(f"the run did not end: {trio.current_time():.1f} s simulated (horizon {last + HORIZON_S:g} s), "
                     f"{MAX_BATCHES} scheduler batches at most; never answered: {waiting}")


async def _run(schedule: Schedule, base: Path, found: list[str], worlds: list[act.World]) -> None:
    world = act.World(schedule, random.Random(schedule.seed ^ 0x5EED), found)
    worlds.append(world)
    async with trio.open_nursery() as sim:
        launcher = SimLauncher(sim, lambda spec: schedule.fate(spec.generation), world.misbehaved)
        world.launcher = launcher
        async with Supervisor(config(schedule, base), launcher=launcher) as sup:
            world.sup = sup
            for lane in sup.lanes.values():
                sim.start_soon(world.watch_batches, lane)
            events = sup.subscribe()
            t0 = trio.current_time()
            async with trio.open_nursery() as steps:
                for step in schedule.steps:
                    await trio.sleep_until(t0 + step.at)
                    check_lanes(world, events)
                    steps.start_soon(world.perform, world.begin(step))
                with trio.move_on_after(act.BOUND) as waited:
                    await world.idle()
                if not waited.cancelled_caught:
                    await world.check_settled()
                check_lanes(world, events)
                await world.sigterm(DRAIN_S)
                sup.close()  # as the daemon does after its drain; a parked pull ends only here
            check_lanes(world, events)
        world.check_end()
        if launcher.running():
            found.append(f"worker processes outlived the supervisor: {[p.pid for p in launcher.running()]}")
        sim.cancel_scope.cancel()


def check_lanes(world: act.World, events: trio.MemoryReceiveChannel[dict[str, object]]) -> None:
    """The lanes as /v1/lanes reports them agree with their machines, and only faults were struck."""
    sup, found = world.sup, world.found
    assert sup is not None
    while True:
        try:
            ev = events.receive_nowait()
        except (trio.WouldBlock, trio.EndOfChannel):
            break
        if ev["t"] == "WORKER_CRASHED" and ev["generation"] not in world.injected:
            found.append(f"healthy worker struck: {ev}")
    for status in sup.status():
        lane = sup.lanes[str(status["lane_id"])]
        m = lane.machine
        where = f"{lane.id} ({m.state.value})"
        if status["state"] != m.state.value or status["generation"] != m.generation:
            found.append(f"{where}: /v1/lanes says {status['state']} g{status['generation']}, the machine "
                         f"{m.state.value} g{m.generation}")
        a = m.active
        if m.state is LaneState.BUSY and (a is None or a.open is None or a.open.internal):
            found.append(f"{where}: busy without a request open on its active generation")
        if m.state in (LaneState.READY, LaneState.BUSY) and (a is None or a.state is not GenState.READY):
            found.append(f"{where}: serving without a ready active generation")
        if m.state in (LaneState.RESTARTING, LaneState.QUARANTINED, LaneState.STOPPED) and a is not None:
            found.append(f"{where}: an active generation while it should have none")
        if m.state is LaneState.QUARANTINED and (m.standby is not None or m.tickets.queue):
            found.append(f"{where}: quarantined with a standby or queued requests")
        if a is not None and a.number in lane.gens and world.launcher is not None:
            proc = world.launcher.procs.get((lane.id, a.number))
            if proc is not None and status["pid"] != proc.pid:
                found.append(f"{where}: /v1/lanes pid {status['pid']} is not its active worker's {proc.pid}")


__all__ = ["config", "run_schedule"]
