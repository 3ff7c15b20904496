"""What the HTTP routes share: ASGI types, the HTTP layer's own errors and error bodies (every error carries its
status: docs/http-api.md, 'Errors'), streamed and raw results, and the API's changing state the routes read
(`Intake`)."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .._errors import GpuWorkerError
from .http_config import HttpConfig

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
Emit = Callable[[dict[str, Any]], Awaitable[None]]

STATE_POLL_S = 0.5  # a streamed load or reload reports the lane's state on each change, and at least this often
PROGRESS_BUFFER = 64  # PROGRESS events a slow streaming client may lag behind before some are skipped
DRAIN_RETRY_AFTER_S = 5


class HttpError(GpuWorkerError):
    """An error of the HTTP layer itself (no route, no key, a body too slow): its status and code per instance."""

    def __init__(self, status: int, code: str, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.http_status = status
        self.code = code
        self.headers = headers or {}

    @classmethod
    def like(cls, error: type[GpuWorkerError], message: str, headers: dict[str, str]) -> HttpError:
        """`error`'s status and code, with headers of the HTTP layer's own (connection: close)."""
        return cls(error.http_status, error.code, message, headers)

    def http_headers(self) -> dict[str, str]:
        return self.headers


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


@dataclass
class Intake:
    """What the routes read of the API's changing state: the [http] settings (replaced by a configuration reload),
    whether new requests are admitted (not while draining) and whether readiness has failed (SIGTERM)."""

    http: HttpConfig
    admitting: bool = True
    draining: bool = False


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


def error_type(status: int) -> str:
    """OpenAI's error `type` for an HTTP status: the caller's request (4xx) or the server (5xx)."""
    return "invalid_request_error" if status < 500 else "server_error"


def error_body(exc: GpuWorkerError) -> dict[str, Any]:
    """OpenAI's error object: `message`, `type`, `param` and `code` always present (`param` null unless the error
    names a field), and the error's own detail."""
    return {"error": {"type": error_type(exc.http_status), "param": None, **exc.to_wire()}}


@dataclass(frozen=True)
class Route:
    method: str
    pattern: re.Pattern[str]
    label: str  # the route template, a metrics label
    handler: Callable[[dict[str, str], Any], Awaitable[Any]]
    admin: bool = False
    tracked: bool = False  # counted in flight and refused while draining
    # the body's fields (http_fields.Spec), or a function of the body that gives them (a route that takes several
    # bodies: /rerank, TEI's and TGI's `/`); None: no body is read
    fields: Mapping[str, Any] | Callable[[dict[str, Any]], Mapping[str, Any]] | None = None
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
