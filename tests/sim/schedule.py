"""Schedules: what happens when, all of it drawn from one seed, so a seed reproduces a run exactly and a failing
schedule can be shrunk by dropping steps and replaying (tests/sim/__main__.py)."""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

from tests.sim.worker import MISBEHAVIOURS, Fate

ACTIONS = {  # action -> weight
    "embed": 10, "rerank": 4, "generate": 4, "ring": 4, "stale": 2, "park": 1,
    "load": 1, "unload": 1, "reload": 2, "drain": 1, "resume": 1,
    "kill": 3, "hang": 2, "abort": 2, "roll": 1,
}


@dataclass(frozen=True)
class Step:
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
    seed: int
    lanes: int  # lanes serving the model (lane0 may keep a warm standby)
    standby: bool
    strikes: int
    fault_rate: float  # chance that a worker generation misbehaves on each serving request
    steps: tuple[Step, ...]

    def without(self, keep: list[int]) -> Schedule:
        return replace(self, steps=tuple(self.steps[i] for i in keep))

    def describe(self) -> str:
        head = (f"seed {self.seed}: {self.lanes} lane(s), standby={self.standby}, strikes={self.strikes}, "
                f"fault_rate={self.fault_rate:g}, {len(self.steps)} steps")
        return "\n".join([head, *(f"  {s}" for s in self.steps)])

    def fate(self, generation: int) -> Fate:
        """What worker generation `generation` will do: drawn from the seed and the number alone, so a step
        dropped while shrinking does not change the other generations' fates."""
        r = random.Random(self.seed * 1_000_003 + generation)
        misbehave = {n: r.choice(MISBEHAVIOURS) for n in range(1, 40) if r.random() < self.fault_rate}
        # drawn from a stream of its own, so the fates drawn before it stay as they were
        burst = random.Random(self.seed * 7_919 + generation).random() < 0.5
        return Fate(misbehave=misbehave, load_s=r.choice((0.01, 0.2, 2.0)), crash_in_load=r.random() < 0.03,
                    slow_s=r.choice((0.5, 30.0)), ignore_sigterm=r.random() < 0.1, burst=burst)


def make_schedule(seed: int, max_steps: int = 14) -> Schedule:
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
