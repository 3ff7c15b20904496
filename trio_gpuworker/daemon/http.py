"""The HTTP API as a plain ASGI app (served by hypercorn on trio)."""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Awaitable, Callable
from typing import Any

from .._errors import (
    ClosedSupervisorError,
    DeadlineExceeded,
    EngineCrashed,
    GpuWorkerError,
    InvalidRequest,
    ModelNotFound,
    NoLaneAvailable,
    WorkerError,
)
from ..supervisor import LaneState, Supervisor
from .config import HttpConfig

log = logging.getLogger("trio_gpuworker.http")

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


class HttpError(GpuWorkerError):
    def __init__(self, status: int, code: str, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.headers = headers or {}


# Worker-side ERR codes that mean the caller's input was at fault.
_CLIENT_WORKER_CODES = {"invalid_request", "grammar_unsupported", "model_not_loaded"}


def error_status(exc: GpuWorkerError) -> tuple[int, dict[str, str]]:
    if isinstance(exc, HttpError):
        return exc.status, exc.headers
    if isinstance(exc, EngineCrashed):
        if exc.quarantined:
            return 503, {"retry-after": str(max(1, math.ceil(exc.cooldown_remaining_s or 0)))}
        return 503, {}
    if isinstance(exc, DeadlineExceeded):
        return 504, {}
    if isinstance(exc, InvalidRequest):
        return 400, {}
    if isinstance(exc, ModelNotFound):
        return 404, {}
    if isinstance(exc, ClosedSupervisorError | NoLaneAvailable):
        return 503, {}
    if isinstance(exc, WorkerError):
        return (400 if exc.code in _CLIENT_WORKER_CODES else 502), {}
    return 500, {}


class Api:
    def __init__(self, sup: Supervisor, http: HttpConfig) -> None:
        self.sup = sup
        self.http = http
        self.routes: dict[tuple[str, str], Callable[[dict[str, Any] | None], Awaitable[tuple[int, Any]]]] = {
            ("GET", "/healthz"): self.healthz,
            ("GET", "/v1/lanes"): self.lanes,
            ("GET", "/v1/models"): self.models,
            ("POST", "/v1/embeddings"): self.embeddings,
        }

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        if scope["type"] != "http":
            return
        t0 = time.perf_counter()
        method, path = scope["method"], scope["path"]
        try:
            handler = self.routes.get((method, path))
            if handler is None:
                if any(p == path for _, p in self.routes):
                    raise HttpError(405, "method_not_allowed", f"{method} is not allowed on {path}")
                raise HttpError(404, "not_found", f"no route {path}")
            body = await self._json_body(receive) if method == "POST" else None
            status, payload = await handler(body)
            headers: dict[str, str] = {}
        except GpuWorkerError as exc:
            status, headers = error_status(exc)
            payload = {"error": {**exc.to_wire(), "code": getattr(exc, "code", "internal")}}
            if status >= 500:
                log.warning("%s %s -> %d %s", method, path, status, exc)
        except Exception as exc:  # the daemon must answer, whatever broke
            log.exception("%s %s failed", method, path)
            status, headers = 500, {}
            payload = {"error": {"code": "internal", "message": f"{type(exc).__name__}: {exc}"}}
        await self._respond(send, status, payload, headers)
        log.debug("%s %s %d %.1f ms", method, path, status, (time.perf_counter() - t0) * 1000)

    async def _json_body(self, receive: Receive) -> dict[str, Any]:
        chunks: list[bytes] = []
        size = 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                raise HttpError(400, "client_disconnected", "client went away")
            chunk = msg.get("body", b"")
            size += len(chunk)
            if size > self.http.max_body_bytes:
                raise HttpError(413, "request_too_large", f"request body exceeds {self.http.max_body_bytes} bytes")
            chunks.append(chunk)
            if not msg.get("more_body"):
                break
        try:
            body = json.loads(b"".join(chunks))
        except (ValueError, UnicodeDecodeError) as exc:
            raise HttpError(400, "invalid_json", f"request body is not valid JSON: {exc}") from exc
        if not isinstance(body, dict):
            raise HttpError(400, "invalid_request", "request body must be a JSON object")
        return body

    @staticmethod
    async def _respond(send: Send, status: int, payload: Any, headers: dict[str, str]) -> None:
        body = json.dumps(payload, separators=(",", ":")).encode()
        hdrs = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        hdrs += [(k.encode(), v.encode()) for k, v in headers.items()]
        await send({"type": "http.response.start", "status": status, "headers": hdrs})
        await send({"type": "http.response.body", "body": body})

    # --- routes --------------------------------------------------------------------------------

    async def healthz(self, _: Any) -> tuple[int, Any]:
        """Cached lane state only: never waits on a worker."""
        lanes = [{k: s[k] for k in ("lane_id", "state", "pid", "generation", "strikes", "cooldown_remaining_s")}
                 for s in self.sup.status()]
        serving = any(ln["state"] in (LaneState.READY.value, LaneState.BUSY.value) for ln in lanes)
        healthy = all(ln["state"] in (LaneState.READY.value, LaneState.BUSY.value) for ln in lanes)
        return (200 if serving else 503), {"status": "ok" if healthy else "degraded" if serving else "unavailable",
                                           "lanes": lanes}

    async def lanes(self, _: Any) -> tuple[int, Any]:
        return 200, {"object": "list", "data": self.sup.status()}

    async def models(self, _: Any) -> tuple[int, Any]:
        data = [{"id": m.id, "object": "model", "owned_by": "trio-gpuworker", "kind": m.kind,
                 "lanes": [ln.id for ln in self.sup.lanes.values() if m.id in ln.loads]}
                for m in self.sup.config.models]
        return 200, {"object": "list", "data": data}

    async def embeddings(self, body: dict[str, Any]) -> tuple[int, Any]:
        model = body.get("model")
        if not isinstance(model, str):
            raise InvalidRequest("'model' must be a string")
        inputs = body.get("input")
        if isinstance(inputs, str):
            inputs = [inputs]
        if not isinstance(inputs, list) or not inputs or not all(isinstance(x, str) for x in inputs):
            raise InvalidRequest("'input' must be a string or a non-empty list of strings")
        if len(inputs) > self.http.max_inputs:
            raise InvalidRequest(f"'input' has {len(inputs)} items; at most {self.http.max_inputs} per request")
        fmt = body.get("encoding_format", "float")
        if fmt != "float":
            raise InvalidRequest("only encoding_format 'float' is supported")
        mc = self.sup.model_config(model)
        if mc.kind != "embedding":
            raise InvalidRequest(f"model {model!r} serves {mc.kind}, not embeddings")
        rows = await self.sup.tokenize_async(inputs, model=model)
        vecs = await self.sup.embed_rows(rows, model=model, pooling=mc.pooling, normalize=mc.normalize,
                                        timeout=self.http.request_timeout_s)
        n_tokens = sum(len(r) for r in rows)
        return 200, {
            "object": "list",
            "model": model,
            "data": [{"object": "embedding", "index": i, "embedding": v.tolist()} for i, v in enumerate(vecs)],
            "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens},
        }
