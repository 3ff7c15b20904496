"""Rerank in the shapes clients send: Cohere and Jina (`/v1/rerank`, `/v2/rerank`) and text-embeddings-inference
(`/rerank`, which also takes Cohere's and Jina's body, as vLLM and infinity do there, and answers each in its own
shape). The Supervisor scores; these only parse and shape the answers."""

from __future__ import annotations

import math
import secrets
from typing import TYPE_CHECKING, Any

import numpy as np

from .._api_requests import RerankRequest
from .http_common import Intake
from .http_fields import RERANK, RERANK_TEI, Spec

if TYPE_CHECKING:
    from ..supervisor import Supervisor


def rerank_shape(body: dict[str, Any]) -> str:
    """/rerank's body: Cohere's and Jina's ("") when it has `documents`, else TEI's ("tei")."""
    return "" if "documents" in body else "tei"


def rerank_fields(body: dict[str, Any]) -> Spec:
    """/rerank's body fields, by its shape."""
    return RERANK if rerank_shape(body) == "" else RERANK_TEI


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))


class RerankRoutes:
    def __init__(self, sup: Supervisor, intake: Intake) -> None:
        self.sup, self.intake = sup, intake

    async def _scores(self, body: dict[str, Any], shape: str, *,
                      one_model: bool = False) -> tuple[RerankRequest, np.ndarray, str, int, list[int]]:
        """The request, its scores, method, tokens, and the document indices best first (ties by index)."""
        http = self.intake.http
        request = RerankRequest.from_json(body, self.sup.config, max_inputs=http.max_inputs, shape=shape,
                                          one_model=one_model)
        scores, method, n_tokens = await self.sup.reranking(request, timeout=http.request_timeout_s)
        order = sorted(range(len(request.documents)), key=lambda i: (-float(scores[i]), i))
        return request, scores, method, n_tokens, order

    async def rerank_any(self, params: dict[str, str], body: dict[str, Any]) -> tuple[int, Any] | tuple[
            int, Any, dict[str, str]]:
        """/rerank: TEI's body (`texts`) answered in TEI's shape, Cohere's and Jina's (`documents`, as vLLM and
        infinity take there) in theirs; either may name no model when one can rerank."""
        if rerank_shape(body) == "tei":
            return await self.rerank_tei(params, body)
        return await self.rerank(params, body, one_model=True)

    async def rerank(self, _: dict[str, str], body: dict[str, Any], *, one_model: bool = False) -> tuple[int, Any]:
        """Cohere's and Jina's shape; scores as the model gives them (a cross-encoder's logit, or a cosine)."""
        request, scores, method, n_tokens, order = await self._scores(body, "", one_model=one_model)
        docs = request.documents
        results = [{"index": i, "relevance_score": float(scores[i]),
                    **({"document": {"text": docs[i]}} if request.return_documents else {})}
                   for i in order[:request.top_n or len(docs)]]
        return 200, {"id": f"rerank-{secrets.token_hex(12)}", "object": "rerank", "model": request.model,
                     "method": method, "results": results,
                     "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens}}

    async def rerank_tei(self, _: dict[str, str], body: dict[str, Any]) -> tuple[int, Any, dict[str, str]]:
        """TEI's shape: a bare list of {index, score, text?}, best first; sigmoid scores for a cross-encoder
        unless raw_scores (a cosine has no activation to skip). Usage goes in TEI's x-compute-* headers."""
        request, scores, method, n_tokens, order = await self._scores(body, "tei")
        texts = request.documents
        activate = method == "cross_encoder" and not request.raw_scores
        out = [{"index": i, "score": _sigmoid(float(scores[i])) if activate else float(scores[i]),
                **({"text": texts[i]} if request.return_documents else {})} for i in order]
        chars = len(request.query) + sum(map(len, texts))
        return 200, out, {"x-compute-tokens": str(n_tokens), "x-compute-characters": str(chars)}
