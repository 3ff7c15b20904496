"""Rerank in the shapes clients send: Cohere and Jina (`/v1/rerank`, `/v2/rerank`) and text-embeddings-inference
(`/rerank`). The Supervisor scores; these only parse and shape the answers."""

from __future__ import annotations

import math
import secrets
from typing import Any

import numpy as np

from .._errors import InvalidRequest
from .._kinds import EMBEDDING, RERANK
from .http_serving import ServingRoutes


def _flag(body: dict[str, Any], key: str) -> bool:
    value = body.get(key)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise InvalidRequest(f"'{key}' must be a boolean")
    return value


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))


class RerankRoutes(ServingRoutes):
    async def _scores(self, model: str, query: Any, docs: list[str], body: dict[str, Any]
                      ) -> tuple[np.ndarray, str, int, list[int]]:
        """Scores, method, tokens, and the document indices best first (ties by index)."""
        if not isinstance(query, str) or not query:
            raise InvalidRequest("'query' must be a non-empty string")
        scores, method, n_tokens = await self.sup.rerank_counted(
            query, docs, model=model, timeout=self.http.request_timeout_s, truncate=body.get("truncate"),
            max_tokens_per_doc=body.get("max_tokens_per_doc"))
        return scores, method, n_tokens, sorted(range(len(docs)), key=lambda i: (-float(scores[i]), i))

    async def rerank(self, _: dict[str, str], body: dict[str, Any]) -> tuple[int, Any]:
        """Cohere's and Jina's shape; scores as the model gives them (a cross-encoder's logit, or a cosine)."""
        model = self._model(body)
        docs = body.get("documents")
        if isinstance(docs, list) and docs and all(isinstance(d, dict) for d in docs):
            for i, d in enumerate(docs):  # [{"text": ...}] as Jina and Cohere's v1 send
                if set(d) != {"text"} or not isinstance(d["text"], str):
                    raise InvalidRequest(f"documents[{i}] must be a string or {{\"text\": string}}")
            docs = [d["text"] for d in docs]
        docs = self._inputs(docs, "documents")
        top_n = self._int(body, "top_n", None, 1) or len(docs)
        return_documents = _flag(body, "return_documents")
        scores, method, n_tokens, order = await self._scores(model, body.get("query"), docs, body)
        results = [{"index": i, "relevance_score": float(scores[i]),
                    **({"document": {"text": docs[i]}} if return_documents else {})} for i in order[:top_n]]
        return 200, {"id": f"rerank-{secrets.token_hex(12)}", "object": "rerank", "model": model, "method": method,
                     "results": results, "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens}}

    def _tei_model(self, body: dict[str, Any]) -> str:
        """TEI serves one model and its clients name none: without `model`, the one rerank model, else the one
        embedding model configured."""
        if body.get("model") is not None:
            return self._model(body)
        models = self.sup.config.models
        for kind in (RERANK, EMBEDDING):  # a cross-encoder before a bi-encoder
            of_kind = [m.id for m in models if m.kind == kind]
            if len(of_kind) == 1:
                return of_kind[0]
            if of_kind:
                break
        raise InvalidRequest("'model' is required: more than one model (or none) can rerank here")

    async def rerank_tei(self, _: dict[str, str], body: dict[str, Any]) -> tuple[int, Any, dict[str, str]]:
        """TEI's shape: a bare list of {index, score, text?}, best first; sigmoid scores for a cross-encoder
        unless raw_scores (a cosine has no activation to skip). Usage goes in TEI's x-compute-* headers."""
        model = self._tei_model(body)
        texts = self._inputs(body.get("texts"), "texts")
        raw, return_text = _flag(body, "raw_scores"), _flag(body, "return_text")
        query = body.get("query")
        scores, method, n_tokens, order = await self._scores(model, query, texts, body)
        activate = method == "cross_encoder" and not raw
        out = [{"index": i, "score": _sigmoid(float(scores[i])) if activate else float(scores[i]),
                **({"text": texts[i]} if return_text else {})} for i in order]
        chars = len(query) + sum(map(len, texts))
        return 200, out, {"x-compute-tokens": str(n_tokens), "x-compute-characters": str(chars)}
