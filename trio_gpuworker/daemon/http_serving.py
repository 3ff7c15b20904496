"""The serving routes (embeddings, completions, chat completions), mixed into `Api`.

They only parse the OpenAI-shaped bodies and shape the answers: the Supervisor checks, admits, tokenizes and
splits every request, once, with the same typed errors as the Python API.
"""

from __future__ import annotations

import base64
import json
import secrets
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import trio

from .._errors import InvalidRequest
from .http_common import Raw
from .http_fields import CONTENT_PART, MESSAGE, check_fields

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

    def _model(self, body: dict[str, Any], kinds: tuple[str, ...], what: str) -> str:
        model = body.get("model")
        if not isinstance(model, str):
            raise InvalidRequest("'model' must be a string")
        mc = self.sup.model_config(model)
        if mc.kind not in kinds:
            raise InvalidRequest(f"model {model!r} serves {mc.kind}, not {what}")
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
        """A non-empty list of strings (or, with `ids`, of token-id lists, checked by the Supervisor), capped at
        http.max_inputs."""
        if not isinstance(value, list) or not value or not (
                all(isinstance(x, str) for x in value) or (ids and all(isinstance(x, list) for x in value))):
            raise InvalidRequest(f"'{key}' must be a string or a non-empty list of strings"
                                 + (", a list of token ids or a non-empty list of them" if ids else ""))
        if len(value) > self.http.max_inputs:
            raise InvalidRequest(f"'{key}' has {len(value)} items; at most {self.http.max_inputs} per request "
                                 "(http.max_inputs)")
        return value

    async def embeddings(self, _: dict[str, str], body: dict[str, Any]) -> tuple[int, Any] | Raw:
        model = self._model(body, ("embedding",), "embeddings")
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

    def _generation_args(self, body: dict[str, Any]) -> dict[str, Any]:
        """What a completion takes; the fields it does not implement were refused by the route's spec."""
        both = body.get("max_tokens"), body.get("max_completion_tokens")
        if None not in both and both[0] != both[1]:
            raise InvalidRequest("max_tokens and max_completion_tokens differ: give one of them")
        max_tokens = both[1] if both[1] is not None else both[0]  # checked by the Supervisor, as for the Python API
        if max_tokens is None:
            max_tokens = DEFAULT_GEN_TOKENS
        user = body.get("user")
        if user is not None and not isinstance(user, str):
            raise InvalidRequest("'user' must be a string")
        grammar = body.get("grammar")
        if grammar is not None and not isinstance(grammar, str):
            raise InvalidRequest("'grammar' must be a string")
        return {"max_tokens": max_tokens, "grammar": grammar or None, "timeout": self.http.request_timeout_s}

    @staticmethod
    def _usage(out: dict[str, Any]) -> dict[str, int]:
        return {"prompt_tokens": out["n_prompt"], "completion_tokens": out["n_gen"],
                "total_tokens": out["n_prompt"] + out["n_gen"]}

    async def completions(self, _: dict[str, str], body: dict[str, Any]) -> tuple[int, Any]:
        model = self._model(body, ("generate",), "completions")
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if not isinstance(prompt, str) or not prompt:
            raise InvalidRequest("'prompt' must be a non-empty string (one prompt per request)")
        out = await self.sup.generate(prompt, model=model, **self._generation_args(body))
        return 200, {"id": f"cmpl-{secrets.token_hex(12)}", "object": "text_completion", "created": int(time.time()),
                     "model": model,
                     "choices": [{"index": 0, "text": out["text"], "logprobs": None,
                                  "finish_reason": out["finish_reason"]}],
                     "usage": self._usage(out)}

    async def chat_completions(self, _: dict[str, str], body: dict[str, Any]) -> tuple[int, Any]:
        model = self._model(body, ("generate",), "chat completions")
        raw = body.get("messages")
        if not isinstance(raw, list) or not raw:
            raise InvalidRequest("'messages' must be a non-empty list")
        messages: list[dict[str, str]] = []
        for i, m in enumerate(raw):
            if isinstance(m, dict):
                check_fields(m, MESSAGE, f"messages[{i}].")
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, list):  # content parts: text only
                for k, part in enumerate(content):
                    if isinstance(part, dict):
                        check_fields(part, CONTENT_PART, f"messages[{i}].content[{k}].")
                if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                           for p in content):
                    raise InvalidRequest(f"messages[{i}].content: only text parts are supported")
                content = "".join(p["text"] for p in content)
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(content, str):
                raise InvalidRequest(f"messages[{i}] must be {{role, content}} with string content")
            messages.append({"role": m["role"], "content": content})
        out = await self.sup.generate(model=model, messages=messages, **self._generation_args(body))
        return 200, {"id": f"chatcmpl-{secrets.token_hex(12)}", "object": "chat.completion",
                     "created": int(time.time()), "model": model,
                     "choices": [{"index": 0, "message": {"role": "assistant", "content": out["text"]},
                                  "logprobs": None, "finish_reason": out["finish_reason"]}],
                     "usage": self._usage(out)}
