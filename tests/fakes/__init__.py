"""Scripted misbehaving workers for supervisor tests; see fake_worker.py for the behaviors.

    LaneConfig(id="embed-0", models=(...,), worker_command=fake_command("crash_mid_request", on_request=2))

The lane appends `--socket PATH --nonce HEX` itself.
"""

from __future__ import annotations

import sys
from pathlib import Path

FAKE_WORKER = Path(__file__).resolve().parent / "fake_worker.py"


OPTIONS = ("on_request", "once_file", "delay", "load_delay", "first_load_delay", "progress_every", "fault_rate",
           "seed", "stream_token_s", "packed", "record_loads")


def fake_command(behavior: str | None = None, **opts: object) -> tuple[str, ...]:
    """`(python, fake_worker.py, --behavior NAME, --on-request N, ...)`; keyword `on_request=2` -> `--on-request 2`.

    Options: on_request, once_file, delay, load_delay, first_load_delay, progress_every, fault_rate, seed,
    stream_token_s, packed, record_loads. None values are left out.
    """
    from .fake_worker import BEHAVIORS

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
