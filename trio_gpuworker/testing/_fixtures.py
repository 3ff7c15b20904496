"""A Supervisor with fake lanes, for a test of code that uses one (docs/testing.md, 'A supervisor with fake
lanes')."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import trio

from .. import LaneConfig, ModelConfig, QuarantinePolicy, RestartPolicy, Supervisor, SupervisorConfig, Windows
from ..supervisor import WorkerSpec
from ._launcher import SimLauncher
from ._plan import FaultPlan
from ._simulation import WINDOWS

FAKE_MODEL = "fake"  # the model a fake supervisor's lanes serve


def fake_config(directory: Path, command: tuple[str, ...] | None, *, lanes: int, windows: Windows, strikes: int,
                cooldown_s: float, runtime_dir: Path) -> SupervisorConfig:
    """`lanes` lanes serving FAKE_MODEL (its artifact under `directory`), started with `command`."""
    artifact = directory / "fake.bin"
    artifact.write_bytes(b"fake weights")
    return SupervisorConfig(
        lanes=tuple(LaneConfig(f"lane{i}", (FAKE_MODEL,), worker_command=command) for i in range(lanes)),
        models=(ModelConfig(FAKE_MODEL, artifact, digest="0" * 64),), state_dir=directory / "state",
        runtime_dir=runtime_dir, windows=windows, quarantine=QuarantinePolicy(strikes, cooldown_s),
        restart=RestartPolicy(0.05, 1.0, 2.0), arena_bytes=4 << 20)


@asynccontextmanager
async def fake_supervisor(directory: Path, plan: FaultPlan | Callable[[WorkerSpec], FaultPlan] | None = None, *,
                          lanes: int = 1, processes: bool = False, windows: Windows = WINDOWS, strikes: int = 2,
                          cooldown_s: float = 20.0) -> AsyncIterator[Supervisor]:
    """A running Supervisor whose `lanes` lanes ("lane0", ...) serve FAKE_MODEL with fake engines that follow
    `plan` (a FaultPlan, or one per WorkerSpec; default: healthy). The fakes run in-process, fast and deterministic
    under a mock clock, or, with `processes`, as real processes (then `plan` must be one FaultPlan). Its state goes
    under `directory`."""
    if processes:
        if plan is not None and not isinstance(plan, FaultPlan):
            raise TypeError("fake engine processes take one FaultPlan, not one per worker")
        runtime = Path(tempfile.mkdtemp(prefix="gw-fake-"))  # short: a socket's path must fit in 108 bytes
        try:
            command = (plan or FaultPlan()).command()
            async with Supervisor(fake_config(directory, command, lanes=lanes, windows=windows, strikes=strikes,
                                              cooldown_s=cooldown_s, runtime_dir=runtime)) as sup:
                yield sup
        finally:
            shutil.rmtree(runtime, ignore_errors=True)
        return
    config = fake_config(directory, None, lanes=lanes, windows=windows, strikes=strikes, cooldown_s=cooldown_s,
                         runtime_dir=directory / "run")
    async with trio.open_nursery() as workers:
        async with Supervisor(config, launcher=SimLauncher(workers, plan)) as sup:
            yield sup
        workers.cancel_scope.cancel()  # every worker was shut down with the supervisor: nothing is left to end


__all__ = ["FAKE_MODEL", "fake_config", "fake_supervisor"]
