"""The project's own side of the simulation (docs/testing.md, 'The simulated world'): the known defects put back
(mutations.py) and the CLI that runs, replays, shrinks and mutates schedules (`python -m tests.sim --help`). The
world, the schedules and the search are trio_gpuworker.testing's; tests/test_sim.py runs a budget of them in
`make test` and pins the seeds that catch each defect."""
