"""/tokenize and /detokenize (vLLM's shape) for every model kind: the daemon's own tokenizers, no worker."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .._api_requests import ApiRequest
from .._errors import InvalidRequest
from .http_common import Raw
from .http_serving import INLINE_FLOATS

if TYPE_CHECKING:
    from ..supervisor import Supervisor
    from .http_body import JsonThreads


class TokenRoutes:
    def __init__(self, sup: Supervisor, json: JsonThreads) -> None:
        self.sup, self.json = sup, json

    async def tokenize(self, _: dict[str, str], body: dict[str, Any]) -> tuple[int, Any] | Raw:
        model = ApiRequest.json_model(body, self.sup.config)
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
        model = ApiRequest.json_model(body, self.sup.config)
        tokens = body.get("tokens")
        if not isinstance(tokens, list):
            raise InvalidRequest("'tokens' must be a list of token ids")
        return 200, {"model": model, "prompt": await self.sup.detokenize(tokens, model=model)}
