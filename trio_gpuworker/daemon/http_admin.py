"""The admin routes (served on the Unix socket; on TCP only with http.admin_on_tcp)."""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import trio

from .._api_requests import ApiRequest
from .._errors import GpuWorkerError, InvalidRequest
from ..supervisor import LaneState
from .http_common import (
    PROGRESS_BUFFER,
    STATE_POLL_S,
    Emit,
    HttpError,
    Intake,
    Stream,
    error_body,
)
from .http_state import lane_status

if TYPE_CHECKING:
    from ..supervisor import Supervisor
    from .admin import LaneAdmin


class AdminRoutes:
    def __init__(self, sup: Supervisor, admin: LaneAdmin, intake: Intake,
                 reload_config: Callable[[], Awaitable[dict[str, Any]]] | None) -> None:
        self.sup, self.admin, self.intake, self.reload_config = sup, admin, intake, reload_config

    @property
    def _timeout_s(self) -> float:
        return self.intake.http.request_timeout_s

    @staticmethod
    def _flag(body: dict[str, Any], key: str) -> bool:
        value = body.get(key, False)
        if not isinstance(value, bool):
            raise InvalidRequest(f"'{key}' must be a boolean")
        return value

    async def lane_reload(self, params: dict[str, str], body: dict[str, Any]) -> Any:
        lane = self.admin.lane(params["lane"])
        op = lambda _: self.admin.reload(lane.id, timeout_s=self._timeout_s)  # noqa: E731
        if self._flag(body, "stream"):
            return Stream(lambda emit: self._stream(emit, op, lane.id))
        return 200, await op(None)

    async def lane_load(self, params: dict[str, str], body: dict[str, Any]) -> Any:
        lane, model = self.admin.lane(params["lane"]), ApiRequest.json_model(body, self.sup.config)

        def op(on_progress: Callable[[dict[str, Any]], None] | None) -> Awaitable[dict[str, Any]]:
            return self.admin.load_model(lane.id, model, on_progress=on_progress, timeout_s=self._timeout_s)

        if self._flag(body, "stream"):
            return Stream(lambda emit: self._stream(emit, op, lane.id))
        return 200, await op(None)

    async def lane_unload(self, params: dict[str, str], body: dict[str, Any]) -> tuple[int, Any]:
        lane, model = self.admin.lane(params["lane"]), ApiRequest.json_model(body, self.sup.config)
        return 200, await self.admin.unload_model(lane.id, model, timeout_s=self._timeout_s)

    async def lane_drain(self, params: dict[str, str], body: dict[str, Any]) -> tuple[int, Any]:
        lane = self.admin.lane(params["lane"])
        idle = await self.admin.drain(lane.id, wait=self._flag(body, "wait"), timeout_s=self._timeout_s)
        return 200, {**lane_status(self.sup, self.sup.lane_status(lane)), "idle": idle}

    async def lane_resume(self, params: dict[str, str], _: dict[str, Any]) -> tuple[int, Any]:
        lane = self.admin.lane(params["lane"])
        self.admin.resume(lane.id)
        return 200, lane_status(self.sup, self.sup.lane_status(lane))

    async def config_reload(self, _: dict[str, str], __: dict[str, Any]) -> tuple[int, Any]:
        if self.reload_config is None:
            raise HttpError(404, "not_found", "configuration reload is not available")
        return 200, await self.reload_config()

    async def _stream(self, emit: Emit, op: Callable[[Callable[[dict[str, Any]], None] | None],
                                                     Awaitable[dict[str, Any]]], lane_id: str) -> None:
        """Run `op`, streaming its PROGRESS events and the lane's state changes, then its result or error."""
        send_ch, recv_ch = trio.open_memory_channel[dict[str, Any]](PROGRESS_BUFFER)
        outcome: dict[str, Any] = {}
        t0 = trio.current_time()

        def on_progress(event: dict[str, Any]) -> None:
            # a slow reader skips progress lines, never the result
            with contextlib.suppress(trio.WouldBlock, trio.ClosedResourceError, trio.BrokenResourceError):
                send_ch.send_nowait({"event": "progress", "elapsed_s": round(trio.current_time() - t0, 3), **event})

        last: tuple[str, int] | None = None

        def report_state() -> None:
            nonlocal last
            lane = self.sup.lanes.get(lane_id)
            if lane is not None and (lane.state.value, lane.generation) != last:
                last = (lane.state.value, lane.generation)
                on_progress({"event": "state", "state": lane.state.value, "generation": lane.generation})

        async def run() -> None:
            async with send_ch:
                try:
                    outcome["result"] = await op(on_progress)
                except GpuWorkerError as exc:
                    outcome["error"] = exc
                report_state()  # the state the operation left the lane in, before the result

        async def watch_state() -> None:
            while True:
                report_state()
                lane = self.sup.lanes.get(lane_id)
                if lane is None:
                    return
                with trio.move_on_after(STATE_POLL_S):  # and on any state change, at once
                    await lane.wait_state(*(s for s in LaneState if s is not lane.state))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch_state)
            nursery.start_soon(run)
            async for event in recv_ch:
                await emit(event)
            nursery.cancel_scope.cancel()
        if "error" in outcome:
            await emit({"event": "error", "status": outcome["error"].http_status, **error_body(outcome["error"])})
        else:
            await emit({"event": "done", "result": outcome.get("result")})
