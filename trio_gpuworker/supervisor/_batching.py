"""Dynamic batching: concurrent embedding requests for one (model, pooling, normalize) share EMBED_BATCH requests.

A batch opens with its first request and is sent when it holds `max_items` rows, or `max_delay_s` after it
opened and a lane slot is free (at most one batch per lane serving the model is out at once, so under load
requests accumulate while the lanes work). Each caller gets its own rows back and keeps its own deadline.
A caller that goes away before its batch is sent is left out of it; if every caller of a sent batch goes
away, the batch is abandoned and the lane drops it before it reaches a worker.

    batcher = Batcher(BatchPolicy(max_items=256, max_delay_s=0.002), send=send_embed_batch, slots=router.serving)
    await nursery.start(batcher.run)
    vecs = await batcher.embed(rows, model=..., pooling="mean", normalize=True, timeout=30)
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import trio

from .._config import BatchPolicy
from .._errors import ClosedSupervisorError, DeadlineExceeded

log = logging.getLogger("trio_gpuworker.batching")

Key = tuple[str, str, bool]  # model, pooling, normalize


class Send(Protocol):
    def __call__(self, rows: list[np.ndarray], *, model: str, pooling: str, normalize: bool,
                 timeout: float | None = None, on_settled: Callable[[], None] | None = None,
                 on_started: Callable[[], None] | None = None) -> Awaitable[np.ndarray]: ...


@dataclass(eq=False)
class _Member:
    rows: list[np.ndarray]
    deadline: float
    done: trio.Event = field(default_factory=trio.Event)
    result: np.ndarray | None = None
    error: BaseException | None = None
    gone: bool = False
    batch: _Batch | None = None
    settled: Callable[[], None] | None = None  # its rows are no longer queued or in flight (idempotent)
    started: Callable[[], None] | None = None  # its batch was written to a worker (idempotent)

    def settle(self) -> None:
        if self.settled is not None:
            self.settled()


@dataclass(eq=False)
class _Batch:
    key: Key
    members: list[_Member] = field(default_factory=list)
    rows: int = 0
    full: trio.Event = field(default_factory=trio.Event)
    sent: bool = False
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)


class Batcher:
    def __init__(self, policy: BatchPolicy, send: Send, slots: Callable[[str], int],
                 ) -> None:
        """`send` runs one EMBED_BATCH; `slots(model)` is how many batches of a model may be out at once (its
        lanes). Observers (metrics) `subscribe`."""
        self.policy = policy
        self._send = send
        self._slots = slots
        self._limiters: dict[str, trio.CapacityLimiter] = {}
        self._open: dict[Key, _Batch] = {}
        self._nursery: trio.Nursery | None = None
        self._on_batch: list[Callable[[str, int, int], None]] = []
        self._on_drop: list[Callable[[str, int], None]] = []
        self.batches = 0
        self.dropped = 0

    def subscribe(self, *, on_batch: Callable[[str, int, int], None] | None = None,
                  on_drop: Callable[[str, int], None] | None = None) -> None:
        """`on_batch(model, rows, callers)` for each batch sent, `on_drop(model, callers)` for each abandoned."""
        if on_batch is not None:
            self._on_batch.append(on_batch)
        if on_drop is not None:
            self._on_drop.append(on_drop)

    @property
    def enabled(self) -> bool:
        return self.policy.enabled and self._nursery is not None

    def pending_rows(self, model: str) -> int:
        return sum(b.rows for k, b in self._open.items() if k[0] == model)

    async def run(self, *, task_status: trio.TaskStatus[Batcher] = trio.TASK_STATUS_IGNORED) -> None:
        """Owns the tasks that send batches. On cancellation, callers still waiting get ClosedSupervisorError."""
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                task_status.started(self)
                await trio.sleep_forever()
        finally:
            self._nursery = None

    async def embed(self, rows: list[np.ndarray], *, model: str, pooling: str, normalize: bool,
                    timeout: float | None = None, on_settled: Callable[[], Callable[[], None]] | None = None,
                    on_started: Callable[[], None] | None = None) -> np.ndarray:
        """`on_settled()`, when given, makes one idempotent callback per part of `rows`, called once the lane
        is done with that part (answered, failed, or drained after every caller of its batch left)."""
        if self._nursery is None:
            raise ClosedSupervisorError("the batcher is not running")
        if not rows:
            return await self._send(rows, model=model, pooling=pooling, normalize=normalize, timeout=timeout,
                                    on_settled=on_settled() if on_settled is not None else None,
                                    on_started=on_started)
        key: Key = (model, pooling, normalize)
        deadline = math.inf if timeout is None else trio.current_time() + timeout
        step = self.policy.max_items
        members = [self._join(key, rows[i:i + step], deadline, on_settled() if on_settled is not None else None,
                              on_started) for i in range(0, len(rows), step)]
        try:
            with trio.move_on_at(deadline):
                for m in members:
                    await m.done.wait()
        finally:
            for m in members:
                if not m.done.is_set():
                    self._leave(m)
        for m in members:
            if not m.done.is_set():
                raise DeadlineExceeded(f"embedding request on {model!r} did not finish within {timeout:g} s")
            if m.error is not None:
                raise m.error
        parts = [m.result for m in members]
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    # --- batches -------------------------------------------------------------------------------

    def _join(self, key: Key, rows: list[np.ndarray], deadline: float, settled: Callable[[], None] | None,
              started: Callable[[], None] | None = None) -> _Member:
        batch = self._open.get(key)
        if batch is not None and batch.rows + len(rows) > self.policy.max_items:
            self._close(batch)
            batch = None
        if batch is None:
            batch = self._open[key] = _Batch(key)
            assert self._nursery is not None
            self._nursery.start_soon(self._flush, batch)
        m = _Member(rows, deadline, batch=batch, settled=settled, started=started)
        batch.members.append(m)
        batch.rows += len(rows)
        if batch.rows >= self.policy.max_items:
            self._close(batch)
        return m

    def _close(self, batch: _Batch) -> None:
        """No more members: the batch is full (or being sent)."""
        if self._open.get(batch.key) is batch:
            del self._open[batch.key]
        batch.full.set()

    def _leave(self, m: _Member) -> None:
        m.gone = True
        batch = m.batch
        if batch is not None and batch.sent and all(x.gone for x in batch.members):
            batch.scope.cancel()  # the lane drops an abandoned request that has not reached its worker

    def _limiter(self, model: str) -> trio.CapacityLimiter:
        n = max(1, self._slots(model))
        limiter = self._limiters.get(model)
        if limiter is None:
            limiter = self._limiters[model] = trio.CapacityLimiter(n)
        elif limiter.total_tokens != n:
            limiter.total_tokens = n
        return limiter

    async def _flush(self, batch: _Batch) -> None:
        try:
            await self._flush_batch(batch)
        finally:  # cancelled (the batcher stopped) or failed: nobody may wait forever
            self._close(batch)
            self._finish(batch, error=ClosedSupervisorError("the batcher stopped"))

    async def _flush_batch(self, batch: _Batch) -> None:
        model, pooling, normalize = batch.key
        with trio.move_on_after(self.policy.max_delay_s):
            await batch.full.wait()
        async with self._limiter(model):
            self._close(batch)
            live = [m for m in batch.members if not m.gone]
            for m in batch.members:
                if m.gone:
                    m.settle()  # left before its batch was sent: nothing of it reaches a lane
            if len(live) < len(batch.members):
                self._dropped(model, len(batch.members) - len(live))
            if not live:
                return
            batch.members, batch.sent = live, True
            rows = [r for m in live for r in m.rows]
            left = max(m.deadline for m in live) - trio.current_time()
            self.batches += 1
            for on_batch in self._on_batch:
                on_batch(model, len(rows), len(live))

            def settled() -> None:
                for m in live:
                    m.settle()

            def started() -> None:
                for m in live:
                    if m.started is not None:
                        m.started()

            try:
                with batch.scope:
                    vecs = await self._send(rows, model=model, pooling=pooling, normalize=normalize,
                                            timeout=None if math.isinf(left) else max(left, 0.0), on_settled=settled,
                                            on_started=started)
            except Exception as exc:  # delivered to every caller of the batch, typed as the lane raised it
                self._finish(batch, error=exc)
                return
            if batch.scope.cancelled_caught:
                self._dropped(model, len(live))
                return
            at = 0
            for m in live:
                m.result = vecs[at:at + len(m.rows)]
                at += len(m.rows)
                m.done.set()

    def _finish(self, batch: _Batch, error: BaseException) -> None:
        for m in batch.members:
            if not batch.sent:
                m.settle()  # never handed to a lane (a sent batch's lane job settles its members)
            if not m.done.is_set():
                m.error = error
                m.done.set()

    def _dropped(self, model: str, n: int) -> None:
        self.dropped += n
        for on_drop in self._on_drop:
            on_drop(model, n)

    def stats(self) -> dict[str, Any]:
        return {"batches": self.batches, "dropped": self.dropped, "open": len(self._open)}
