"""The worker's compute thread says when it is idle: nothing runs there and nothing waits for it. The worker's
event loop then drains CPU ingress rings itself (worker/_server.py) and frees a host echo's consumed inputs
(worker/_dataplane.py), so `idle` must never say yes while a job, queued by `run` or by `submit`, has not
finished, a failed one included."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
import trio

from trio_gpuworker._compute import ComputeThread


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


class _Busy:
    """A compute thread that is never idle: what it is handed is only recorded."""

    idle = False

    def __init__(self) -> None:
        self.submitted: list[Any] = []

    def submit(self, fn: Any) -> None:
        self.submitted.append(fn)


async def test_a_consumed_input_is_freed_at_once_only_while_the_thread_is_idle(compute: ComputeThread) -> None:
    from trio_gpuworker.worker._dataplane import WorkerDataPlane
    from trio_gpuworker.worker._objects import DeviceObject

    plane = WorkerDataPlane(1, lambda msg: None, {}, arena=None)
    freed: list[Any] = []
    free = plane.bridge.free_device
    plane.bridge.free_device = lambda alloc: freed.append(alloc) or free(alloc)
    for handle in (1, 2):
        plane.objects[handle] = DeviceObject(plane.bridge.alloc_device(64), "uint8", (64,), 0, handle)
    binding = lambda h: {"device_handle": {"worker_generation": 1, "id": h}}  # noqa: E731

    busy = _Busy()
    plane._consume([binding(1)], busy)  # the thread may be using the pool: the free waits its turn there
    assert 1 not in plane.objects and freed == [] and len(busy.submitted) == 1
    busy.submitted[0]()
    assert len(freed) == 1

    assert compute.idle
    plane._consume([binding(2)], compute)  # nothing runs there: freed here, now, without a job
    assert 2 not in plane.objects and len(freed) == 2 and compute.idle
