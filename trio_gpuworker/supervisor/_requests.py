"""What a request must satisfy on its way to a lane, past the checks of its arguments (its request class,
_api_requests.py): admission bounds, token-id checks (run off the loop), frame plans, what must fit the model
once tokenized. Every check raises a typed InvalidRequest (or RequestTooLarge), so no request can make a lane
send a frame the protocol refuses (a LocalProtocolError there would fail the lane, not the request).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .._errors import InvalidRequest, RequestTooLarge

# Ids of one int32 token; specials a tokenizer adds to one text.
ID_BYTES = 4
SPECIALS = 2


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
