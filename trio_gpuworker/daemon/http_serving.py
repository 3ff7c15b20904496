"""The serving routes' shared answer shaping, and embeddings, mixed into `Api` (completions are http_generate's).

They only turn a body into its request (_api_requests.py: checked once, when it is built, as for the Python API)
and shape the answers: the Supervisor admits, tokenizes and splits every request, with the same typed errors.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import trio

from .._api_requests import EmbeddingsRequest
from .http_common import Raw

if TYPE_CHECKING:
    from ..supervisor import Supervisor
    from .config import HttpConfig

INLINE_FLOATS = 16 * 1024  # an answer with more floats than this is encoded in a thread


def _vector(v: np.ndarray, b64: bool) -> Any:
    return base64.b64encode(v.astype("<f4").tobytes()).decode() if b64 else v.tolist()


class ServingRoutes:
    sup: Supervisor
    http: HttpConfig
    _json_cpu: trio.CapacityLimiter

    async def embeddings(self, _: dict[str, str], body: dict[str, Any]) -> tuple[int, Any] | Raw:
        request = EmbeddingsRequest.from_json(body, self.sup.config, max_inputs=self.http.max_inputs)
        vecs, n_tokens = await self.sup.embeddings(request, timeout=self.http.request_timeout_s)
        b64 = request.encoding_format == "base64"

        def answer() -> dict[str, Any]:
            return {
                "object": "list",
                "model": request.model,
                "data": [{"object": "embedding", "index": i, "embedding": _vector(v, b64)} for i, v in enumerate(vecs)],
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
