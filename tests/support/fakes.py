"""The project's shorthand for the fake engine process of trio_gpuworker.testing (its flags, in the order given):

    LaneConfig(id="embed-0", models=(...,), worker_command=fake_command("crash_mid_request", on_request=2))

The lane appends `--socket PATH --nonce HEX` itself. A plan as data is `FaultPlan(...).command()`.
"""

from __future__ import annotations

import sys

from trio_gpuworker.testing import FAKE_WORKER, HANDSHAKE_FAULTS, REQUEST_FAULTS

BEHAVIORS = (*HANDSHAKE_FAULTS, "ignore_sigterm", "crash_during_load", *REQUEST_FAULTS)
OPTIONS = ("on_request", "once_file", "delay", "load_delay", "first_load_delay", "progress_every", "fault_rate",
           "seed", "stream_token_s", "packed", "record_loads")


def fake_command(behavior: str | None = None, **opts: object) -> tuple[str, ...]:
    """`(python, _fake_worker.py, --behavior NAME, --on-request N, ...)`; keyword `on_request=2` -> `--on-request 2`.

    Options: on_request, once_file, delay, load_delay, first_load_delay, progress_every, fault_rate, seed,
    stream_token_s, packed, record_loads. None values are left out.
    """
    if behavior is not None and behavior not in BEHAVIORS:
        raise ValueError(f"unknown fake worker behavior {behavior!r}")
    args: list[str] = [sys.executable, str(FAKE_WORKER)]
    if behavior is not None:
        args += ["--behavior", behavior]
    for name, value in opts.items():
        if name not in OPTIONS:
            raise TypeError(f"fake_command() got an unknown option {name!r}")
        if value is not None:
            args += ["--" + name.replace("_", "-"), str(value)]
    return tuple(args)


__all__ = ["FAKE_WORKER", "fake_command"]
