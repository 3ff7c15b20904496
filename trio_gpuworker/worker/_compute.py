"""One dedicated thread for all tinygrad work.

tinygrad keeps per-process state that is not thread-safe (its CACHEDB sqlite connection refuses
other threads), and trio's thread pool may pick any thread, so every engine call goes through here.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

import outcome
import trio


class ComputeThread:
    def __init__(self, name: str = "tinygrad") -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], Callable[[outcome.Outcome], None]] | None] = (
            queue.SimpleQueue())
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            fn, done = job
            done(outcome.capture(fn))

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run fn(*args) on the compute thread; not cancellable once started (tinygrad cannot be interrupted)."""
        token = trio.lowlevel.current_trio_token()
        finished = trio.Event()
        box: list[outcome.Outcome] = []

        def done(result: outcome.Outcome) -> None:
            box.append(result)
            token.run_sync_soon(finished.set)

        self._jobs.put((lambda: fn(*args), done))
        with trio.CancelScope(shield=True):
            await finished.wait()
        return box[0].unwrap()

    def submit(self, fn: Callable[[], Any]) -> None:
        """Queue fn() ahead of later work, without waiting: a failure is left for that work to meet again."""
        self._jobs.put((fn, lambda result: None))

    def close(self) -> None:
        self._jobs.put(None)
