"""What a request must satisfy before it reaches a lane: argument checks, character caps, admission bounds and
frame plans. Every check raises a typed InvalidRequest (or RequestTooLarge), so no request can make a lane
send a frame the protocol refuses (a LocalProtocolError there would fail the lane, not the request).

Both the Python API and HTTP go through these, once, in the Supervisor.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .._config import POOLINGS, ModelConfig
from .._errors import InvalidRequest, RequestTooLarge

MAX_GEN_TOKENS = 64
# A WordPiece token covers at most 100 characters (longer words become one [UNK]); a text with more than 128
# characters per token of its truncation is mostly whitespace, so cutting it there never changes its ids in
# practice, and an 8 MB input costs the tokenizer 32 KiB of work instead of 8 MB.
CHARS_PER_TOKEN_CAP = 128
GEN_CONTEXT_DEFAULT = 2048  # the llama worker's max_context unless runtime_config says otherwise
CHAT_TEMPLATE_BYTES = 64  # per message: what a chat template adds around its content, at most
# Ids of one int32 token; specials a tokenizer adds to one text.
ID_BYTES = 4
SPECIALS = 2


def encoder_model(mc: ModelConfig, kinds: tuple[str, ...], what: str) -> ModelConfig:
    if mc.kind not in kinds:
        raise InvalidRequest(f"model {mc.id!r} serves {mc.kind}, not {what}")
    return mc


def check_texts(texts: Any, what: str, *, allow_empty: bool = True) -> list[str]:
    if isinstance(texts, str) or not isinstance(texts, list | tuple):
        raise InvalidRequest(f"{what} must be a list of strings")
    if bad := [i for i, t in enumerate(texts) if not isinstance(t, str)]:
        raise InvalidRequest(f"{what}[{bad[0]}] is {type(texts[bad[0]]).__name__}, not a string")
    if not texts and not allow_empty:
        raise InvalidRequest(f"{what} must not be empty")
    return list(texts)


def check_pooling(pooling: Any, mc: ModelConfig) -> str:
    if pooling is None:
        return mc.pooling
    if not isinstance(pooling, str) or pooling not in POOLINGS:
        raise InvalidRequest(f"pooling must be one of {', '.join(POOLINGS)}, got {pooling!r}")
    return pooling


def check_normalize(normalize: Any, mc: ModelConfig) -> bool:
    if normalize is None:
        return mc.normalize
    if not isinstance(normalize, bool):
        raise InvalidRequest(f"normalize must be a boolean, got {normalize!r}")
    return normalize


def check_max_tokens(max_tokens: Any) -> int:
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or not 1 <= max_tokens <= MAX_GEN_TOKENS:
        raise InvalidRequest(f"max_tokens must be an integer in 1..{MAX_GEN_TOKENS}, got {max_tokens!r}")
    return max_tokens


def check_messages(messages: Any) -> list[dict[str, str]]:
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("messages must be a non-empty list of {role, content} strings")
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise InvalidRequest(f"messages[{i}] must be {{role, content}} with string values")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def char_cap(mc: ModelConfig) -> int:
    """Characters of one input that tokenization at the model's truncation can use."""
    return mc.max_tokens * CHARS_PER_TOKEN_CAP


def gen_char_cap(mc: ModelConfig) -> int:
    """Characters beyond which a prompt cannot fit the generation model's context."""
    ctx = mc.runtime_config.get("max_context", GEN_CONTEXT_DEFAULT)
    return (ctx if isinstance(ctx, int) and ctx > 0 else GEN_CONTEXT_DEFAULT) * CHARS_PER_TOKEN_CAP


def cap_texts(texts: list[str], cap: int) -> list[str]:
    return [t if len(t) <= cap else t[:cap] for t in texts]


def _utf8_len(t: str) -> int:
    return len(t.encode("utf-8", "surrogatepass"))


def id_bytes_bound(texts: Sequence[str], per_text_tokens: int | None = None) -> int:
    """An upper bound of the token-id bytes of `texts`: a token covers at least one UTF-8 byte, and the
    truncation caps each text. Cheap: a text longer than its cap in characters is not encoded."""
    n = 0
    for t in texts:
        if per_text_tokens is not None and len(t) >= per_text_tokens:
            n += per_text_tokens
        else:
            n += min(_utf8_len(t) + SPECIALS, per_text_tokens or 1 << 62)
    return ID_BYTES * n


def check_unicode(texts: Sequence[str], what: str) -> None:
    """A lone surrogate (JSON allows "\\ud800") is not text: refuse it before a tokenizer sees it."""
    for i, t in enumerate(texts):
        try:
            t.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise InvalidRequest(f"{what}[{i}] is not valid Unicode: a lone surrogate at character {exc.start}") \
                from exc


def plan_chunks(lengths: Sequence[int], *, max_items: int, max_bytes: int, fixed: int = 0,
                what: str = "input") -> list[tuple[int, int]]:
    """[start, end) slices of rows, in order, each at most `max_items` rows whose ids (plus `fixed` ids sent
    with every chunk, e.g. a rerank query) fit `max_bytes`."""
    chunks: list[tuple[int, int]] = []
    start, used = 0, fixed
    for i, n in enumerate(lengths):
        if ID_BYTES * (fixed + n) > max_bytes:
            raise RequestTooLarge(f"{what}[{i}] needs {ID_BYTES * (fixed + n)} bytes of token ids; a frame holds "
                                  f"{max_bytes} (daemon.max_frame_mib)")
        if i > start and (i - start >= max_items or ID_BYTES * (used + n) > max_bytes):
            chunks.append((start, i))
            start, used = i, fixed
        used += n
    if start < len(lengths):
        chunks.append((start, len(lengths)))
    return chunks


def check_rows(rows: Any, what: str = "rows") -> list[np.ndarray]:
    if not isinstance(rows, list | tuple):
        raise InvalidRequest(f"{what} must be a list of 1-D integer arrays")
    out = []
    for i, r in enumerate(rows):
        a = np.asarray(r)
        if a.ndim != 1 or not (np.issubdtype(a.dtype, np.integer) or a.size == 0):
            raise InvalidRequest(f"{what}[{i}] must be a 1-D integer array")
        if a.size and (a.min() < 0 or a.max() >= 1 << 31):
            raise InvalidRequest(f"{what}[{i}] holds ids outside 0..2^31-1")
        out.append(a)
    return out
