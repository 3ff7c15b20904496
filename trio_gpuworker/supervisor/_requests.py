"""What a request must satisfy before it reaches a lane: argument checks, character caps, admission bounds and
frame plans. Every check raises a typed InvalidRequest (or RequestTooLarge), so no request can make a lane
send a frame the protocol refuses (a LocalProtocolError there would fail the lane, not the request).

Both the Python API and HTTP go through these, once, in the Supervisor.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .._config import ModelConfig
from .._errors import InvalidRequest, RequestTooLarge
from .._kinds import POOLINGS, DecoderRuntime, check_serves

# A WordPiece token covers at most 100 characters (longer words become one [UNK]); a text with more than 128
# characters per token of its truncation is mostly whitespace, so cutting it there never changes its ids in
# practice, and an 8 MB input costs the tokenizer 32 KiB of work instead of 8 MB.
CHARS_PER_TOKEN_CAP = 128
CHAT_TEMPLATE_BYTES = 64  # per message: what a chat template adds around its content, at most
# Ids of one int32 token; specials a tokenizer adds to one text.
ID_BYTES = 4
SPECIALS = 2


def serving_model(mc: ModelConfig, what: str) -> ModelConfig:
    """`mc`, if its kind serves the API request `what` (the registry's one kind check)."""
    check_serves(mc.id, mc.kind, what)
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
    """A request's pooling, or the model's (its `pooling` key, else its folder's: ModelConfig.defaults)."""
    if pooling is None:
        return mc.defaults[0]
    if not isinstance(pooling, str) or pooling not in POOLINGS:
        raise InvalidRequest(f"pooling must be one of {', '.join(POOLINGS)}, got {pooling!r}")
    return pooling


def check_normalize(normalize: Any, mc: ModelConfig) -> bool:
    if normalize is None:
        return mc.defaults[1]
    if not isinstance(normalize, bool):
        raise InvalidRequest(f"normalize must be a boolean, got {normalize!r}")
    return normalize


def check_max_tokens(max_tokens: Any, cap: int) -> int:
    """1..cap new tokens (cap: the model's context less one prompt token; past 64 the worker needs the LONG
    extension, checked where the request is sent)."""
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or not 1 <= max_tokens <= cap:
        raise InvalidRequest(f"max_tokens must be an integer in 1..{cap}, got {max_tokens!r}")
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


def gen_context(mc: ModelConfig) -> int:
    """The generation model's context in tokens (its worker's max_context)."""
    rc = mc.runtime_config
    assert isinstance(rc, DecoderRuntime), f"{mc.id} is a {mc.kind} model"
    return rc.context


def gen_char_cap(mc: ModelConfig) -> int:
    """Characters beyond which a prompt cannot fit the generation model's context."""
    return gen_context(mc) * CHARS_PER_TOKEN_CAP


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


def check_inputs(inputs: Any, what: str) -> tuple[bool, list[Any]]:
    """(is_ids, items): a list of strings, or a list of token-id sequences (each element checked later, off the
    loop, by `check_token_rows`). Mixing the two is refused."""
    if isinstance(inputs, str) or not isinstance(inputs, list | tuple):
        raise InvalidRequest(f"{what} must be a list of strings or a list of token-id lists")
    if not inputs or all(isinstance(t, str) for t in inputs):
        return False, list(inputs)
    if all(isinstance(t, list | tuple | np.ndarray) for t in inputs):
        return True, list(inputs)
    bad = next(i for i, t in enumerate(inputs) if not isinstance(t, str))
    raise InvalidRequest(f"{what}[{bad}] is {type(inputs[bad]).__name__}: give every input as a string, or every "
                         "input as a list of token ids")


def check_token_rows(rows: list[Any], vocab: int, what: str) -> list[np.ndarray]:
    """Token-id inputs: each a non-empty sequence of ints within the tokenizer's vocabulary. O(ids): run it off
    the event loop."""
    out = []
    for i, r in enumerate(rows):
        if isinstance(r, np.ndarray):
            if r.ndim != 1 or not np.issubdtype(r.dtype, np.integer):
                raise InvalidRequest(f"{what}[{i}] must be a 1-D array of token ids")
            bad = np.flatnonzero((r < 0) | (r >= vocab))[:1].tolist()
            ids = r
        else:
            bad = [k for k, t in enumerate(r) if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab]
            ids = r if bad else np.asarray(r, dtype=np.int64)
        if bad:
            raise InvalidRequest(f"{what}[{i}] holds {repr(r[bad[0]])[:40]} at position {bad[0]}: token ids are "
                                 f"integers in 0..{vocab - 1}")
        if not len(ids):
            raise InvalidRequest(f"{what}[{i}] is an empty list of token ids")
        out.append(np.asarray(ids, dtype=np.int32))
    return out


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


def cut_dimensions(vecs: np.ndarray, dimensions: int | None, normalize: bool, model: str) -> np.ndarray:
    """The leading `dimensions` of each vector, renormalized when the model normalizes (as sentence-transformers'
    truncate_dim does)."""
    if dimensions is None:
        return vecs
    if dimensions > vecs.shape[1]:
        raise InvalidRequest(f"dimensions {dimensions} exceeds the {vecs.shape[1]} dimensions of model {model!r}")
    cut = np.ascontiguousarray(vecs[:, :dimensions])
    if normalize:
        norms = np.linalg.norm(cut, axis=1, keepdims=True)
        cut /= np.where(norms > 0, norms, 1.0)
    return cut


def too_many_tokens(what: str, n: int | None, cap: int, model: str) -> RequestTooLarge:
    """`n` None: more than the truncation's cap (the tokenizer stopped counting there)."""
    size = f"{n} tokens" if n is not None else f"more than {cap} tokens"
    return RequestTooLarge(f"{what} is {size}; model {model!r} takes at most {cap} (send truncate=true to cut it)")


def refuse_long_texts(texts: Sequence[str], names: Sequence[str], cap: int, model: str) -> None:
    """With truncate=false, a text longer than the character cap is refused rather than tokenized whole."""
    for t, name in zip(texts, names, strict=True):
        if len(t) > cap:
            raise RequestTooLarge(f"{name} has {len(t)} characters; with truncate=false model {model!r} takes at "
                                  f"most {cap} (max_tokens x {CHARS_PER_TOKEN_CAP})")


def check_rerank_fit(lengths: Sequence[int | None], *, pair: bool, specials: int, cap: int, model: str) -> None:
    """With truncate=false: the query (lengths[0]) and each document must fit the model whole, as the pair
    [CLS] query [SEP] doc [SEP] of a cross-encoder (`pair`) or each text with [CLS]/[SEP] for a bi-encoder.
    A length of None is more than `cap` (the tokenizer stopped counting)."""
    names = ["query", *(f"documents[{i}]" for i in range(len(lengths) - 1))]
    q = lengths[0]
    for i, n in enumerate(lengths):
        if pair and i:
            total = None if q is None or n is None else q + n + specials
            if total is None or total > cap:
                raise too_many_tokens(f"{names[i]} with the query", total, cap, model)
        elif not pair and (n is None or n + specials > cap):
            raise too_many_tokens(names[i], None if n is None else n + specials, cap, model)
