"""Token ids as requests carry them: int32 little-endian, back to back in one raw frame, each item's run named by
its length (docs/architecture.md, 'Requests and notifications'). Shared by every engine's server."""

from __future__ import annotations

import numpy as np

from ._errors import WorkerError


def split_rows(raw: bytes, lengths: list[int], allow_empty: bool = False) -> list[np.ndarray]:
    """The raw frame's ids cut into one int32 array per length; ERR invalid_request when they do not add up, or
    when an item is empty and `allow_empty` is False."""
    if len(raw) % 4 or sum(lengths) != len(raw) // 4:
        raise WorkerError("invalid_request", f"items name {sum(lengths)} ids, the raw frame holds {len(raw) / 4}")
    if not allow_empty and any(n == 0 for n in lengths):
        raise WorkerError("invalid_request", "an item has zero tokens")
    ids = np.frombuffer(raw, dtype="<i4").astype(np.int32)
    return np.split(ids, np.cumsum(lengths)[:-1]) if lengths else []


def prompt_ids(raw: bytes) -> np.ndarray:
    """A GENERATE's prompt: the whole raw frame as int32 ids."""
    return np.frombuffer(raw, dtype="<i4").astype(np.int32)


__all__ = ["prompt_ids", "split_rows"]
