"""Which body fields each route takes. A field the daemon does not implement gets 400 `unsupported_field` naming
it: nothing is accepted and ignored.

A route's spec maps each field it knows to None (implemented: the handler reads and checks it) or to a check of
a field the daemon does not implement but accepts at the one value that leaves the answer unchanged (OpenAI's
`temperature: 0` for greedy decoding, `n: 1`, ...): the check returns None for that value, else why not.
A JSON null is the field left out, for every field.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

from .http_common import HttpError

Check = Callable[[Any], "str | None"]
Spec = Mapping[str, "Check | None"]
SHOWN_CHARS = 64  # of a field name in an error: a body may carry any key


class UnsupportedField(HttpError):
    """400: a field (or a value of it) this daemon does not implement. `param` names it, as OpenAI's errors do."""

    def __init__(self, field: str, reason: str) -> None:
        self.param = field if len(field) <= SHOWN_CHARS else field[:SHOWN_CHARS] + "..."
        super().__init__(400, "unsupported_field", f"{self.param!r} {reason}")

    def to_wire(self) -> dict[str, Any]:
        return {**super().to_wire(), "param": self.param}


def _number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def only(value: Any, why: str) -> Check:
    """Accepted at `value` alone (a number compares as a number, a bool only as that bool)."""

    def check(v: Any) -> str | None:
        same = v == value and (_number(v) if _number(value) else type(v) is type(value))
        return None if same else f"= {_short(v)} is not supported: {why}"

    return check


def never(why: str) -> Check:
    return lambda v: f"is not supported: {why}"


def _short(v: Any) -> str:
    text = json.dumps(v) if isinstance(v, bool | int | float | str | type(None)) else repr(v)
    return text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS] + "..."


def check_fields(body: Mapping[str, Any], spec: Spec, where: str = "") -> None:
    for key, value in body.items():
        if key not in spec:
            raise UnsupportedField(where + key, "is not a field this daemon implements")
        check = spec[key]
        if check is not None and value is not None and (reason := check(value)) is not None:
            raise UnsupportedField(where + key, reason)


_GENERATION: dict[str, Check | None] = {
    "model": None, "max_tokens": None, "grammar": None, "stream": None, "stream_options": None,
    "temperature": None, "top_p": None, "top_k": None, "seed": None, "stop": None, "logprobs": None,
    "user": None,  # an end-user identifier for the caller's records: the answer is the same whatever it is
    "n": only(1, "one choice per request"),
    "frequency_penalty": only(0, "repetition penalties are not implemented"),
    "presence_penalty": only(0, "repetition penalties are not implemented"),
    "logit_bias": only({}, "logit biases are not implemented"),
}
COMPLETIONS: Spec = {
    **_GENERATION, "prompt": None,
    "best_of": only(1, "one candidate per request"),
    "echo": only(False, "the prompt is not echoed"),
    "suffix": never("insertion is not implemented"),
}
CHAT: Spec = {
    **_GENERATION, "messages": None, "max_completion_tokens": None, "top_logprobs": None,
    "tools": only([], "tool calls are not implemented"),
    "tool_choice": only("none", "tool calls are not implemented"),
    "response_format": only({"type": "text"}, "structured output is not implemented (see 'grammar')"),
}
MESSAGE: Spec = {"role": None, "content": None}
CONTENT_PART: Spec = {"type": None, "text": None}
EMBEDDINGS: Spec = {"model": None, "input": None, "encoding_format": None, "dimensions": None, "user": None,
                    "truncate": None, "normalize": None, "pooling": None}
RERANK: Spec = {  # /v1/rerank and /v2/rerank (Cohere and Jina)
    "model": None, "query": None, "documents": None, "top_n": None, "return_documents": None,
    "max_tokens_per_doc": None, "truncate": None,
    "priority": only(0, "requests are served in arrival order"),
}
RERANK_TEI: Spec = {  # /rerank (text-embeddings-inference)
    "model": None, "query": None, "texts": None, "raw_scores": None, "return_text": None, "truncate": None,
    "truncation_direction": lambda v: None if v in ("right", "Right") else
    f"= {_short(v)} is not supported: inputs are truncated on the right",
}
TOKENIZE: Spec = {"model": None, "prompt": None, "messages": None, "add_special_tokens": None,
                  "add_generation_prompt": None}
DETOKENIZE: Spec = {"model": None, "tokens": None}
ADMIN: Mapping[str, Spec] = {"reload": {"stream": None}, "load": {"model": None, "stream": None},
                             "unload": {"model": None}, "drain": {"wait": None}, "resume": {}, "config": {}}
