"""pytest fixtures for the tests of a program built on trio-gpuworker (docs/testing.md, 'pytest fixtures'). Load
them with `pytest_plugins = ["trio_gpuworker.testing.pytest_plugin"]` in the top-level conftest.py; the async tests
that use them run under pytest-trio."""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from pathlib import Path

import pytest
import trio.testing

from .. import Supervisor
from ._fixtures import fake_supervisor as _fake_supervisor


@pytest.fixture
def sim_clock() -> trio.testing.MockClock:
    """trio's MockClock with autojump: whenever every task waits, time jumps to the next deadline, so a watchdog
    window or a restart backoff takes no wall time. pytest-trio runs a test under it when the test asks for it."""
    return trio.testing.MockClock(autojump_threshold=0)


@pytest.fixture
def fake_supervisor(tmp_path: Path) -> Callable[..., AbstractAsyncContextManager[Supervisor]]:
    """`async with fake_supervisor(plan, lanes=1, processes=False) as sup:` a running Supervisor whose lanes serve
    the model "fake" with fake engines following `plan` (trio_gpuworker.testing.fake_supervisor), under tmp_path."""
    return functools.partial(_fake_supervisor, tmp_path)


__all__ = ["fake_supervisor", "sim_clock"]
