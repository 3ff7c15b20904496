"""One dedicated thread for all of an engine's work (docs/engines.md, 'Threads').

tinygrad keeps per-process state that is not thread-safe (its CACHEDB sqlite connection refuses other threads),
and trio's thread pool may pick any thread, so every engine call goes through here; an engine of one's own gets the
same one thread, so whatever it keeps per thread (a device context) stays put. In the tinygrad worker, two
exceptions, on CPU and only while this thread is `idle`: an ingress drain (worker/_server.py) and the free of a host
echo's consumed inputs (worker/_dataplane.py) run on the event loop, and tinygrad's allocator is still touched by
one thread at a time.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

import outcome
import trio


class ComputeThread:
    def __init__(self, name: str = "tinygrad", on_busy: Callable[[bool], None] | None = None) -> None:
        """`on_busy(True)` before each job, `on_busy(False)` after (the worker's core ledger, _cores.py)."""
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], Callable[[outcome.Outcome], None]] | None] = (
            queue.SimpleQueue())
        # jobs queued by the event loop (its thread alone submits) and jobs finished (this thread alone counts): each
        # counter has one writer, so `idle` needs no lock
        self._submitted = 0
        self._finished = 0
        self._on_busy = on_busy
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    @property
    def idle(self) -> bool:
        """Nothing runs on this thread and nothing waits for it. Asked on the thread that submits, the answer holds
        until that thread submits again: work it then does itself cannot overlap a job here."""
        return self._finished == self._submitted

    def _put(self, job: tuple[Callable[[], Any], Callable[[outcome.Outcome], None]]) -> None:
        self._submitted += 1
        self._jobs.put(job)

    def _loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            fn, done = job
            if self._on_busy is not None:
                self._on_busy(True)
            result = outcome.capture(fn)
            if self._on_busy is not None:
                self._on_busy(False)
            # counted before its caller hears of it: once `run` returns, the job no longer keeps this thread busy
            # (what follows here, `done`, only hands the result over)
            self._finished += 1
            done(result)

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run fn(*args) on the compute thread; not cancellable once started (tinygrad cannot be interrupted)."""
        token = trio.lowlevel.current_trio_token()
        finished = trio.Event()
        box: list[outcome.Outcome] = []

        def done(result: outcome.Outcome) -> None:
            box.append(result)
            token.run_sync_soon(finished.set)

        self._put((lambda: fn(*args), done))
        with trio.CancelScope(shield=True):
            await finished.wait()
        return box[0].unwrap()

    def submit(self, fn: Callable[[], Any]) -> None:
        """Queue fn() ahead of later work, without waiting: a failure is left for that work to meet again."""
        self._put((fn, lambda result: None))

    def close(self) -> None:
        self._jobs.put(None)
