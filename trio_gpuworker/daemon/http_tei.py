"""text-embeddings-inference's and text-generation-inference's routes, in their shapes: `POST /embed`, `POST /`,
`POST /generate` and `GET /info` (`GET /health` is a probe: http_state.py). TEI and TGI serve one model and their
clients name none, so each body goes to the one model of its kind (`_api_requests.only_model`, `tei_model`).

`POST /` is routed as TEI and TGI route it, by what the body is: `inputs: {source_sentence, sentences}` is TEI's
sentence similarity, a `query` is TEI's rerank, `parameters` or `stream` (or a daemon with no embedding model)
TGI's generation, and anything else TEI's embed. The bodies become the same typed requests as the OpenAI routes'
(`EmbeddingsRequest`, `CompletionRequest`, `RerankRequest`), so their checks and errors are the same.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from .._api_checks import MAX_STOPS, gen_context
from .._api_requests import PARAMETERS, CompletionRequest, EmbeddingsRequest, only_model, tei_model
from .._errors import InvalidRequest
from .._kinds import EMBEDDING, GENERATE, RERANK
from .._version import __version__
from .http_common import Intake
from .http_fields import RERANK_TEI, SIMILARITY, TEI_EMBED, TGI, Spec

if TYPE_CHECKING:
    from .._config import ModelConfig
    from ..supervisor import Supervisor
    from .http_config import HttpConfig
    from .http_rerank import RerankRoutes


def root_shape(body: dict[str, Any], kinds: set[str]) -> str:
    """Which body a `POST /` is: "similarity", "rerank" (TEI's), "tgi" or "tei" (embed)."""
    if isinstance(body.get("inputs"), dict):
        return "similarity"
    if "query" in body:
        return "rerank"
    if PARAMETERS in body or "stream" in body or EMBEDDING not in kinds:
        return "tgi"
    return "tei"


def root_fields(kinds: set[str]) -> Callable[[dict[str, Any]], Spec]:
    """The body fields of `POST /`, by the body's shape (`Route.fields` as a function of the body)."""
    specs = {"similarity": SIMILARITY, "rerank": RERANK_TEI, "tgi": TGI, "tei": TEI_EMBED}
    return lambda body: specs[root_shape(body, kinds)]


def _compute_headers(n_tokens: int, n_chars: int) -> dict[str, str]:
    """TEI's usage headers."""
    return {"x-compute-tokens": str(n_tokens), "x-compute-characters": str(n_chars)}


def _chars(inputs: list[Any]) -> int:
    """TEI's x-compute-characters: a text's characters, a token-id input's ids."""
    return sum(len(x) for x in inputs)


class TeiRoutes:
    def __init__(self, sup: Supervisor, intake: Intake, rerank: RerankRoutes) -> None:
        self.sup, self.intake, self.rerank = sup, intake, rerank

    @property
    def kinds(self) -> set[str]:
        return {m.kind for m in self.sup.config.models}

    async def _embed(self, body: dict[str, Any], shape: str) -> tuple[EmbeddingsRequest, np.ndarray, int]:
        http = self.intake.http
        request = EmbeddingsRequest.from_json(body, self.sup.config, max_inputs=http.max_inputs, shape=shape)
        vecs, n_tokens = await self.sup.embeddings(request, timeout=http.request_timeout_s)
        return request, vecs, n_tokens

    async def embed(self, _: dict[str, str], body: dict[str, Any]) -> tuple[int, Any, dict[str, str]]:
        """TEI's /embed: a list of vectors, one per input (one input is a list of one)."""
        request, vecs, n_tokens = await self._embed(body, "tei")
        return 200, vecs.tolist(), _compute_headers(n_tokens, _chars(request.input))

    async def similarity(self, body: dict[str, Any]) -> tuple[int, Any, dict[str, str]]:
        """TEI's sentence similarity: the cosine of the source sentence's vector with each sentence's."""
        request, vecs, n_tokens = await self._embed(body, "similarity")
        v = vecs.astype(np.float64)
        norms = np.linalg.norm(v, axis=1)
        cos = (v[1:] @ v[0]) / np.maximum(norms[1:] * norms[0], np.finfo(np.float64).tiny)
        return 200, [float(c) for c in cos], _compute_headers(n_tokens, _chars(request.input))

    async def root(self, params: dict[str, str], body: dict[str, Any]) -> tuple[int, Any, dict[str, str]]:
        shape = root_shape(body, self.kinds)
        if shape == "similarity":
            return await self.similarity(body)
        if shape == "rerank":
            return await self.rerank.rerank_tei(params, body)
        if shape == "tgi":
            status, out = await self._generate(body, full_text=True)
            return status, [out], {}
        return await self.embed(params, body)

    async def generate(self, _: dict[str, str], body: dict[str, Any]) -> tuple[int, Any]:
        return await self._generate(body, full_text=False)

    async def _generate(self, body: dict[str, Any], *, full_text: bool) -> tuple[int, Any]:
        """TGI's generation: `{generated_text}`, led by the prompt with return_full_text (the default of `POST /`,
        as TGI's for a text-generation model; not of `/generate`)."""
        request = CompletionRequest.from_json(body, self.sup.config, shape="tgi", full_text=full_text)
        out = await self.sup.completion(request, timeout=self.intake.http.request_timeout_s)
        lead = request.prompt if request.return_full_text and request.prompt is not None else ""
        return 200, {"generated_text": lead + out["text"]}

    async def info(self, _: dict[str, str], __: Any) -> tuple[int, Any]:
        """TEI's /info for the model TEI's routes serve (the one rerank model, else the one embedding model), else
        TGI's for the one generate model."""
        cfg, http = self.sup.config, self.intake.http
        workers = int(self.sup.tokenizers.cpu.total_tokens)  # the threads that tokenize (and so validate) inputs
        if EMBEDDING in self.kinds or RERANK in self.kinds:
            return 200, tei_info(cfg.model(tei_model(cfg)), http, workers)
        if GENERATE in self.kinds:
            return 200, tgi_info(cfg.model(only_model(cfg, GENERATE)), http, workers)
        raise InvalidRequest("no model is served here")


def tei_info(mc: ModelConfig, http: HttpConfig, workers: int) -> dict[str, Any]:
    """TEI's Info: the model, its type (pooling, or a reranker's one label) and the router's limits."""
    model_type = {"reranker": {"id2label": {"0": "LABEL_0"}, "label2id": {"LABEL_0": 0}}} if mc.kind == RERANK \
        else {"embedding": {"pooling": mc.defaults[0]}}
    return {"model_id": mc.id, "model_sha": mc.digest, "model_dtype": "float32", "served_model_name": mc.id,
            "model_type": model_type, "max_concurrent_requests": http.max_connections_per_client,
            "max_input_length": mc.max_tokens, "max_batch_tokens": mc.max_tokens * http.max_inputs,
            "max_batch_requests": None, "max_client_batch_size": http.max_inputs, "auto_truncate": True,
            "tokenization_workers": workers, "version": __version__, "sha": None, "docker_label": None}


def tgi_info(mc: ModelConfig, http: HttpConfig, workers: int) -> dict[str, Any]:
    """TGI's Info: the model and the router's limits (one sequence per request, up to MAX_STOPS stops)."""
    context = gen_context(mc)
    return {"model_id": mc.id, "model_sha": mc.digest, "model_pipeline_tag": "text-generation",
            "max_concurrent_requests": http.max_connections_per_client, "max_best_of": 1,
            "max_stop_sequences": MAX_STOPS, "max_input_tokens": context - 1, "max_total_tokens": context,
            "validation_workers": workers, "max_client_batch_size": 1, "router": "trio-gpuworker",
            "version": __version__, "sha": None, "docker_label": None}
