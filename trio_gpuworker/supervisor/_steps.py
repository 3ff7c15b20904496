"""Roles, steps and device handles on the daemon's side of the data plane (docs/architecture.md, 'Device handles, roles
and steps').

A device handle is `{worker_generation, id}`, minted by one worker generation for one loaded object. The daemon
keeps every handle its workers reported (OBJECTS_LOADED) until it is released, consumed by a step, or its
generation is reaped, and refuses any other before a byte is sent: a handle of another lane, of a dead worker, of
an earlier supervisor in this process, or one already released. The worker checks the generation again on its
side. Generations are numbered across a supervisor's lanes, so the two checks together are the full identity.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from .. import _proto as wire  # its StepFailed is the reply; _errors' the exception
from .._errors import StaleHandle, StepFailed
from .._proto import ConfigureRole, ExecuteStep, ReleaseDeviceObject, ReleaseFailed, RoleFailed

if TYPE_CHECKING:
    from ._lane import Lane
    from ._ringend import RingEnd


class HandleRegistry:
    def __init__(self) -> None:
        self._live: dict[tuple[str, int], set[int]] = {}  # (lane id, generation) -> live handle ids

    def minted(self, lane: Lane, generation: int, ids: Iterable[int]) -> None:
        self._live.setdefault((lane.id, generation), set()).update(ids)

    def check(self, lane: Lane, handle: dict[str, int], code: str) -> None:
        """StaleHandle (`code`) unless `handle` is live on the generation `lane` runs now."""
        gen = handle.get("worker_generation")
        if gen != lane.generation:
            raise StaleHandle(code, f"device handle {handle} is from another worker generation (lane {lane.id} runs "
                                    f"generation {lane.generation})")
        if handle.get("id") not in self._live.get((lane.id, gen), ()):
            raise StaleHandle(code, f"device handle {handle} is not a live object of lane {lane.id}")

    def consumed(self, lane: Lane, handle: dict[str, int]) -> None:
        self._live.get((lane.id, handle["worker_generation"]), set()).discard(handle["id"])

    def generation_gone(self, lane: Lane, generation: int) -> None:
        self._live.pop((lane.id, generation), None)

    def count(self) -> int:
        return sum(len(ids) for ids in self._live.values())


class Steps:
    def __init__(self) -> None:
        self.handles = HandleRegistry()

    async def configure_role(self, lane: Lane, role_id: str, config: dict[str, Any]) -> None:
        reply = await lane.call(ConfigureRole(role_id=role_id, config=config), generation=lane.generation)
        if isinstance(reply, RoleFailed):
            raise StepFailed(reply.reason, reply.msg or "role refused")

    async def execute(self, lane: Lane, role_id: str, step_id: int, inputs: list[dict[str, Any]],
                      outputs: list[dict[str, Any]], ends: list[RingEnd], *, runtime: dict[str, Any] | None,
                      release_inputs_after: bool, timeout: float | None) -> list[dict[str, Any]]:
        for binding in inputs:
            self.handles.check(lane, binding["device_handle"], "invalid_input_handle")
        generation = lane.generation  # the inputs' (checked): a later generation must never get this step

        written = settled = False

        def started() -> None:
            """Once the step is written the worker frees its inputs (`release_inputs_after`), whether it succeeds
            or not, and whether or not its caller waits for the answer."""
            nonlocal written
            written = True
            if release_inputs_after:
                for binding in inputs:
                    self.handles.consumed(lane, binding["device_handle"])

        def done() -> None:
            """The step holds its output rings until the lane is done with it, not until its caller leaves: an
            abandoned step still blocked on a ring is waiting on us (its watchdog extends), and uninstalling that
            ring must reach the worker past it."""
            nonlocal settled
            if not settled:
                settled = True
                for end in ends:
                    end.steps -= 1

        for end in ends:
            end.steps += 1
        try:
            reply, produced = await lane.call_gathering(
                ExecuteStep(role_id=role_id, step_id=step_id, inputs=inputs,
                            outputs=[{"flags": 0, **o} for o in outputs], runtime=runtime or {},
                            release_inputs_after=release_inputs_after), timeout=timeout, generation=generation,
                on_started=started, on_settled=done)
        finally:
            if not written:  # never sent, and now never will be (a caller that left drops its queued request)
                done()
        if isinstance(reply, wire.StepFailed):
            raise StepFailed(reply.reason, reply.msg or "step failed")
        return [{"t": m.T, **m.to_fields()} for m in produced]

    async def release(self, lane: Lane, handle: dict[str, int], timeout: float | None = None) -> None:
        """Free one device object. Once the request is written the worker frees it, so the handle is no longer
        live from then on, whether or not its caller waits for the answer."""
        self.handles.check(lane, handle, "invalid_device_handle")
        reply = await lane.call(ReleaseDeviceObject(device_handle=handle), timeout=timeout,
                                generation=handle["worker_generation"],
                                on_started=lambda: self.handles.consumed(lane, handle))
        if isinstance(reply, ReleaseFailed):
            raise StepFailed(reply.reason, reply.msg or "release failed")
