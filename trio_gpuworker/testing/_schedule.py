"""Schedules: what happens when, all of it drawn from one seed, so a seed reproduces a run exactly and a failing
schedule can be shrunk by dropping steps and replaying (docs/testing.md, 'The simulated world'). The worker
generations' fault plans are drawn from the seed too."""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

from ._plan import EVERY, FaultPlan

# what a drawn plan's serving request may do instead of its normal answer, in the order a seed draws them; each must
# end in a typed error at the caller, never a hang
DRAWN_FAULTS = ("crash_mid_request", "crash_between_header_and_raw", "hang_silent", "hang_after_progress", "garbage",
                "wrong_req_id", "regressing_progress", "exit_after_reply", "stop_reading", "slow")
ACTIONS = {  # action -> weight
    "embed": 10, "rerank": 4, "generate": 4, "ring": 4, "stale": 2, "park": 1,
    "load": 1, "unload": 1, "reload": 2, "drain": 1, "resume": 1,
    "kill": 3, "hang": 2, "abort": 2, "roll": 1,
}


@dataclass(frozen=True)
class Step:
    """One thing a schedule does: `action` (one of ACTIONS) on lane `lane` at `at` simulated seconds."""

    at: float  # simulated seconds from the start
    action: str
    lane: int = 0
    arg: int = 0  # rows / documents / tokens / bytes, or which worker (0 active, 1 standby)
    timeout: float | None = None  # the caller's deadline

    def __str__(self) -> str:
        deadline = f" timeout={self.timeout:g}" if self.timeout is not None else ""
        return f"t={self.at:7.3f}  {self.action:<8} lane{self.lane} arg={self.arg}{deadline}"


@dataclass(frozen=True)
class Schedule:
    """A seed's world (its lanes, standby, strikes, fault rate) and its steps; `make_schedule(seed)` draws one."""

    seed: int
    lanes: int  # lanes serving the model (lane0 may keep a warm standby)
    standby: bool
    strikes: int
    fault_rate: float  # chance that a worker generation misbehaves on each serving request
    steps: tuple[Step, ...]

    def without(self, keep: list[int]) -> Schedule:
        """This schedule with only the steps numbered in `keep`."""
        return replace(self, steps=tuple(self.steps[i] for i in keep))

    def describe(self) -> str:
        """The schedule in words, a step a line."""
        head = (f"seed {self.seed}: {self.lanes} lane(s), standby={self.standby}, strikes={self.strikes}, "
                f"fault_rate={self.fault_rate:g}, {len(self.steps)} steps")
        return "\n".join([head, *(f"  {s}" for s in self.steps)])

    def plan(self, generation: int) -> FaultPlan:
        """What worker generation `generation` will do (`drawn_plan`)."""
        return drawn_plan(self.seed, self.fault_rate, generation)


def drawn_plan(seed: int, fault_rate: float, generation: int) -> FaultPlan:
    """What worker generation `generation` of a simulation with this seed will do: drawn from the seed and the number
    alone, so a step dropped while shrinking does not change the other generations' plans."""
    r = random.Random(seed * 1_000_003 + generation)
    faults = {n: r.choice(DRAWN_FAULTS) for n in range(1, 40) if r.random() < fault_rate}
    # drawn from a stream of its own, so the plans drawn before it stay as they were
    burst = random.Random(seed * 7_919 + generation).random() < 0.5
    return FaultPlan(faults=faults, load_s=r.choice((0.01, 0.2, 2.0)),
                     crash_in_load=EVERY if r.random() < 0.03 else None, slow_s=r.choice((0.5, 30.0)),
                     ignore_sigterm=r.random() < 0.1, burst=burst)


def make_schedule(seed: int, max_steps: int = 14) -> Schedule:
    """The schedule seed `seed` draws: its world and up to `max_steps` steps."""
    r = random.Random(seed)
    names, weights = list(ACTIONS), list(ACTIONS.values())
    steps, at = [], 0.0
    for _ in range(r.randint(1, max_steps)):
        at += r.choice((0.0, 0.001, 0.05, 0.3, 1.0, 4.0))
        action = r.choices(names, weights)[0]
        arg = r.randint(0, 1) if action in ("kill", "hang") else r.randint(1, 24)
        timeout = r.choice((0.01, 0.5, 3.0)) if action in ("embed", "rerank", "generate", "reload", "ring", "roll") \
            and r.random() < 0.3 else None
        steps.append(Step(round(at, 3), action, r.randint(0, 1), arg, timeout))
    return Schedule(seed, lanes=r.choice((1, 2)), standby=r.random() < 0.5, strikes=r.choice((1, 2, 3)),
                    fault_rate=r.choice((0.0, 0.05, 0.2)), steps=tuple(steps))


__all__ = ["ACTIONS", "DRAWN_FAULTS", "Schedule", "Step", "drawn_plan", "make_schedule"]
