"""Lane administration behind the admin routes: load, unload, reload, drain, resume.

LOAD and UNLOAD at run time go through `lane.call`, and the lane's `loads` (what a restarted generation
loads) is kept equal to what the worker holds, so a crash after a runtime load reloads the right set.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import trio

from .._errors import LaneNotFound
from .._proto import Progress
from ..supervisor import DigestCache, Lane, LaneState, Supervisor, load_spec

DRAIN_POLL_S = 0.05  # how often drain(wait=True) looks at the lane's queue


class LaneAdmin:
    def __init__(self, sup: Supervisor) -> None:
        self.sup = sup
        self._digests: DigestCache | None = None

    def lane(self, lane_id: str) -> Lane:
        lane = self.sup.lanes.get(lane_id)
        if lane is None:
            raise LaneNotFound(f"no lane {lane_id!r}; lanes: {', '.join(self.sup.lanes) or 'none'}")
        return lane

    @property
    def digests(self) -> DigestCache:
        if self._digests is None:
            self._digests = DigestCache(self.sup.config.state_dir / "digests.json")
        return self._digests

    async def load_model(self, lane_id: str, model: str, *, timeout_s: float | None = None,
                         on_progress: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
        """LOAD `model` on the lane's worker, reporting PROGRESS; later generations load it too."""
        lane = self.lane(lane_id)
        spec = await load_spec(self.sup.config.model(model), self.digests)

        def progress(msg: Progress) -> None:
            if on_progress is not None:
                on_progress({"completed": msg.completed, "phase": msg.phase})

        reply = await lane.load_model(spec, timeout=timeout_s, on_progress=progress)
        return {"lane_id": lane.id, "model": model, "generation": lane.generation, "model_ref": reply.model_ref,
                "dims": reply.dims, "cold_load_ms": reply.cold_load_ms}

    async def unload_model(self, lane_id: str, model: str, *, timeout_s: float | None = None) -> dict[str, Any]:
        """UNLOAD `model`; later generations no longer load it. Lifts the lane's quarantine."""
        lane = self.lane(lane_id)
        await lane.unload_model(model, timeout=timeout_s)
        return {"lane_id": lane.id, "model": model, "generation": lane.generation, "models": list(lane.models_loaded)}

    async def reload(self, lane_id: str, *, timeout_s: float | None = None) -> dict[str, Any]:
        """Ordered restart of the lane's worker after what is queued; lifts quarantine."""
        lane = self.lane(lane_id)
        await self.sup.reload_lane(lane.id, timeout=timeout_s)
        return {"lane_id": lane.id, "generation": lane.generation, "state": lane.state.value,
                "models": list(lane.models_loaded)}

    async def drain(self, lane_id: str, *, wait: bool = False, timeout_s: float | None = None) -> bool:
        """Route no new requests to the lane; with `wait`, until what is queued there has finished.
        Returns whether the lane is idle."""
        lane = self.lane(lane_id)
        self.sup.router.drain(lane.id)
        if wait:
            with trio.move_on_after(timeout_s if timeout_s is not None else float("inf")):
                # the lane signals nothing when its queue empties: look every DRAIN_POLL_S
                while not self.idle(lane):  # noqa: ASYNC110
                    await trio.sleep(DRAIN_POLL_S)
        return self.idle(lane)

    def resume(self, lane_id: str) -> None:
        lane = self.lane(lane_id)
        self.sup.router.resume(lane.id)

    @staticmethod
    def idle(lane: Lane) -> bool:
        return lane.queued == 0 and lane.state != LaneState.BUSY
