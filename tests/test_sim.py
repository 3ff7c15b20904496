"""The deterministic simulation (trio_gpuworker.testing; the mutations in tests/sim): 2,000 seeded schedules of the
real Supervisor against simulated workers under a mock clock, with every invariant checked before each step and at
the end; each known defect, put back, is caught by a pinned seed; a seed replays exactly. `make sim` runs 10^5
schedules."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.sim.mutations import NAMES, mutated
from trio_gpuworker.testing import Schedule, Step, make_schedule, run_schedule, shrink

SCHEDULES = int(os.environ.get("SIM_SCHEDULES", "2000"))
# a seed that catches each known defect when its fix is undone (found with `python -m tests.sim mutate NAME
# --seeds 0:2000`, PYTHONHASHSEED=0; searched again when the roll-over action joined ACTIONS and redrew them)
CATCHES: dict[str, int | Schedule] = {
    "standby_carries_two": 436,
    "ordered_stop_unanswered": 722,
    "quiesced_ring_waiters_hang": 208,
    "reply_bursts_fault_the_worker": 7,
    "reload_keeps_old_settings": 5,
    "handover_cuts_a_held_batch": 144,
    "cancelled_calls_leave_leases": 60,
    "model_change_outruns_its_requests": 792,
    "uninstall_dropped_with_its_caller": 6730,
    "unsent_install_keeps_its_lease": 34001,
    "faulted_ring_waits_on_us": 46795,
    "quarantine_drops_reload_settings": 56935,
    "changes_of_one_model_overlap": 97922,
    # none of seeds 0..1999 catches it since: the schedule seed 1623 drew before, pinned whole
    "handles_cross_lanes": Schedule(seed=1623, lanes=2, standby=False, strikes=3, fault_rate=0.0, steps=(
        Step(0.001, "kill", 0, 1), Step(0.301, "rerank", 0, 10), Step(4.301, "ring", 0, 1, 0.5),
        Step(4.302, "rerank", 1, 9), Step(4.302, "generate", 1, 5), Step(4.303, "resume", 0, 24),
        Step(8.303, "generate", 0, 3), Step(8.303, "embed", 0, 16, 0.5), Step(9.303, "resume", 1, 5),
        Step(10.303, "stale", 1, 2), Step(10.304, "unload", 1, 2), Step(10.305, "generate", 1, 3, 3.0))),
}


def test_schedules_keep_every_invariant(tmp_path: Path) -> None:
    failing = []
    for seed in range(SCHEDULES):
        found = run_schedule(make_schedule(seed), tmp_path)
        if found:
            failing.append(f"seed {seed}: {found[0][:2000]}\n  replay: python -m tests.sim replay {seed} --shrink")
            if len(failing) >= 3:
                break
    assert not failing, "\n".join(failing)


# seeds the 10^5-schedule `make sim` found failing, each fixed: they stay in the suite
# 94281: a worker hung after filling an egress ring, before its RING_READABLE: the parked puller never drained it,
# so the step looked blocked on us and its watchdog was extended forever (fixed: extending the window wakes it)
# (pinned as the schedule its seed drew before the roll-over action joined ACTIONS, which redrew every seed)
REGRESSIONS: tuple[int | Schedule, ...] = (
    Schedule(seed=94281, lanes=2, standby=False, strikes=3, fault_rate=0.2, steps=(
        Step(0.001, "generate", 1, 22), Step(0.001, "unload", 0, 13), Step(0.301, "embed", 0, 24, 0.5),
        Step(0.302, "generate", 0, 13), Step(0.352, "ring", 1, 19), Step(0.652, "ring", 1, 6, 3.0),
        Step(0.652, "hang", 1, 1))),
)


@pytest.mark.parametrize("seed", REGRESSIONS)
def test_seeds_make_sim_found(tmp_path: Path, seed: int | Schedule) -> None:
    assert run_schedule(seed if isinstance(seed, Schedule) else make_schedule(seed), tmp_path) == []


def test_a_seed_replays_exactly(tmp_path: Path) -> None:
    """The same seed gives the same run: same findings, same generations, under a mutation that fails."""
    schedule = make_schedule(0)
    with mutated("ordered_stop_unanswered"):
        assert run_schedule(schedule, tmp_path) == run_schedule(schedule, tmp_path)


@pytest.mark.parametrize("name", NAMES)
def test_each_known_defect_is_found_again(tmp_path: Path, name: str) -> None:
    """Undo a fix and its pinned seed fails; with the fix it passes (so the simulation has teeth)."""
    seed = CATCHES.get(name)
    if seed is None:
        pytest.fail(f"no seed pinned for {name}")
    schedule = seed if isinstance(seed, Schedule) else make_schedule(seed)
    assert run_schedule(schedule, tmp_path) == []
    with mutated(name):
        found = run_schedule(schedule, tmp_path)
    assert found, f"seed {seed} no longer catches {name}"


def test_a_failing_schedule_shrinks_and_still_fails(tmp_path: Path) -> None:
    seed = CATCHES["ordered_stop_unanswered"]
    assert isinstance(seed, int)
    with mutated("ordered_stop_unanswered"):
        schedule = make_schedule(seed)
        small = shrink(schedule, tmp_path)
        assert len(small.steps) <= len(schedule.steps) and run_schedule(small, tmp_path)


def test_a_run_wedged_past_its_horizon_ends_as_a_finding(tmp_path: Path) -> None:
    """A request that is never answered, awaited under a shield (a batched chunk), outlives the horizon's cancel:
    the run is ended and reported as wedged, in a fraction of a second, instead of polling forever."""
    schedule = make_schedule(722).without([2, 4, 5])  # a hang, a batched generate, an abort
    with mutated("ordered_stop_unanswered"):
        found = run_schedule(schedule, tmp_path)
    assert any("the run wedged" in f and "generate" in f for f in found), found
