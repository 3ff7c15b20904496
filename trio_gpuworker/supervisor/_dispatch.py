"""One embedding job on the lanes the router picks: what the Supervisor's API and its Batcher both send through,
so neither calls back into the other. A job large enough to share is spread over the model's idle replicas; each
part reaches its lane, and has its VECTORS checked, through _route.send like every other request kind."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import trio

from .._api_requests import embed_batch
from ._admission import Router
from ._route import EMBEDDINGS, send

if TYPE_CHECKING:
    from ._lane import Lane

# A part smaller than this is not worth a second worker: a split costs each worker a round trip and smaller
# micro-batches. Either bound is enough, since work grows with tokens: eight short sentences make a part, and so
# do two rows of the 256 bucket (a batch of eight such rows ran on one core before this bound: 0.6x torch).
MIN_ROWS_PER_REPLICA = 8
MIN_TOKENS_PER_REPLICA = 256


def replicas_for(lengths: list[int]) -> int:
    """How many replicas a job of rows of these token counts is worth (at least 1, at most one per row)."""
    return max(1, min(len(lengths), max(len(lengths) // MIN_ROWS_PER_REPLICA, sum(lengths) // MIN_TOKENS_PER_REPLICA)))


def split_rows(lengths: list[int], parts: int) -> list[np.ndarray]:
    """Row indices for `parts` workers: dealt in order of length, so each part gets the same mix of lengths
    (and of length buckets, hence of work)."""
    order = np.argsort(np.asarray(lengths), kind="stable")
    return [np.sort(order[k::parts]) for k in range(parts)]


class EmbedDispatch:
    """Sends checked token-id rows as EMBED_BATCH requests; remembers each model's dims."""

    def __init__(self, router: Router) -> None:
        self.router = router
        self.dims: dict[str, int] = {}

    async def __call__(self, rows: list[np.ndarray], *, model: str, pooling: str, normalize: bool,
                       timeout: float | None = None, on_settled: Callable[[], None] | None = None,
                       on_started: Callable[[], None] | None = None) -> np.ndarray:
        try:
            idle = self.router.idle(model)[: replicas_for([len(r) for r in rows])]
            lanes = idle if len(idle) > 1 else [self.router.pick(model)]
        except BaseException:
            if on_settled is not None:
                on_settled()
            raise
        if len(lanes) == 1:
            return await self._one(lanes[0], rows, model, pooling, normalize, timeout, on_settled, on_started)
        return await self._spread(lanes, rows, model, pooling, normalize, timeout, on_settled, on_started)

    async def _spread(self, lanes: list[Lane], rows: list[np.ndarray], model: str, pooling: str, normalize: bool,
                      timeout: float | None, on_settled: Callable[[], None] | None,
                      on_started: Callable[[], None] | None) -> np.ndarray:
        """One part per lane, at once. The first failure is the job's (typed, not a group) and cancels the
        other parts; `on_settled` fires once the last part has settled."""
        parts = split_rows([len(r) for r in rows], len(lanes))
        pending = len(parts)

        def settled() -> None:
            nonlocal pending
            pending -= 1
            if pending == 0 and on_settled is not None:
                on_settled()

        out: list[np.ndarray | None] = [None] * len(parts)
        errors: list[Exception] = []

        async def part(k: int, lane: Lane, cancel: trio.CancelScope) -> None:
            try:
                out[k] = await self._one(lane, [rows[i] for i in parts[k]], model, pooling, normalize, timeout,
                                         settled, on_started)
            except Exception as exc:
                errors.append(exc)
                cancel.cancel()

        async with trio.open_nursery() as nursery:
            for k, lane in enumerate(lanes):
                nursery.start_soon(part, k, lane, nursery.cancel_scope)
        if errors:
            raise errors[0]
        vecs = np.empty((len(rows), self.dims[model]), dtype=np.float32)
        for idx, v in zip(parts, out, strict=True):
            vecs[idx] = v
        return vecs

    async def _one(self, lane: Lane, rows: list[np.ndarray], model: str, pooling: str, normalize: bool,
                   timeout: float | None, on_settled: Callable[[], None] | None,
                   on_started: Callable[[], None] | None = None) -> np.ndarray:
        reply = await send(lane, embed_batch(model, pooling, normalize, rows), EMBEDDINGS, timeout=timeout,
                           on_settled=on_settled, on_started=on_started)
        self.dims[model] = reply.dims
        return np.frombuffer(reply.raw, dtype="<f4").reshape(reply.n, reply.dims).copy()
