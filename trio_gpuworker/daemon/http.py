"""The HTTP API as a plain ASGI app (served by hypercorn on trio).

One `Api` serves every listener; `api.listener(admin=True)` is the app for the Unix socket, where the admin
routes live (on TCP only with http.admin_on_tcp). With API keys configured, a TCP request other than to an open
route (the probes and /metrics by default) needs `Authorization: Bearer <key>`; the Unix socket is guarded by
its file mode instead. Every route names the body fields and query parameters it takes, and anything else gets
400 `unsupported_field`. Errors are JSON bodies `{"error": {"code", "message", "detail"?, "param"?}}` whose
`code` is stable. A request whose client disconnects is cancelled, so its work is dropped before it reaches a
worker if it has not yet.
"""

from __future__ import annotations

import json
import logging
import re
import time
import urllib.parse
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import trio

from .._errors import ClosedSupervisorError, GpuWorkerError, InvalidRequest, ModelLoading
from ..supervisor import Supervisor
from . import http_fields as spec
from .admin import LaneAdmin
from .config import HttpConfig
from .http_admin import AdminRoutes
from .http_auth import bearer_token, challenge, key_matches
from .http_body import JsonThreads, decode_json, discard_body, read_body
from .http_common import (
    DRAIN_RETRY_AFTER_S,
    ClientGone,
    EventStream,
    HttpError,
    Intake,
    Raw,
    Receive,
    Route,
    Scope,
    Send,
    Stream,
    error_body,
    error_type,
    send_events,
)
from .http_completions import CompletionRoutes
from .http_fields import UnsupportedField, check_fields
from .http_rerank import RerankRoutes, rerank_fields
from .http_serving import EmbeddingRoutes
from .http_state import StateRoutes
from .http_tei import TeiRoutes, root_fields
from .http_tokens import TokenRoutes

if TYPE_CHECKING:
    from .metrics import Metrics

log = logging.getLogger("trio_gpuworker.http")

JSON_INLINE_BYTES = 64 * 1024  # bodies up to this size decode on the loop (well under a millisecond)
JSON_THREADS = 2  # large bodies decoding at once
Fields = spec.Spec | Callable[[dict[str, Any]], spec.Spec]  # a route's body fields, or them by the body's shape


class Api:
    """The ASGI app: matching, keys, drain, bodies and errors here; each route family's handlers in its own object,
    built with what it reads (the Supervisor, the lane admin, the `Intake` and the JSON threads)."""

    def __init__(self, sup: Supervisor, http: HttpConfig, *, metrics: Metrics | None = None,
                 reload_config: Callable[[], Awaitable[dict[str, Any]]] | None = None,
                 liveness: Callable[[], tuple[bool, str]] | None = None) -> None:
        self.sup = sup
        self.intake = Intake(http)
        self.metrics = metrics
        self.admin = LaneAdmin(sup)
        self.inflight = 0
        self.served = 0
        self._idle = trio.Event()
        self._idle.set()
        self._per_client: dict[str, int] = {}
        self._json = JsonThreads(JSON_THREADS)
        live = liveness or (lambda: (not sup.router.closed, "the supervisor is closed"))
        self.routes = self._routes(StateRoutes(sup, self.admin, self.intake, metrics, live),
                                   AdminRoutes(sup, self.admin, self.intake, reload_config))

    def _routes(self, state: StateRoutes, admin: AdminRoutes) -> list[Route]:
        sup, intake = self.sup, self.intake
        embeddings, rerank = EmbeddingRoutes(sup, intake, self._json), RerankRoutes(sup, intake)
        tokens, generation = TokenRoutes(sup, self._json), CompletionRoutes(sup, intake)
        tei = TeiRoutes(sup, intake, rerank)
        lane, model = r"(?P<lane>[A-Za-z0-9_-]+)", r"(?P<model>.+)"  # a model id may hold a '/' (org/name)
        # method, path, handler, admin, tracked, body fields (None: no body), query parameters
        table: list[tuple[str, str, Callable[..., Awaitable[Any]], bool, bool, Fields | None, tuple[str, ...]]] = [
            ("GET", "/livez", state.livez, False, False, None, ()),
            ("GET", "/readyz", state.readyz, False, False, None, ("model",)),
            ("GET", "/healthz", state.healthz, False, False, None, ()),
            ("GET", "/metrics", state.prometheus, False, False, None, ()),
            ("GET", "/v1/models", state.models, False, False, None, ()),
            ("GET", "/v1/models/{model}", state.model, False, False, None, ()),
            ("GET", "/v1/lanes", state.lanes, False, False, None, ()),
            ("GET", "/v1/lanes/{lane}", state.lane, False, False, None, ()),
            ("POST", "/v1/embeddings", embeddings.embeddings, False, True, spec.EMBEDDINGS, ()),
            ("POST", "/v1/rerank", rerank.rerank, False, True, spec.RERANK, ()),
            ("POST", "/v2/rerank", rerank.rerank, False, True, spec.RERANK, ()),
            ("POST", "/rerank", rerank.rerank_any, False, True, rerank_fields, ()),
            # text-embeddings-inference's and text-generation-inference's routes (the one model of each kind)
            ("POST", "/embed", tei.embed, False, True, spec.TEI_EMBED, ()),
            ("POST", "/", tei.root, False, True, root_fields(tei.kinds), ()),
            ("POST", "/generate", tei.generate, False, True, spec.TGI, ()),
            ("GET", "/info", tei.info, False, False, None, ()),
            ("GET", "/health", state.health, False, False, None, ()),
            ("GET", "/", state.health, False, False, None, ()),
            ("POST", "/tokenize", tokens.tokenize, False, True, spec.TOKENIZE, ()),
            ("POST", "/detokenize", tokens.detokenize, False, True, spec.DETOKENIZE, ()),
            ("GET", "/tokenizer_info", tokens.tokenizer_info, False, False, None, ("model",)),
            ("POST", "/v1/completions", generation.completions, False, True, spec.COMPLETIONS, ()),
            ("POST", "/v1/chat/completions", generation.chat_completions, False, True, spec.CHAT, ()),
            ("POST", "/v1/lanes/{lane}/reload", admin.lane_reload, True, True, spec.ADMIN["reload"], ()),
            ("POST", "/v1/lanes/{lane}/drain", admin.lane_drain, True, True, spec.ADMIN["drain"], ()),
            ("POST", "/v1/lanes/{lane}/resume", admin.lane_resume, True, True, spec.ADMIN["resume"], ()),
            ("POST", "/v1/lanes/{lane}/load", admin.lane_load, True, True, spec.ADMIN["load"], ()),
            ("POST", "/v1/lanes/{lane}/unload", admin.lane_unload, True, True, spec.ADMIN["unload"], ()),
            ("POST", "/v1/config/reload", admin.config_reload, True, True, spec.ADMIN["config"], ()),
        ]
        # matched with fullmatch: `$` would also match before a trailing newline (/v1/lanes/embed-0%0a)
        return [Route(m, re.compile(p.replace("{lane}", lane).replace("{model}", model)), p, h, is_admin, tracked,
                      fields, query)
                for m, p, h, is_admin, tracked, fields, query in table]

    # --- the state the daemon sets: its [http] settings (a reload), admission and readiness (SIGTERM) --------

    @property
    def http(self) -> HttpConfig:
        return self.intake.http

    @http.setter
    def http(self, http: HttpConfig) -> None:
        self.intake.http = http

    @property
    def admitting(self) -> bool:
        return self.intake.admitting

    @admitting.setter
    def admitting(self, admitting: bool) -> None:
        self.intake.admitting = admitting

    @property
    def draining(self) -> bool:
        return self.intake.draining

    @draining.setter
    def draining(self, draining: bool) -> None:
        self.intake.draining = draining

    # --- ASGI ----------------------------------------------------------------------------------

    def listener(self, *, admin: bool) -> Callable[[Scope, Receive, Send], Awaitable[None]]:
        async def app(scope: Scope, receive: Receive, send: Send) -> None:
            await self.handle(scope, receive, send, admin=admin)

        return app

    def in_flight_from(self, host: str) -> int:
        """POST requests in flight from one client address (what http.max_connections_per_client caps)."""
        return self._per_client.get(host, 0)

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
            m = route.pattern.fullmatch(path)
            if m is None:
                continue
            if route.method == method or (method == "HEAD" and route.method == "GET"):
                return route, m.groupdict()
            allowed = True
        if allowed:
            raise HttpError(405, "method_not_allowed", f"{method} is not allowed on {path}")
        raise HttpError(404, "not_found", f"no route {path}")

    def _authorize(self, method: str, path: str, scope: Scope) -> None:
        """TCP requests need one of the API keys when keys are configured, except GETs of the open routes. Checked
        before the route is matched: without a key, every path answers 401 alike."""
        keys = self.http.api_keys
        if not keys or (method in ("GET", "HEAD") and path in self.http.open_routes):
            return
        token = bearer_token(scope.get("headers", ()))
        if not key_matches(token, keys):
            raise HttpError(401, "unauthorized", "a valid API key is required: Authorization: Bearer <key>"
                            if token is None else "the API key is not valid",
                            {"www-authenticate": challenge(token is not None)})

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
        started = received = False  # received: something has read the request's body (the route, or its watcher)
        server_send = send

        async def send_once(message: dict[str, Any]) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                if started:  # a failure after the answer began (a stream): it ends the stream, nothing more
                    return
                started = True
            elif method == "HEAD" and message.get("body"):
                message = {**message, "body": b""}  # HEAD: GET's headers (content-length included), no body
            try:
                await server_send(message)
            except (trio.BrokenResourceError, trio.ClosedResourceError, trio.BusyResourceError):
                # the client hung up while we answered (hypercorn may be closing the stream right now):
                # there is nobody to tell, and no reason for an error
                log.debug("%s %s: the client left during the answer", method, path)

        send = send_once
        client = scope.get("client")
        # Only requests with a body are counted: those are what a client can stall or pile up, while probes
        # (/healthz, /metrics) stay answerable. On loopback every local client shares one address.
        host = client[0] if method == "POST" and isinstance(client, list | tuple) and client and client[0] else ""
        if host:
            self._per_client[host] = self._per_client.get(host, 0) + 1
        try:
            if host and self._per_client[host] > self.http.max_connections_per_client:
                raise HttpError(429, "too_many_connections",
                                f"{host} has {self._per_client[host] - 1} requests in flight; at most "
                                f"{self.http.max_connections_per_client} (http.max_connections_per_client)",
                                {"retry-after": "1", "connection": "close"})
            if not admin:
                self._authorize(method, path, scope)
            route, params = self._match(method, path)
            label = route.label
            params |= _query(scope, route)
            if route.admin and not (admin or self.http.admin_on_tcp):
                raise HttpError(403, "admin_only", f"{route.label} is served on the Unix socket only "
                                                   "(http.admin_on_tcp)")
            if route.tracked and not self.admitting:
                raise HttpError.like(ClosedSupervisorError, "gpuworkerd is draining; no new requests are admitted",
                                     {"retry-after": str(DRAIN_RETRY_AFTER_S), "connection": "close"})
            if route.tracked:  # in flight from its admission: a drain waits for its body's upload too
                self._enter()
                tracked = True
            received = True  # from here the body is read whole, or the answer closes the connection
            body = await self._json_body(scope, receive) if method == "POST" else None
            model = self._model_label(body)
            if route.fields is not None and body is not None:
                check_fields(body, route.fields(body) if callable(route.fields) else route.fields)
            status = await self._run(route, params, body, receive, send)
            outcome = "ok" if status < 400 else str(status)
        except ClientGone:
            outcome = "client_gone"
        except GpuWorkerError as exc:
            status, headers, outcome = exc.http_status, exc.http_headers(), exc.code
            if status >= 500 and not isinstance(exc, ModelLoading):  # the startup report says what loads
                log.warning("%s %s -> %d %s", method, path, status, exc)
            if not received:
                headers = await self._after_unread_body(scope, receive, headers)
            await self._respond(send, status, error_body(exc), headers)
        except Exception as exc:  # the daemon must answer, whatever broke
            log.exception("%s %s failed", method, path)
            outcome = "internal"
            await self._respond(send, 500, {"error": {"code": "internal", "message": f"{type(exc).__name__}: {exc}",
                                                      "type": error_type(500), "param": None}},
                                {} if received else await self._after_unread_body(scope, receive, {}))
        finally:
            if tracked:
                self._exit()
            if host:
                self._per_client[host] -= 1
                if not self._per_client[host]:
                    del self._per_client[host]
        if self.metrics is not None:
            self.metrics.observe(label, model, outcome, time.perf_counter() - t0)
        log.debug("%s %s %s %.1f ms", method, path, outcome, (time.perf_counter() - t0) * 1000)

    async def _after_unread_body(self, scope: Scope, receive: Receive, headers: dict[str, str]) -> dict[str, str]:
        """Before an early answer: drop the body nobody read (http_body says why), or say the connection closes."""
        if "connection" in headers or await discard_body(scope, receive, self.http.max_body_bytes,
                                                         self.http.body_timeout_s):
            return headers
        return {**headers, "connection": "close"}

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

    async def _json_body(self, scope: Scope, receive: Receive) -> dict[str, Any]:
        data = await read_body(scope, receive, self.http.max_body_bytes, self.http.body_timeout_s)
        if not data.strip():
            return {}
        if len(data) > JSON_INLINE_BYTES:  # a large body decodes in a thread, never on the loop
            body = await self._json.decode(data)
        else:
            body = decode_json(data)
        if not isinstance(body, dict):
            raise InvalidRequest("request body must be a JSON object")
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
        if isinstance(result, EventStream):
            return await send_events(send, result)
        status, payload, *headers = result  # (status, payload) or (status, payload, headers)
        await self._respond(send, status, payload, headers[0] if headers else {})
        return status

    @staticmethod
    async def _respond(send: Send, status: int, payload: Any, headers: dict[str, str]) -> None:
        body = json.dumps(payload, separators=(",", ":")).encode()
        hdrs = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        hdrs += [(k.encode(), v.encode()) for k, v in headers.items()]
        await send({"type": "http.response.start", "status": status, "headers": hdrs})
        await send({"type": "http.response.body", "body": body})


def _query(scope: Scope, route: Route) -> dict[str, str]:
    """The route's query parameters; one it does not take (or one given twice) is refused."""
    raw = scope.get("query_string", b"").decode("latin-1")
    try:
        pairs = urllib.parse.parse_qsl(raw, keep_blank_values=True, strict_parsing=bool(raw))
    except ValueError:
        raise InvalidRequest(f"the query string {raw[:64]!r} is malformed") from None
    out: dict[str, str] = {}
    for name, value in pairs:
        if name not in route.query:
            raise UnsupportedField(name, f"is not a query parameter of {route.label}")
        if name in out:
            raise InvalidRequest(f"query parameter {name!r} is given twice")
        out[name] = value
    return out
