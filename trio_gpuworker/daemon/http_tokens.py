"""/tokenize, /detokenize and /tokenizer_info (vLLM's shapes) for every model kind: the daemon's own tokenizers, no
worker. As vLLM serves one model, a body (or query) may name none when one model answers: `default_model`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .._api_requests import ApiRequest
from .._config import SupervisorConfig
from .._errors import InvalidRequest
from .._kinds import GENERATE
from .http_common import Raw
from .http_serving import INLINE_FLOATS

if TYPE_CHECKING:
    from ..supervisor import Supervisor
    from .http_body import JsonThreads


def default_model(models: SupervisorConfig, model: Any) -> str:
    """The model named, else the one generate model (vLLM's clients tokenize for generation), else the one model."""
    if model is not None:
        return ApiRequest.json_model({"model": model}, models)
    for of_kind in ([m.id for m in models.models if m.kind == GENERATE], [m.id for m in models.models]):
        if len(of_kind) == 1:
            return of_kind[0]
        if of_kind:
            break
    raise InvalidRequest("'model' is required: more than one model is served here")


class TokenRoutes:
    def __init__(self, sup: Supervisor, json: JsonThreads) -> None:
        self.sup, self.json = sup, json

    async def tokenize(self, _: dict[str, str], body: dict[str, Any]) -> tuple[int, Any] | Raw:
        model = default_model(self.sup.config, body.get("model"))
        prompt, messages = body.get("prompt"), body.get("messages")
        if prompt is not None and not isinstance(prompt, str):
            raise InvalidRequest("'prompt' must be a string")
        ids, most = await self.sup.tokenize_text(prompt, model=model, messages=messages,
                                                 add_special_tokens=body.get("add_special_tokens"),
                                                 add_generation_prompt=body.get("add_generation_prompt"))

        def answer() -> dict[str, Any]:
            return {"model": model, "tokens": ids, "count": len(ids), "max_model_len": most}

        return (200, answer()) if len(ids) <= INLINE_FLOATS else await self.json.encoded(answer)

    async def detokenize(self, _: dict[str, str], body: dict[str, Any]) -> tuple[int, Any]:
        model = default_model(self.sup.config, body.get("model"))
        tokens = body.get("tokens")
        if not isinstance(tokens, list):
            raise InvalidRequest("'tokens' must be a list of token ids")
        return 200, {"model": model, "prompt": await self.sup.detokenize(tokens, model=model)}

    async def tokenizer_info(self, params: dict[str, str], _: Any) -> tuple[int, Any]:
        """A generate model's tokenizer as vLLM's /tokenizer_info lists it (its Hugging Face tokenizer config's
        fields): its special tokens' texts (null where it has none), chat template and context."""
        model = default_model(self.sup.config, params.get("model"))
        if self.sup.config.model(model).kind != GENERATE:
            raise InvalidRequest(f"model {model!r} is not a generate model: /tokenizer_info describes a GGUF's "
                                 "tokenizer")
        tok = await self.sup.tokenizers.chat_loaded(model)
        text = lambda i: None if i is None else tok.tokenizer.id_to_token(i)  # noqa: E731
        return 200, {"model": model, "tokenizer_class": "GGUF", "bos_token": text(tok.bos_id),
                     "eos_token": text(tok.eos_id), "pad_token": None, "add_bos_token": tok.add_bos,
                     "chat_template": tok.template.source if tok.template is not None else None,
                     "model_max_length": await self.sup.model_len(model)}
