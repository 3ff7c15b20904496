"""The HTTP API as a plain ASGI app (served by hypercorn on trio).

One `Api` serves every listener; `api.listener(admin=True)` is the app for the Unix socket, where the admin
routes live (on TCP only with http.admin_on_tcp). Errors are JSON bodies `{"error": {"code", "message",
"detail"?}}` whose `code` is stable. A request whose client disconnects is cancelled, so its work is dropped
before it reaches a worker if it has not yet.
"""

from __future__ import annotations

import base64
import json
import logging
import math
import re
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import trio

from .._errors import (
    GpuWorkerError,
    InvalidRequest,
)
from ..supervisor import LaneState, Supervisor
from ..supervisor._admission import Scheduler
from .admin import LaneAdmin
from .config import HttpConfig
from .http_admin import AdminRoutes
from .http_common import (
    DRAIN_RETRY_AFTER_S,
    MAX_GEN_TOKENS,
    ClientGone,
    HttpError,
    Raw,
    Receive,
    Route,
    Scope,
    Send,
    Stream,
    error_body,
    error_status,
)

if TYPE_CHECKING:
    from .metrics import Metrics

log = logging.getLogger("trio_gpuworker.http")


class Api(AdminRoutes):
    def __init__(self, sup: Supervisor, http: HttpConfig, *, scheduler: Scheduler | None = None,
                 metrics: Metrics | None = None,
                 reload_config: Callable[[], Awaitable[dict[str, Any]]] | None = None) -> None:
        self.sup = sup
        self.http = http
        self.scheduler = scheduler if scheduler is not None else sup.scheduler
        self.metrics = metrics
        self.admin = LaneAdmin(sup, self.scheduler)
        self.reload_config = reload_config
        self.admitting = True
        self.inflight = 0
        self.served = 0
        self._idle = trio.Event()
        self._idle.set()
        lane = r"(?P<lane>[A-Za-z0-9_-]+)"
        table: list[tuple[str, str, Callable[..., Awaitable[Any]], bool, bool]] = [
            ("GET", "/healthz", self.healthz, False, False),
            ("GET", "/metrics", self.prometheus, False, False),
            ("GET", "/v1/models", self.models, False, False),
            ("GET", "/v1/lanes", self.lanes, False, False),
            ("GET", "/v1/lanes/{lane}", self.lane, False, False),
            ("POST", "/v1/embeddings", self.embeddings, False, True),
            ("POST", "/v1/rerank", self.rerank, False, True),
            ("POST", "/v1/completions", self.completions, False, True),
            ("POST", "/v1/chat/completions", self.chat_completions, False, True),
            ("POST", "/v1/lanes/{lane}/reload", self.lane_reload, True, True),
            ("POST", "/v1/lanes/{lane}/drain", self.lane_drain, True, True),
            ("POST", "/v1/lanes/{lane}/resume", self.lane_resume, True, True),
            ("POST", "/v1/lanes/{lane}/load", self.lane_load, True, True),
            ("POST", "/v1/lanes/{lane}/unload", self.lane_unload, True, True),
            ("POST", "/v1/config/reload", self.config_reload, True, True),
        ]
        self.routes = [Route(m, re.compile("^" + p.replace("{lane}", lane) + "$"), p, h, admin, tracked)
                       for m, p, h, admin, tracked in table]

    # --- ASGI ----------------------------------------------------------------------------------

    def listener(self, *, admin: bool) -> Callable[[Scope, Receive, Send], Awaitable[None]]:
        async def app(scope: Scope, receive: Receive, send: Send) -> None:
            await self.handle(scope, receive, send, admin=admin)

        return app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.handle(scope, receive, send, admin=True)

    async def wait_idle(self) -> None:
        await self._idle.wait()

    def _enter(self) -> None:
        self.inflight += 1
        if self._idle.is_set():
            self._idle = trio.Event()

    def _exit(self) -> None:
        self.inflight -= 1
        self.served += 1
        if self.inflight == 0:
            self._idle.set()

    def _match(self, method: str, path: str) -> tuple[Route, dict[str, str]]:
        allowed = False
        for route in self.routes:
            m = route.pattern.match(path)
            if m is None:
                continue
            if route.method == method:
                return route, m.groupdict()
            allowed = True
        if allowed:
            raise HttpError(405, "method_not_allowed", f"{method} is not allowed on {path}")
        raise HttpError(404, "not_found", f"no route {path}")

    def _model_label(self, body: Any) -> str:
        model = body.get("model") if isinstance(body, dict) else None
        if model is None:
            return ""
        return model if any(m.id == model for m in self.sup.config.models) else "unknown"

    async def handle(self, scope: Scope, receive: Receive, send: Send, *, admin: bool) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        if scope["type"] != "http":
            return
        t0 = time.perf_counter()
        method, path = scope["method"], scope["path"]
        label, model, outcome, tracked = "other", "", "ok", False
        started = False
        server_send = send

        async def send_once(message: dict[str, Any]) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                if started:  # a failure after the answer began (a stream): it ends the stream, nothing more
                    return
                started = True
            await server_send(message)

        send = send_once
        try:
            route, params = self._match(method, path)
            label = route.label
            if route.admin and not (admin or self.http.admin_on_tcp):
                raise HttpError(403, "admin_only", f"{route.label} is served on the Unix socket only "
                                                   "(http.admin_on_tcp)")
            if route.tracked and not self.admitting:
                raise HttpError(503, "shutting_down", "gpuworkerd is draining; no new requests are admitted",
                                {"retry-after": str(DRAIN_RETRY_AFTER_S), "connection": "close"})
            body = await self._json_body(receive) if method == "POST" else None
            model = self._model_label(body)
            if route.tracked:
                self._enter()
                tracked = True
            status = await self._run(route, params, body, receive, send)
            outcome = "ok" if status < 400 else str(status)
        except ClientGone:
            outcome = "client_gone"
        except GpuWorkerError as exc:
            status, headers = error_status(exc)
            outcome = getattr(exc, "code", "internal")
            if status >= 500:
                log.warning("%s %s -> %d %s", method, path, status, exc)
            await self._respond(send, status, error_body(exc), headers)
        except Exception as exc:  # the daemon must answer, whatever broke
            log.exception("%s %s failed", method, path)
            outcome = "internal"
            await self._respond(send, 500, {"error": {"code": "internal", "message": f"{type(exc).__name__}: {exc}"}},
                                {})
        finally:
            if tracked:
                self._exit()
        if self.metrics is not None:
            self.metrics.observe(label, model, outcome, time.perf_counter() - t0)
        log.debug("%s %s %s %.1f ms", method, path, outcome, (time.perf_counter() - t0) * 1000)

    async def _run(self, route: Route, params: dict[str, str], body: Any, receive: Receive, send: Send) -> int:
        """Run the handler and send its answer while watching for the client's disconnect, which cancels both."""
        gone = finished = False
        error: Exception | None = None
        status = 200

        async def send_tracked(message: dict[str, Any]) -> None:
            nonlocal finished
            if message["type"] == "http.response.body" and not message.get("more_body"):
                finished = True  # the server may report the (keep-alive) stream closed from here on
            await send(message)

        async with trio.open_nursery() as nursery:

            async def watch() -> None:
                nonlocal gone
                while (await receive())["type"] != "http.disconnect":
                    pass
                if not finished:
                    gone = True
                    nursery.cancel_scope.cancel()

            nursery.start_soon(watch)
            try:
                status = await self._send_result(send_tracked, await route.handler(params, body))
            except Exception as exc:  # re-raised below, outside the nursery (not as an ExceptionGroup)
                error = exc
            nursery.cancel_scope.cancel()
        if error is not None:
            raise error
        if gone:
            raise ClientGone
        return status

    async def _json_body(self, receive: Receive) -> dict[str, Any]:
        chunks: list[bytes] = []
        size = 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                raise ClientGone
            chunk = msg.get("body", b"")
            size += len(chunk)
            if size > self.http.max_body_bytes:
                raise HttpError(413, "request_too_large", f"request body exceeds {self.http.max_body_bytes} bytes "
                                                          "(http.max_body_bytes)")
            chunks.append(chunk)
            if not msg.get("more_body"):
                break
        data = b"".join(chunks)
        if not data.strip():
            return {}
        try:
            body = json.loads(data)
        except (ValueError, UnicodeDecodeError) as exc:
            raise HttpError(400, "invalid_json", f"request body is not valid JSON: {exc}") from exc
        if not isinstance(body, dict):
            raise HttpError(400, "invalid_request", "request body must be a JSON object")
        return body

    async def _send_result(self, send: Send, result: Any) -> int:
        if isinstance(result, Raw):
            await send({"type": "http.response.start", "status": result.status,
                        "headers": [(b"content-type", result.content_type.encode()),
                                    (b"content-length", str(len(result.body)).encode())]})
            await send({"type": "http.response.body", "body": result.body})
            return result.status
        if isinstance(result, Stream):
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"application/x-ndjson"), (b"cache-control", b"no-cache")]})

            async def emit(event: dict[str, Any]) -> None:
                line = json.dumps(event, separators=(",", ":")).encode() + b"\n"
                await send({"type": "http.response.body", "body": line, "more_body": True})

            await result.produce(emit)
            await send({"type": "http.response.body", "body": b""})
            return 200
        status, payload = result
        await self._respond(send, status, payload, {})
        return status

    @staticmethod
    async def _respond(send: Send, status: int, payload: Any, headers: dict[str, str]) -> None:
        body = json.dumps(payload, separators=(",", ":")).encode()
        hdrs = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        hdrs += [(k.encode(), v.encode()) for k, v in headers.items()]
        await send({"type": "http.response.start", "status": status, "headers": hdrs})
        await send({"type": "http.response.body", "body": body})

    # --- helpers -------------------------------------------------------------------------------

    def _model(self, body: dict[str, Any], kinds: tuple[str, ...], what: str) -> str:
        model = body.get("model")
        if not isinstance(model, str):
            raise InvalidRequest("'model' must be a string")
        mc = self.sup.model_config(model)
        if mc.kind not in kinds:
            raise InvalidRequest(f"model {model!r} serves {mc.kind}, not {what}")
        return model

    def _admit(self, model: str, texts: list[str], per_text_cap: int | None = None) -> Any:
        """Admission for requests tokenized inside the supervisor: an upper bound of their token-id bytes
        (a token covers at least one UTF-8 byte; two for specials), capped at the model's truncation."""
        from contextlib import nullcontext

        if self.scheduler is None:
            return nullcontext()
        n = sum(min(len(t.encode()) + 2, per_text_cap or math.inf) for t in texts)
        return self.scheduler.admit(model, 4 * int(n))

    @staticmethod
    def _int(body: dict[str, Any], key: str, default: int | None, lo: int, hi: int | None = None) -> int | None:
        value = body.get(key, default)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < lo or (hi is not None and value > hi):
            bound = f"{lo}..{hi}" if hi is not None else f">= {lo}"
            raise InvalidRequest(f"'{key}' must be an integer {bound}, got {value!r}")
        return value

    # --- read-only routes ----------------------------------------------------------------------

    async def healthz(self, _: dict[str, str], __: Any) -> tuple[int, Any]:
        """Cached lane state only: never waits on a worker."""
        lanes = [{k: s[k] for k in ("lane_id", "state", "pid", "generation", "strikes", "cooldown_remaining_s")}
                 for s in self.sup.status()]
        serving = any(ln["state"] in (LaneState.READY.value, LaneState.BUSY.value) for ln in lanes)
        healthy = all(ln["state"] in (LaneState.READY.value, LaneState.BUSY.value) for ln in lanes)
        if not self.admitting:
            return 503, {"status": "draining", "lanes": lanes}
        return (200 if serving else 503), {"status": "ok" if healthy else "degraded" if serving else "unavailable",
                                           "lanes": lanes}

    async def prometheus(self, _: dict[str, str], __: Any) -> Raw:
        if self.metrics is None:
            raise HttpError(404, "not_found", "metrics are not enabled")
        from .metrics import CONTENT_TYPE

        return Raw(200, self.metrics.render(), CONTENT_TYPE)

    def _lane_status(self, s: dict[str, Any]) -> dict[str, Any]:
        lane = self.sup.lanes.get(s["lane_id"])
        drained = self.scheduler is not None and s["lane_id"] in self.scheduler.drained
        return {**s, "drained": drained, "configured_models": list(lane.loads) if lane is not None else []}

    async def lanes(self, _: dict[str, str], __: Any) -> tuple[int, Any]:
        return 200, {"object": "list", "data": [self._lane_status(s) for s in self.sup.status()]}

    async def lane(self, params: dict[str, str], _: Any) -> tuple[int, Any]:
        return 200, self._lane_status(self.admin.lane(params["lane"]).status())

    async def models(self, _: dict[str, str], __: Any) -> tuple[int, Any]:
        data = [{"id": m.id, "object": "model", "created": 0, "owned_by": "trio-gpuworker", "kind": m.kind,
                 "lanes": [ln.id for ln in self.sup.lanes.values() if m.id in ln.loads],
                 "ready_lanes": [ln.id for ln in self.sup.lanes.values() if m.id in ln.models_loaded]}
                for m in self.sup.config.models]
        return 200, {"object": "list", "data": data}

    # --- serving routes ------------------------------------------------------------------------

    async def embeddings(self, _: dict[str, str], body: dict[str, Any]) -> tuple[int, Any]:
        model = self._model(body, ("embedding",), "embeddings")
        inputs = body.get("input")
        if isinstance(inputs, str):
            inputs = [inputs]
        if not isinstance(inputs, list) or not inputs or not all(isinstance(x, str) for x in inputs):
            raise InvalidRequest("'input' must be a string or a non-empty list of strings")
        if len(inputs) > self.http.max_inputs:
            raise InvalidRequest(f"'input' has {len(inputs)} items; at most {self.http.max_inputs} per request "
                                 "(http.max_inputs)")
        fmt = body.get("encoding_format") or "float"
        if fmt not in ("float", "base64"):
            raise InvalidRequest(f"encoding_format must be 'float' or 'base64', got {fmt!r}")
        if body.get("dimensions") is not None:
            raise InvalidRequest("'dimensions' is not supported: the model's own dimensions are returned")
        mc = self.sup.model_config(model)
        rows = await self.sup.tokenize_async(inputs, model=model)
        vecs = await self.sup.embed_rows(rows, model=model, pooling=mc.pooling, normalize=mc.normalize,
                                         timeout=self.http.request_timeout_s)
        n_tokens = sum(len(r) for r in rows)

        def encode(v: np.ndarray) -> Any:
            return base64.b64encode(v.astype("<f4").tobytes()).decode() if fmt == "base64" else v.tolist()

        return 200, {
            "object": "list",
            "model": model,
            "data": [{"object": "embedding", "index": i, "embedding": encode(v)} for i, v in enumerate(vecs)],
            "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens},
        }

    async def rerank(self, _: dict[str, str], body: dict[str, Any]) -> tuple[int, Any]:
        model = self._model(body, ("rerank", "embedding"), "rerank")
        query, docs = body.get("query"), body.get("documents")
        if not isinstance(query, str) or not query:
            raise InvalidRequest("'query' must be a non-empty string")
        if isinstance(docs, list) and all(isinstance(d, dict) and isinstance(d.get("text"), str) for d in docs):
            docs = [d["text"] for d in docs]  # [{"text": ...}] as some rerank APIs send
        if not isinstance(docs, list) or not docs or not all(isinstance(d, str) for d in docs):
            raise InvalidRequest("'documents' must be a non-empty list of strings")
        if len(docs) > self.http.max_inputs:
            raise InvalidRequest(f"'documents' has {len(docs)} items; at most {self.http.max_inputs} per request "
                                 "(http.max_inputs)")
        top_n = self._int(body, "top_n", None, 1) or len(docs)
        return_documents = body.get("return_documents", False)
        if not isinstance(return_documents, bool):
            raise InvalidRequest("'return_documents' must be a boolean")
        cap = self.sup.model_config(model).max_tokens
        with self._admit(model, [query, *docs], cap):
            scores, method = await self.sup.rerank(query, docs, model=model, timeout=self.http.request_timeout_s)
        order = sorted(range(len(docs)), key=lambda i: (-float(scores[i]), i))[:top_n]
        results = [{"index": i, "relevance_score": float(scores[i]),
                    **({"document": {"text": docs[i]}} if return_documents else {})} for i in order]
        return 200, {"id": f"rerank-{secrets.token_hex(12)}", "object": "rerank", "model": model, "method": method,
                     "results": results}

    def _generation_args(self, body: dict[str, Any]) -> dict[str, Any]:
        if body.get("stream"):
            raise InvalidRequest("streaming is not supported: send stream=false")
        if self._int(body, "n", 1, 1, 1) != 1:
            raise InvalidRequest("'n' must be 1")
        key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        max_tokens = self._int(body, key, 16, 1, MAX_GEN_TOKENS)
        grammar = body.get("grammar")
        if grammar is not None and not isinstance(grammar, str):
            raise InvalidRequest("'grammar' must be a string")
        return {"max_tokens": max_tokens, "grammar": grammar or None}

    @staticmethod
    def _usage(out: dict[str, Any]) -> dict[str, int]:
        return {"prompt_tokens": out["n_prompt"], "completion_tokens": out["n_gen"],
                "total_tokens": out["n_prompt"] + out["n_gen"]}

    async def completions(self, _: dict[str, str], body: dict[str, Any]) -> tuple[int, Any]:
        model = self._model(body, ("generate",), "completions")
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if not isinstance(prompt, str) or not prompt:
            raise InvalidRequest("'prompt' must be a non-empty string (one prompt per request)")
        args = self._generation_args(body)
        with self._admit(model, [prompt]):
            out = await self.sup.generate(prompt, model=model, timeout=self.http.request_timeout_s, **args)
        return 200, {"id": f"cmpl-{secrets.token_hex(12)}", "object": "text_completion", "created": int(time.time()),
                     "model": model,
                     "choices": [{"index": 0, "text": out["text"], "logprobs": None,
                                  "finish_reason": out["finish_reason"]}],
                     "usage": self._usage(out)}

    async def chat_completions(self, _: dict[str, str], body: dict[str, Any]) -> tuple[int, Any]:
        model = self._model(body, ("generate",), "chat completions")
        raw = body.get("messages")
        if not isinstance(raw, list) or not raw:
            raise InvalidRequest("'messages' must be a non-empty list")
        messages: list[dict[str, str]] = []
        for i, m in enumerate(raw):
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, list):  # content parts: text only
                if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                           for p in content):
                    raise InvalidRequest(f"messages[{i}].content: only text parts are supported")
                content = "".join(p["text"] for p in content)
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(content, str):
                raise InvalidRequest(f"messages[{i}] must be {{role, content}} with string content")
            messages.append({"role": m["role"], "content": content})
        args = self._generation_args(body)
        with self._admit(model, [m["content"] for m in messages]):
            out = await self.sup.generate(model=model, messages=messages, timeout=self.http.request_timeout_s,
                                          **args)
        return 200, {"id": f"chatcmpl-{secrets.token_hex(12)}", "object": "chat.completion",
                     "created": int(time.time()), "model": model,
                     "choices": [{"index": 0, "message": {"role": "assistant", "content": out["text"]},
                                  "logprobs": None, "finish_reason": out["finish_reason"]}],
                     "usage": self._usage(out)}

