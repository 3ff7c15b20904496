"""Orders each model's requests around a change of its settings (a reload): the requests admitted before the
change finish as they began (tokenized with the old settings, served by a worker loaded with them); those that
come during it wait until the new settings are in place, the model table, the tokenizers and the lanes' queued
reloads included. See docs/architecture.md, "Reload"."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import AsyncIterator, Collection
from contextlib import asynccontextmanager

import trio

from .._errors import DeadlineExceeded


class ModelGate:
    def __init__(self) -> None:
        self._serving: Counter[str] = Counter()  # model -> its requests admitted and not yet done
        self._changing: set[str] = set()
        self._moved = trio.lowlevel.ParkingLot()  # woken whenever either of the above changes

    def serving_now(self, model: str) -> int:
        return self._serving[model]

    @asynccontextmanager
    async def serving(self, model: str, deadline: float = math.inf) -> AsyncIterator[None]:
        """One request of `model`, from its admission to its last reply. It waits while the model's settings
        change (DeadlineExceeded at `deadline`)."""
        while model in self._changing:
            with trio.move_on_at(deadline):
                await self._moved.park()
            if model in self._changing and trio.current_time() >= deadline:
                raise DeadlineExceeded(f"{model!r} was reloading until the request's deadline")
        self._serving[model] += 1
        try:
            yield
        finally:
            self._serving[model] -= 1
            self._moved.unpark_all()

    @asynccontextmanager
    async def changing(self, models: Collection[str]) -> AsyncIterator[None]:
        """While the block runs no new request of `models` starts; it starts once the ones admitted have ended, and
        once another change of any of them has ended (two changes of one model go one after the other: the second
        must also wait for the requests admitted before it, which the first is still waiting for)."""
        models = set(models)
        while models & self._changing:
            await self._moved.park()
        self._changing |= models
        try:
            while any(self._serving[m] for m in models):
                await self._moved.park()
            yield
        finally:
            self._changing -= models
            self._moved.unpark_all()


__all__ = ["ModelGate"]
