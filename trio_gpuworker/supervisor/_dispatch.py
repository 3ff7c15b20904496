"""One EMBED_BATCH on the lane the router picks: what the Supervisor's API and its Batcher both send through,
so neither calls back into the other."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from .._errors import RemoteProtocolError
from ._admission import Router


class EmbedDispatch:
    """Sends checked token-id rows as one EMBED_BATCH and checks the VECTORS reply; remembers each model's dims."""

    def __init__(self, router: Router) -> None:
        self.router = router
        self.dims: dict[str, int] = {}

    async def __call__(self, rows: list[np.ndarray], *, model: str, pooling: str, normalize: bool,
                       timeout: float | None = None, on_settled: Callable[[], None] | None = None) -> np.ndarray:
        try:
            lane = self.router.pick(model)
        except BaseException:
            if on_settled is not None:
                on_settled()
            raise
        items = [{"id": i, "n_tokens": len(r)} for i, r in enumerate(rows)]
        raw = (np.concatenate(rows) if rows else np.zeros(0)).astype("<i4").tobytes()
        reply = await lane.call("EMBED_BATCH", {"model_ref": model, "pooling": pooling, "normalize": normalize,
                                                "items": items}, raw, timeout=timeout, on_settled=on_settled)
        n, dims = reply["n"], reply["dims"]
        if n != len(rows) or len(reply.raw or b"") != n * dims * 4:
            raise RemoteProtocolError(f"VECTORS: n={n} dims={dims} raw_len={len(reply.raw or b'')} "
                                      f"for {len(rows)} rows")
        self.dims[model] = dims
        return np.frombuffer(reply.raw, dtype="<f4").reshape(n, dims).copy()
