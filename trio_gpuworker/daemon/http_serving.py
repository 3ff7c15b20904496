"""/v1/embeddings: OpenAI's body turned into its request (_api_requests.py: checked once, when it is built, as for
the Python API) and the answer shaped; the Supervisor admits, tokenizes and splits it, with the same typed errors.
"""

from __future__ import annotations

import base64
from typing import TYPE_CHECKING, Any

import numpy as np

from .._api_requests import EmbeddingsRequest
from .http_common import Intake, Raw

if TYPE_CHECKING:
    from ..supervisor import Supervisor
    from .http_body import JsonThreads

INLINE_FLOATS = 16 * 1024  # an answer with more floats (or ids) than this is encoded in a thread


def _vector(v: np.ndarray, b64: bool) -> Any:
    return base64.b64encode(v.astype("<f4").tobytes()).decode() if b64 else v.tolist()


class EmbeddingRoutes:
    def __init__(self, sup: Supervisor, intake: Intake, json: JsonThreads) -> None:
        self.sup, self.intake, self.json = sup, intake, json

    async def embeddings(self, _: dict[str, str], body: dict[str, Any]) -> tuple[int, Any] | Raw:
        http = self.intake.http
        request = EmbeddingsRequest.from_json(body, self.sup.config, max_inputs=http.max_inputs)
        vecs, n_tokens = await self.sup.embeddings(request, timeout=http.request_timeout_s)
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
        return await self.json.encoded(answer)
