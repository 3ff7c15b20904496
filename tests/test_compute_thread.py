"""The worker's compute thread says when it is idle: nothing runs there and nothing waits for it. The worker's
event loop then drains CPU ingress rings itself (worker/_server.py), so `idle` must never say yes while a job,
queued by `run` or by `submit`, has not finished, a failed one included."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import trio

from trio_gpuworker.worker._compute import ComputeThread


@pytest.fixture
def compute() -> Iterator[ComputeThread]:
    thread = ComputeThread("test-compute")
    yield thread
    thread.close()


async def test_idle_only_once_every_job_has_run(compute: ComputeThread) -> None:
    assert compute.idle
    gate, ran = threading.Event(), []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(compute.run, lambda: gate.wait(10) and ran.append("run"))
        await trio.sleep(0.05)
        assert not compute.idle  # running
        compute.submit(lambda: ran.append("submitted"))
        gate.set()
    # `run` returned, so its job finished; the submitted one is behind it in the queue
    await compute.run(lambda: None)
    assert ran == ["run", "submitted"]
    assert compute.idle


async def test_a_queued_job_is_not_idle_before_it_runs(compute: ComputeThread) -> None:
    gate = threading.Event()
    compute.submit(lambda: gate.wait(10))
    compute.submit(lambda: None)  # queued behind the blocked one
    assert not compute.idle
    gate.set()
    await compute.run(lambda: None)
    assert compute.idle


async def test_a_failed_job_still_counts_as_finished(compute: ComputeThread) -> None:
    def fail() -> None:
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        await compute.run(fail)
    compute.submit(fail)  # its failure is dropped; the thread goes on
    await compute.run(lambda: None)
    assert compute.idle
