"""The deterministic simulation of the whole supervisor (docs/architecture.md, 'The lane lifecycle'): the real
Supervisor, lanes, router, batcher
and data plane against simulated protocol-v3 workers in-process, under trio's MockClock, driven by schedules a
seed reproduces. `python -m tests.sim --help` runs, replays and shrinks schedules; tests/test_sim.py runs a
budget of them in `make test`."""
