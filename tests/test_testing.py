"""trio_gpuworker.testing, as a user of the package meets it: fault plans as data, every fault of a fake engine run
in-process under a mock clock and (some) as a real process, a supervisor with fake lanes, and a scenario of one's
own run by the simulated world over many seeds."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import trio

from trio_gpuworker import DeadlineExceeded, EngineCrashed, LaneState, NoLaneAvailable, Supervisor
from trio_gpuworker.testing import (
    EVERY,
    FAKE_MODEL,
    HANDSHAKE_FAULTS,
    RANDOM_FAULTS,
    REQUEST_FAULTS,
    SIM_MODEL,
    FaultPlan,
    Simulation,
    WorldShape,
    fake_supervisor,
    search,
    simulate,
)

ROWS = [np.array([1, 2, 3], np.int32), np.array([7], np.int32)]


async def embed(sup: Supervisor, model: str = FAKE_MODEL, timeout: float | None = None) -> np.ndarray:
    return await sup.embed_ids(ROWS, model=model, pooling="mean", normalize=False, timeout=timeout)


def test_a_plan_is_data() -> None:
    plan = FaultPlan(faults={2: "crash_mid_request", EVERY: "slow"}, fault_rate=0.5, seed=3, generations={1},
                     crash_in_load=1, once_file=Path("/tmp/x"))
    assert FaultPlan.from_json(plan.to_json()) == plan
    assert plan.command()[-2:] == ("--plan", plan.to_json())
    assert plan.for_generation(1) is plan and plan.for_generation(2) == FaultPlan()
    rng = random.Random(0)
    assert plan.request_fault(2, rng) == "crash_mid_request" and plan.request_fault(5, rng) == "slow"
    drawn = [FaultPlan(fault_rate=0.5).request_fault(n, random.Random(9)) for n in range(1, 20)]
    assert set(drawn) - {None} <= set(RANDOM_FAULTS) and drawn == [
        FaultPlan(fault_rate=0.5).request_fault(n, random.Random(9)) for n in range(1, 20)]  # a seed replays
    with pytest.raises(ValueError):
        FaultPlan(faults={1: "explode"})
    with pytest.raises(ValueError):
        FaultPlan(handshake="crash_mid_request")


# what the caller of the first request sees when generation 1 does the fault; the second request is the next
# generation's (or still generation 1's, when the fault left it serving)
HANGS = {"hang_silent", "hang_after_progress", "hang_sigstop", "stop_reading"}
SERVED = {"flood_stderr", "slow", "exit_after_reply", "stop_after_reply"}


@pytest.mark.parametrize("fault", REQUEST_FAULTS)
async def test_every_request_fault_in_process(fault: str, sim_clock: trio.testing.MockClock, tmp_path: Path) -> None:
    plan = FaultPlan(faults={1: fault}, generations={1})
    async with fake_supervisor(tmp_path, plan) as sup:
        lane = sup.lanes["lane0"]
        t0 = trio.current_time()
        if fault in SERVED:
            assert (await embed(sup))[:, :2].tolist() == [[6, 3], [7, 1]]
        else:
            with pytest.raises(EngineCrashed) as info:
                await embed(sup)
            assert info.value.cause == ("hang" if fault in HANGS else "crash" if "crash" in fault else "protocol")
            assert (trio.current_time() - t0 >= sup.config.windows.inference_s) == (fault in HANGS)
        if fault == "flood_stderr":
            assert "fake worker flood" in lane.log.tail(4096)
        if fault == "exit_after_reply":  # the next request would race the exit: wait for the next generation
            while lane.generation == 1:  # noqa: ASYNC110 (under the mock clock: no wall time passes)
                await trio.sleep(0.01)
        if fault == "stop_after_reply":
            with pytest.raises(EngineCrashed) as info:  # it reads no more: the next request is a hang
                await embed(sup)
            assert info.value.cause == "hang"
        out = await embed(sup)
        assert out[:, :2].tolist() == [[6, 3], [7, 1]]
        assert out[0, 3] == lane.generation  # the in-process fake's fourth column: the generation that answered
        assert lane.generation == (1 if fault in {"flood_stderr", "slow"} else 2)


@pytest.mark.parametrize("fault", HANDSHAKE_FAULTS)
async def test_every_handshake_fault_in_process(fault: str, sim_clock: trio.testing.MockClock,
                                                tmp_path: Path) -> None:
    async with fake_supervisor(tmp_path, FaultPlan(handshake=fault, generations={1})) as sup:
        lane = sup.lanes["lane0"]
        await lane.wait_state(LaneState.READY)
        assert lane.generation == 2 and lane.policy.strikes == 1
        assert (await embed(sup))[:, :2].tolist() == [[6, 3], [7, 1]]


async def test_a_crash_in_load_then_a_slow_load(sim_clock: trio.testing.MockClock, tmp_path: Path) -> None:
    plans = {1: FaultPlan(crash_in_load=EVERY), 2: FaultPlan(load_s=8.0)}  # within the load window (10 s)
    async with fake_supervisor(tmp_path, lambda spec: plans[spec.generation]) as sup:
        lane = sup.lanes["lane0"]
        await lane.wait_state(LaneState.READY)
        assert lane.generation == 2 and lane.policy.strikes == 1 and trio.current_time() >= 8.0
        assert (await embed(sup))[:, 3].tolist() == [2, 2]


async def test_a_plan_as_a_real_process(tmp_path: Path) -> None:
    """The same plan, run by a lane as a process: it dies mid-request in its first generation only."""
    plan = FaultPlan(faults={1: "crash_mid_request"}, generations={1})
    async with fake_supervisor(tmp_path, plan, processes=True) as sup:
        with pytest.raises(EngineCrashed) as info:
            await embed(sup)
        assert info.value.exit_code == 5 and "fake worker" in info.value.log_tail
        out = await embed(sup)
        assert out[:, :2].tolist() == [[6, 3], [7, 1]] and sup.lanes["lane0"].generation == 2


@pytest.mark.parametrize("fault", ["hang_after_progress", "stop_reading"])
async def test_the_process_fake_hangs_as_the_plan_says(tmp_path: Path, fault: str) -> None:
    async with fake_supervisor(tmp_path, FaultPlan(faults={1: fault}), processes=True) as sup:
        with pytest.raises(DeadlineExceeded):
            await embed(sup, timeout=0.5)  # the caller's deadline, well inside the inference window
        assert sup.lanes["lane0"].policy.strikes == 0


# --- a scenario of one's own --------------------------------------------------------------------------------


async def retrying_embeds(sim: Simulation) -> None:
    """A user's retry logic under random worker faults: every call must end with its own vectors."""
    for _ in range(6):
        rows = [np.arange(1, 2 + sim.rng.randrange(8), dtype=np.int32)]
        for attempt in range(20):
            try:
                out = await sim.supervisor.embed_ids(rows, model=SIM_MODEL, pooling="mean", normalize=False)
                break
            except (EngineCrashed, NoLaneAvailable):
                await trio.sleep(1.0 + attempt)  # a crashed, restarting or quarantined lane: back off, try again
        else:
            raise AssertionError("never served")
        assert out[0, :2].tolist() == [rows[0].sum(), len(rows[0])]
        sim.check()


async def giving_up_at_once(sim: Simulation) -> None:
    """A caller without retries: under faults, its EngineCrashed escapes, which the simulation reports."""
    for _ in range(6):
        await sim.supervisor.embed_ids([np.arange(1, 4, dtype=np.int32)], model=SIM_MODEL, pooling="mean",
                                       normalize=False)


async def killing_a_worker(sim: Simulation) -> None:
    lane = sim.supervisor.lanes["lane0"]
    sim.kill(lane)
    while lane.generation == 1:  # noqa: ASYNC110 (under the mock clock: no wall time passes)
        await trio.sleep(0.01)
    await lane.wait_state(LaneState.READY)
    sim.check()


SHAPE = WorldShape(lanes=2, strikes=3, fault_rate=0.3)


def test_a_scenario_with_retries_keeps_every_invariant_over_many_seeds() -> None:
    assert search(retrying_embeds, range(40), SHAPE) == []


def test_a_scenario_without_retries_is_caught_and_replays() -> None:
    failing = search(giving_up_at_once, range(20), SHAPE)
    assert failing and all("EngineCrashed" in finding for _, finding in failing)
    seed = failing[0][0]
    assert simulate(giving_up_at_once, seed, SHAPE) == simulate(giving_up_at_once, seed, SHAPE)


def test_a_killed_worker_is_no_healthy_worker_struck() -> None:
    assert simulate(killing_a_worker, 1) == []
