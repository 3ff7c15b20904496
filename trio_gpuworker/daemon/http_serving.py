"""The serving routes' shared parsing, and embeddings, mixed into `Api` (completions are http_generate's).

They only parse the OpenAI-shaped bodies and shape the answers: the Supervisor checks, admits, tokenizes and
splits every request, once, with the same typed errors as the Python API.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import trio

from .._errors import InvalidRequest
from .http_common import Raw

if TYPE_CHECKING:
    from ..supervisor import Supervisor
    from .config import HttpConfig

ENCODING_FORMATS = ("float", "base64")
INLINE_FLOATS = 16 * 1024  # an answer with more floats than this is encoded in a thread
DEFAULT_GEN_TOKENS = 16


def _is_id(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


class ServingRoutes:
    sup: Supervisor
    http: HttpConfig
    _json_cpu: trio.CapacityLimiter

    def _model(self, body: dict[str, Any]) -> str:
        """The body's model, if one is configured (ModelNotFound, 404, before any other check of the body). Whether
        its kind serves the route is the Supervisor's one check (supervisor/_route.py), as for the Python API."""
        model = body.get("model")
        if not isinstance(model, str):
            raise InvalidRequest("'model' must be a string")
        self.sup.model_config(model)
        return model

    @staticmethod
    def _int(body: dict[str, Any], key: str, default: int | None, lo: int, hi: int | None = None) -> int | None:
        value = body.get(key, default)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < lo or (hi is not None and value > hi):
            bound = f"{lo}..{hi}" if hi is not None else f">= {lo}"
            raise InvalidRequest(f"'{key}' must be an integer {bound}, got {value!r}")
        return value

    def _inputs(self, value: Any, key: str, *, ids: bool = False) -> list[Any]:
        """A non-empty list, capped at http.max_inputs: the HTTP API's own rules. What each item must be (a
        string, or with `ids` a list of token ids) is the Supervisor's one check of the texts, as for the
        Python API."""
        if not isinstance(value, list) or not value:
            raise InvalidRequest(f"'{key}' must be a string or a non-empty list of strings"
                                 + (", a list of token ids or a non-empty list of them" if ids else ""))
        if len(value) > self.http.max_inputs:
            raise InvalidRequest(f"'{key}' has {len(value)} items; at most {self.http.max_inputs} per request "
                                 "(http.max_inputs)")
        return value

    async def embeddings(self, _: dict[str, str], body: dict[str, Any]) -> tuple[int, Any] | Raw:
        model = self._model(body)
        inputs = body.get("input")
        if isinstance(inputs, str) or (isinstance(inputs, list) and inputs and all(_is_id(x) for x in inputs)):
            inputs = [inputs]  # one text, or one input of token ids
        inputs = self._inputs(inputs, "input", ids=True)
        fmt = body.get("encoding_format", "float")
        if fmt is None:
            fmt = "float"
        if not isinstance(fmt, str) or fmt not in ENCODING_FORMATS:
            raise InvalidRequest(f"encoding_format must be 'float' or 'base64', got {fmt!r}")
        user = body.get("user")
        if user is not None and not isinstance(user, str):
            raise InvalidRequest("'user' must be a string")
        vecs, n_tokens = await self.sup.embed_counted(
            inputs, model=model, timeout=self.http.request_timeout_s, pooling=body.get("pooling"),
            normalize=body.get("normalize"), truncate=body.get("truncate"), dimensions=body.get("dimensions"))

        def encode(v: np.ndarray) -> Any:
            return base64.b64encode(v.astype("<f4").tobytes()).decode() if fmt == "base64" else v.tolist()

        def answer() -> dict[str, Any]:
            return {
                "object": "list",
                "model": model,
                "data": [{"object": "embedding", "index": i, "embedding": encode(v)} for i, v in enumerate(vecs)],
                "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens},
            }

        if vecs.size <= INLINE_FLOATS:
            return 200, answer()
        return await self._encoded(answer)

    async def _encoded(self, answer: Callable[[], Any]) -> Raw:
        """Thousands of vectors (or ids) take tens of milliseconds to encode as JSON: not on the loop."""
        body = await trio.to_thread.run_sync(lambda: json.dumps(answer(), separators=(",", ":")).encode(),
                                             limiter=self._json_cpu)
        return Raw(200, body, "application/json")
