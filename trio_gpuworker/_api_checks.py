"""The checks of an API request's values, each raising a typed InvalidRequest (or RequestTooLarge) naming the
field: what the request classes (_api_requests.py) are built from. Pure: no I/O, no tokenizer.

Also the fields an HTTP body accepts only at the one value that leaves the answer unchanged (OpenAI's `n: 1`,
...): a `Neutral` check returns None for that value, else why not (docs/http-api.md, 'Fields').
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from ._config import ModelConfig
from ._errors import SHOWN_CHARS, InvalidRequest, RequestTooLarge, UnsupportedField
from ._kinds import POOLINGS, DecoderRuntime

Neutral = Callable[[Any], "str | None"]
Spec = Mapping[str, "Neutral | None"]  # a body's fields: None, implemented; a Neutral, accepted at one value

# A WordPiece token covers at most 100 characters (longer words become one [UNK]); a text with more than 128
# characters per token of its truncation is mostly whitespace, so cutting it there never changes its ids in
# practice, and an 8 MB input costs the tokenizer 32 KiB of work instead of 8 MB.
CHARS_PER_TOKEN_CAP = 128
MAX_STOPS = 4  # stop strings per request, as OpenAI allows
MAX_STOP_CHARS = 256
SEED_BOUND = 1 << 64


# --- body fields ----------------------------------------------------------------------------------


def _number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def short(v: Any) -> str:
    """A value as an error shows it: JSON for a scalar, cut at SHOWN_CHARS."""
    text = json.dumps(v) if isinstance(v, bool | int | float | str | type(None)) else repr(v)
    return text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS] + "..."


def only(value: Any, why: str) -> Neutral:
    """Accepted at `value` alone (a number compares as a number, a bool only as that bool)."""

    def check(v: Any) -> str | None:
        same = v == value and (_number(v) if _number(value) else type(v) is type(value))
        return None if same else f"= {short(v)} is not supported: {why}"

    return check


def never(why: str) -> Neutral:
    return lambda v: f"is not supported: {why}"


def check_fields(body: Mapping[str, Any], spec: Spec, where: str = "") -> None:
    """UnsupportedField for a key `spec` does not take, or a value its Neutral check refuses (null: left out)."""
    for key, value in body.items():
        if key not in spec:
            raise UnsupportedField(where + key, "is not a field this daemon implements")
        check = spec[key]
        if check is not None and value is not None and (reason := check(value)) is not None:
            raise UnsupportedField(where + key, reason)


# --- values ---------------------------------------------------------------------------------------


def check_text(value: Any, what: str) -> str | None:
    if value is not None and not isinstance(value, str):
        raise InvalidRequest(f"'{what}' must be a string")
    return value


def check_choice(value: Any, what: str, choices: Sequence[str]) -> str:
    """One of `choices`; None: the first."""
    if value is None:
        return choices[0]
    if not isinstance(value, str) or value not in choices:
        raise InvalidRequest(f"{what} must be {' or '.join(map(repr, choices))}, got {value!r}")
    return value


def check_flag(value: Any, what: str, default: bool) -> bool:
    if value is None:
        return default
    if not isinstance(value, bool):
        raise InvalidRequest(f"{what} must be a boolean, got {value!r}")
    return value


def check_count(value: Any, what: str) -> int | None:
    """An optional positive integer (None: not given)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidRequest(f"{what} must be an integer >= 1, got {value!r}")
    return value


def check_number(v: Any, what: str, lo: float, hi: float) -> float | None:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int | float) or math.isnan(v) or not lo <= v <= hi:
        raise InvalidRequest(f"{what} must be a number in {lo:g}..{hi:g}, got {v!r}")
    return float(v)


def check_integer(v: Any, what: str, lo: int, hi: int) -> int | None:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise InvalidRequest(f"{what} must be an integer in {lo}..{hi}, got {v!r}")
    return v


def check_texts(texts: Any, what: str) -> list[str]:
    if isinstance(texts, str) or not isinstance(texts, list | tuple):
        raise InvalidRequest(f"{what} must be a list of strings")
    if bad := [i for i, t in enumerate(texts) if not isinstance(t, str)]:
        raise InvalidRequest(f"{what}[{bad[0]}] is {type(texts[bad[0]]).__name__}, not a string")
    return list(texts)


def check_inputs(inputs: Any, what: str) -> tuple[bool, list[Any]]:
    """(is_ids, items): a list of strings, or a list of token-id sequences (each element checked later, off the
    loop, by the Supervisor's `check_token_rows`). Mixing the two is refused."""
    if isinstance(inputs, str) or not isinstance(inputs, list | tuple):
        raise InvalidRequest(f"{what} must be a list of strings or a list of token-id lists")
    if not inputs or all(isinstance(t, str) for t in inputs):
        return False, list(inputs)
    if all(isinstance(t, list | tuple | np.ndarray) for t in inputs):
        return True, list(inputs)
    bad = next(i for i, t in enumerate(inputs) if not isinstance(t, str))
    raise InvalidRequest(f"{what}[{bad}] is {type(inputs[bad]).__name__}: give every input as a string, or every "
                         "input as a list of token ids")


def check_pooling(pooling: Any, mc: ModelConfig) -> str:
    """A request's pooling, or the model's (its `pooling` key, else its folder's: ModelConfig.defaults)."""
    if pooling is None:
        return mc.defaults[0]
    if not isinstance(pooling, str) or pooling not in POOLINGS:
        raise InvalidRequest(f"pooling must be one of {', '.join(POOLINGS)}, got {pooling!r}")
    return pooling


def check_normalize(normalize: Any, mc: ModelConfig) -> bool:
    return check_flag(normalize, "normalize", mc.defaults[1])


def check_dimensions(dimensions: Any, mc: ModelConfig) -> int | None:
    """`dimensions` must be one of the Matryoshka sizes the model's configuration declares."""
    if dimensions is None:
        return None
    if isinstance(dimensions, bool) or not isinstance(dimensions, int):
        raise InvalidRequest(f"dimensions must be an integer, got {dimensions!r}")
    if not mc.matryoshka_dims:
        raise InvalidRequest(f"model {mc.id!r} declares no Matryoshka sizes (models.{mc.id}.matryoshka_dims): "
                             "its vectors cannot be shortened")
    if dimensions not in mc.matryoshka_dims:
        raise InvalidRequest(f"dimensions must be one of {', '.join(map(str, mc.matryoshka_dims))} for model "
                             f"{mc.id!r}, got {dimensions}")
    return dimensions


def check_max_tokens(max_tokens: Any, cap: int) -> int:
    """1..cap new tokens (cap: the model's context less one prompt token; past 64 the worker needs the LONG
    extension, checked where the request is sent)."""
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or not 1 <= max_tokens <= cap:
        raise InvalidRequest(f"max_tokens must be an integer in 1..{cap}, got {max_tokens!r}")
    return max_tokens


def check_messages(messages: Any) -> list[dict[str, str]]:
    """{role, content} strings, and a participant's `name` (a string) where given: the chat template sees it."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("messages must be a non-empty list of {role, content} strings")
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise InvalidRequest(f"messages[{i}] must be {{role, content}} with string values")
        if m.get("name") is not None and not isinstance(m["name"], str):
            raise InvalidRequest(f"messages[{i}].name must be a string")
    return [{"role": m["role"], "content": m["content"], **({"name": m["name"]} if m.get("name") is not None else {})}
            for m in messages]


def check_stops(stop: Any) -> list[str]:
    stops = [stop] if isinstance(stop, str) else stop
    if stops is None:
        return []
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise InvalidRequest("stop must be a non-empty string or a list of them")
    if len(stops) > MAX_STOPS:
        raise InvalidRequest(f"stop has {len(stops)} strings; at most {MAX_STOPS}")
    if any(len(s) > MAX_STOP_CHARS for s in stops):
        raise InvalidRequest(f"a stop string is longer than {MAX_STOP_CHARS} characters")
    check_unicode(stops, "stop")
    return stops


def check_unicode(texts: Sequence[str], what: str) -> None:
    """A lone surrogate (JSON allows "\\ud800") is not text: refuse it before a tokenizer sees it."""
    for i, t in enumerate(texts):
        try:
            t.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise InvalidRequest(f"{what}[{i}] is not valid Unicode: a lone surrogate at character {exc.start}") \
                from exc


# --- a model's bounds -----------------------------------------------------------------------------


def char_cap(mc: ModelConfig) -> int:
    """Characters of one input that tokenization at the model's truncation can use."""
    return mc.max_tokens * CHARS_PER_TOKEN_CAP


def gen_context(mc: ModelConfig) -> int:
    """The generation model's context in tokens (its worker's max_context)."""
    rc = mc.runtime_config
    assert isinstance(rc, DecoderRuntime), f"{mc.id} is a {mc.kind} model"
    return rc.context


def gen_char_cap(mc: ModelConfig) -> int:
    """Characters beyond which a prompt cannot fit the generation model's context."""
    return gen_context(mc) * CHARS_PER_TOKEN_CAP


def refuse_long_texts(texts: Sequence[str], names: Sequence[str], cap: int, model: str) -> None:
    """With truncate=false, a text longer than the character cap is refused rather than tokenized whole."""
    for t, name in zip(texts, names, strict=True):
        if len(t) > cap:
            raise RequestTooLarge(f"{name} has {len(t)} characters; with truncate=false model {model!r} takes at "
                                  f"most {cap} (max_tokens x {CHARS_PER_TOKEN_CAP})")
