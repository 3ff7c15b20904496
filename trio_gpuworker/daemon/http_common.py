"""What the HTTP routes share: ASGI types, error mapping, streamed and raw results."""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .._errors import (
    ClosedSupervisorError,
    ConfigError,
    DeadlineExceeded,
    EngineCrashed,
    GpuWorkerError,
    InvalidRequest,
    LaneNotFound,
    ModelLoading,
    ModelNotFound,
    NoLaneAvailable,
    OverCapacity,
    RequestTooLarge,
    WorkerError,
)

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
Emit = Callable[[dict[str, Any]], Awaitable[None]]

STATE_POLL_S = 0.5  # a streamed load or reload reports the lane's state on each change, and at least this often
PROGRESS_BUFFER = 64  # PROGRESS events a slow streaming client may lag behind before some are skipped
DRAIN_RETRY_AFTER_S = 5


class HttpError(GpuWorkerError):
    def __init__(self, status: int, code: str, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.headers = headers or {}


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


@dataclass
class Raw:
    status: int
    body: bytes
    content_type: str


@dataclass
class Stream:
    """NDJSON events: `produce(emit)` awaits `emit(event)` for each line."""

    produce: Callable[[Emit], Awaitable[None]]


@dataclass
class EventStream:
    """Server-sent events (OpenAI's streams): `produce(emit)` awaits `emit(event)` for each `data:` event. The
    response starts at the first event; an error raised before it is a plain HTTP error, one after it ends the
    stream with an `error` event. `data: [DONE]` closes it."""

    produce: Callable[[Emit], Awaitable[None]]


# Worker-side ERR codes that mean the caller's input was at fault, and those that mean the model cannot serve.
_CLIENT_WORKER_CODES = {"invalid_request", "grammar_unsupported", "model_not_loaded", "unsupported_request"}
_UNAVAILABLE_WORKER_CODES = {"model_load_failed"}


def error_status(exc: GpuWorkerError) -> tuple[int, dict[str, str]]:
    if isinstance(exc, HttpError):
        return exc.status, exc.headers
    if isinstance(exc, ModelLoading):
        return 503, {"retry-after": str(max(1, math.ceil(exc.retry_after_s)))}
    if isinstance(exc, OverCapacity):
        return 429, {"retry-after": str(max(1, math.ceil(exc.retry_after_s)))}
    if isinstance(exc, EngineCrashed):
        if exc.quarantined:
            return 503, {"retry-after": str(max(1, math.ceil(exc.cooldown_remaining_s or 0)))}
        return 503, {}
    if isinstance(exc, DeadlineExceeded):
        return 504, {}
    if isinstance(exc, RequestTooLarge):
        return 413, {}
    if isinstance(exc, InvalidRequest | ConfigError):
        return 400, {}
    if isinstance(exc, ModelNotFound | LaneNotFound):
        return 404, {}
    if isinstance(exc, ClosedSupervisorError | NoLaneAvailable):
        return 503, {}
    if isinstance(exc, WorkerError):
        if exc.code in _UNAVAILABLE_WORKER_CODES:
            return 503, {}
        return (400 if exc.code in _CLIENT_WORKER_CODES else 502), {}
    return 500, {}


def error_body(exc: GpuWorkerError) -> dict[str, Any]:
    return {"error": {**exc.to_wire(), "code": getattr(exc, "code", "internal")}}


@dataclass(frozen=True)
class Route:
    method: str
    pattern: re.Pattern[str]
    label: str  # the route template, a metrics label
    handler: Callable[[dict[str, str], Any], Awaitable[Any]]
    admin: bool = False
    tracked: bool = False  # counted in flight and refused while draining
    fields: Mapping[str, Any] | None = None  # the body's fields (http_fields.Spec); None: no body is read
    query: tuple[str, ...] = ()  # the query parameters it takes




async def send_events(send: Send, result: EventStream) -> int:
    """An EventStream's answer: `data: <json>` events, `data: [DONE]` last."""
    started = False

    async def emit(event: dict[str, Any]) -> None:
        nonlocal started
        if not started:
            started = True
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]})
        data = b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n"
        await send({"type": "http.response.body", "body": data, "more_body": True})

    try:
        await result.produce(emit)
    except GpuWorkerError as exc:
        if not started:
            raise
        logging.getLogger("trio_gpuworker.http").warning("a stream failed after it began: %s", exc)
        await emit(error_body(exc))
    await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})
    return 200
