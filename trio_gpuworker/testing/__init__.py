"""Test what you build on trio-gpuworker against engines that fail on purpose (docs/testing.md).

- Fault plans as data: `FaultPlan` says what a fake engine does wrong and when (crash, hang, garbage, a stopped
  reader, a flood, a slow LOAD, random faults with a seed). `FaultPlan.command()` runs it as a real process (a lane's
  `worker_command`); `SimLauncher` runs it in-process, under a mock clock.
- `fake_supervisor`: a running Supervisor whose lanes serve the model FAKE_MODEL with such fakes.
- The simulated world: `simulate` runs a scenario of your own against the real Supervisor on in-process fakes whose
  plans are drawn from a seed, with its invariants checked (`Simulation.check`); `search` runs it over thousands of
  seeds. Schedules (`make_schedule`, `run_schedule`, `search_schedules`, `shrink`) are the project's own scenarios.
- pytest fixtures: `pytest_plugins = ["trio_gpuworker.testing.pytest_plugin"]` (`fake_supervisor`, `sim_clock`).
"""

from ._fixtures import FAKE_MODEL, fake_supervisor
from ._launcher import SimLauncher, SimProc
from ._plan import EVERY, FAKE_WORKER, HANDSHAKE_FAULTS, RANDOM_FAULTS, REQUEST_FAULTS, FaultPlan
from ._schedule import Schedule, Step, make_schedule
from ._search import search, search_schedules, shrink
from ._simulation import MODEL as SIM_MODEL
from ._simulation import Simulation, WorldShape, simulate
from ._world import run_schedule

__all__ = [
    "EVERY",
    "FAKE_MODEL",
    "FAKE_WORKER",
    "HANDSHAKE_FAULTS",
    "RANDOM_FAULTS",
    "REQUEST_FAULTS",
    "SIM_MODEL",
    "FaultPlan",
    "Schedule",
    "SimLauncher",
    "SimProc",
    "Simulation",
    "Step",
    "WorldShape",
    "fake_supervisor",
    "make_schedule",
    "run_schedule",
    "search",
    "search_schedules",
    "shrink",
    "simulate",
]
