"""Which body fields each route takes. A field the daemon does not implement gets 400 `unsupported_field` naming
it: nothing is accepted and ignored.

A route's spec maps each field it knows to None (implemented: the request reads and checks it) or to a check of
a field the daemon does not implement but accepts at the one value that leaves the answer unchanged (OpenAI's
`temperature: 0` for greedy decoding, `n: 1`, ...): the check returns None for that value, else why not.
A JSON null is the field left out, for every field. The serving routes' specs are their request classes' fields
(_api_requests.py, `body_fields`); the others are written here.
"""

from __future__ import annotations

from collections.abc import Mapping

from .._api_checks import Spec, check_fields
from .._api_requests import CompletionRequest, EmbeddingsRequest, RerankRequest
from .._errors import UnsupportedField

EMBEDDINGS: Spec = EmbeddingsRequest.body_fields()
RERANK: Spec = RerankRequest.body_fields()  # /v1/rerank and /v2/rerank (Cohere and Jina)
RERANK_TEI: Spec = RerankRequest.body_fields("tei")  # /rerank (text-embeddings-inference)
COMPLETIONS: Spec = CompletionRequest.body_fields("completions")
CHAT: Spec = CompletionRequest.body_fields("chat")
# text-embeddings-inference's /embed and sentence similarity, text-generation-inference's generation (the top level;
# their `parameters` are checked by the request)
TEI_EMBED: Spec = EmbeddingsRequest.body_fields("tei")
SIMILARITY: Spec = EmbeddingsRequest.nested_fields("similarity", ("inputs",))[0]
TGI: Spec = CompletionRequest.nested_fields("tgi", ("inputs", "stream"))[0]
TOKENIZE: Spec = {"model": None, "prompt": None, "messages": None, "add_special_tokens": None,
                  "add_generation_prompt": None}
DETOKENIZE: Spec = {"model": None, "tokens": None}
ADMIN: Mapping[str, Spec] = {"reload": {"stream": None}, "load": {"model": None, "stream": None},
                             "unload": {"model": None}, "drain": {"wait": None}, "resume": {}, "config": {}}

__all__ = ["ADMIN", "CHAT", "COMPLETIONS", "DETOKENIZE", "EMBEDDINGS", "RERANK", "RERANK_TEI", "SIMILARITY",
           "TEI_EMBED", "TGI", "TOKENIZE", "Spec", "UnsupportedField", "check_fields"]
