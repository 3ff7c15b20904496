"""The caller's side of a lane: its queue of jobs, its state, and quarantine as callers meet it. Callers
never touch a worker: the lane task takes their jobs one at a time (`Lane` in _lane.py)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import trio

from .._errors import ClosedSupervisorError, DeadlineExceeded, EngineCrashed, GpuWorkerError
from .._proto import Message, StrikePolicy
from ._jobs import RELOAD, Job, LaneState


class LaneQueue:
    def __init__(self, lane_id: str, policy: StrikePolicy) -> None:
        self.id = lane_id
        self.policy = policy
        self.generation = 0  # the active worker's
        self.queued = 0
        self._state = LaneState.STARTING
        self._state_changed = trio.Event()
        self._closing = False
        self._closed = trio.Event()
        self._wakeup = trio.Event()
        self._jobs_send, self._jobs_recv = trio.open_memory_channel[Job](math.inf)

    @property
    def state(self) -> LaneState:
        return self._state

    @state.setter
    def state(self, value: LaneState) -> None:
        if value is not self._state:
            self._state = value
            self._state_changed.set()
            self._state_changed = trio.Event()

    @property
    def closing(self) -> bool:
        return self._closing

    async def wait_state(self, *states: LaneState) -> None:
        """Until the lane is in one of `states` (health probes, tests)."""
        while self._state not in states:
            await self._state_changed.wait()

    # --- caller side ---------------------------------------------------------------------------

    def cooldown_remaining(self) -> float | None:
        return self.policy.cooldown_remaining(trio.current_time())

    def quarantine_error(self, remaining: float) -> EngineCrashed:
        return EngineCrashed(
            f"lane {self.id} is quarantined after {self.policy.max_strikes} consecutive faults; "
            f"retry in {remaining:.0f} s", lane_id=self.id, generation=self.generation,
            cause=self.policy.last_fault.value if self.policy.last_fault else "crash",
            quarantined=True, cooldown_remaining_s=round(remaining, 3))

    async def call(self, t: str, fields: dict[str, Any], raw: bytes | None = None, *, timeout: float | None = None,
                   on_progress: Callable[[Message], None] | None = None,
                   on_settled: Callable[[], None] | None = None) -> Message:
        """Run one request on this lane's worker. The lane, not the caller, owns the stream: a caller
        that gives up (deadline or cancellation) leaves the reply to be drained by the lane.
        `on_settled()` runs once the lane is done with the request (or at once if it is refused here)."""
        job = Job(t, fields, raw, on_progress, on_settled=on_settled)
        if self._closing:
            job.finish(error=ClosedSupervisorError(f"lane {self.id} is shutting down"))
        elif (remaining := self.cooldown_remaining()) is not None:
            job.finish(error=self.quarantine_error(remaining))
        if job.error is not None:
            raise job.error
        self._enqueue(job)
        try:
            with trio.move_on_after(math.inf if timeout is None else timeout):
                await job.done.wait()
        finally:
            if not job.done.is_set():
                job.abandoned = True
        if not job.done.is_set():
            raise DeadlineExceeded(f"{t} on lane {self.id} did not finish within {timeout:g} s")
        if job.error is not None:
            raise job.error
        assert job.result is not None
        return job.result

    async def reload(self, timeout: float | None = None) -> None:
        """Restart the worker in order (no strike) after the requests queued before this one; lifts quarantine.
        Returns once the new generation has loaded its models."""
        if self._closing:
            raise ClosedSupervisorError(f"lane {self.id} is shutting down")
        self.clear_quarantine()
        job = Job(RELOAD, {"generation": self.generation}, None)
        self._enqueue(job)
        with trio.move_on_after(math.inf if timeout is None else timeout):
            await job.done.wait()
        if not job.done.is_set():
            raise DeadlineExceeded(f"reload of lane {self.id} did not finish within {timeout:g} s")
        if job.error is not None:
            raise job.error

    def _enqueue(self, job: Job) -> None:
        self.queued += 1
        self._jobs_send.send_nowait(job)
        self._wakeup.set()

    def clear_quarantine(self) -> None:
        """Unload/reload of the lane lifts quarantine at once."""
        self.policy.clear()
        self._wakeup.set()

    def close(self) -> None:
        """Stop admitting; jobs already queued are still served, then the worker is shut down."""
        self._closing = True
        self._closed.set()
        self._jobs_send.close()
        self._wakeup.set()

    def _fail_queued(self, error: GpuWorkerError) -> None:
        while True:
            try:
                job = self._jobs_recv.receive_nowait()
            except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
                break
            self.queued -= 1
            job.finish(error=error)
