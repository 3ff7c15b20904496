"""What the daemon says while its lanes start, so that a first start is never minutes of silence.

The listeners are up before any worker is ready (requests for a model none of its lanes serves yet get 503
`model_loading` with Retry-After; /healthz shows each lane's phase and progress). Meanwhile this logs, at info
(the terminal under `make run`, the journal under systemd, whose STATUS= carries the same text):

    listening on http://127.0.0.1:8421 while 3 lanes start; the last start took 4.1 s
    still starting (10 s): embed loading all-MiniLM-L6-v2 (3 steps, 9 s); gen-0 loading SmolLM2-135M-Instruct ...
    lane embed ready after 3.9 s: all-MiniLM-L6-v2
    3 of 3 lane(s) ready after 21.3 s

A model whose LOAD failed is never called ready: its lane's line, the last line and the daemon's own line
(`degraded` instead of `ready`) name it and its load error.

Each lane's time to its first settle is kept in `<state_dir>/startup.json`, so the next start can say how long
the last one took (a first start on a state directory compiles kernels and models once; later ones restore them).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

import trio

from ..supervisor import SERVING_STATES, describe_progress

if TYPE_CHECKING:
    from ..supervisor import Lane, Supervisor

log = logging.getLogger("trio_gpuworker.daemon")

PROGRESS_INTERVAL_S = 10.0  # how often a line says which lanes are still starting
TIMES_FILE = "startup.json"


class StartupReport:
    def __init__(self, sup: Supervisor, state_dir: Path, *, interval_s: float = PROGRESS_INTERVAL_S) -> None:
        self.sup, self.path, self.interval_s = sup, state_dir / TIMES_FILE, interval_s
        self.last = self._read()

    def _read(self) -> dict[str, float]:
        """The last start's times; anything unreadable only costs the estimate."""
        with contextlib.suppress(OSError, ValueError):
            data = json.loads(self.path.read_text())
            if isinstance(data, dict):
                return {str(k): float(v) for k, v in data.items() if isinstance(v, int | float)}
        return {}

    def _write(self, times: dict[str, float]) -> None:
        tmp = self.path.with_name(f".{TIMES_FILE}.{os.getpid()}")
        with contextlib.suppress(OSError):
            tmp.write_text(json.dumps(times, sort_keys=True))
            os.replace(tmp, self.path)

    def listening(self, binds: list[str]) -> None:
        lanes = list(self.sup.lanes)
        known = [self.last[k] for k in lanes if k in self.last]
        estimate = (f"the last start took {max(known):.1f} s" if len(known) == len(lanes) and known else
                    "the first start on this state directory compiles kernels and loads models once; later starts "
                    "restore them")
        log.info("listening on %s while %d lane(s) start (%s); %s. Until a model's lane is ready its requests get "
                 "503 model_loading", ", ".join(binds) or "no listener", len(lanes), ", ".join(lanes), estimate)

    def still_starting(self) -> str | None:
        """The lanes whose first start has not settled, in words; None when every one has."""
        parts = [describe_progress(ln.id, p) for ln in self.sup.lanes.values()
                 if (p := ln.starting_first()) is not None]
        return "; ".join(parts) or None

    async def run(self, *, until: trio.Event | None = None) -> bool:
        """Until every lane's first start has settled (True) or `until` is set first (False, a stop): a line per
        lane as it settles, one every `interval_s` naming those still starting, one at the end. The times are
        kept for the next start's estimate."""
        began = trio.current_time()
        lanes = list(self.sup.lanes.values())
        async with trio.open_nursery() as nursery:
            for lane in lanes:
                nursery.start_soon(self._settled, lane)
            nursery.start_soon(self._tick, began)
            if until is not None:
                nursery.start_soon(_cancel_when, until, nursery.cancel_scope)
            await self.sup.wait_started()
            nursery.cancel_scope.cancel()
        if until is not None and until.is_set():
            return False
        times = {ln.id: t for ln in lanes if (t := ln.first_start.ready_after_s) is not None}
        ready = sum(ln.state in SERVING_STATES and not ln.load_errors for ln in lanes)
        after = trio.current_time() - began
        if (failed := self.failed_loads()) is None:
            log.info("%d of %d lane(s) ready after %.1f s", ready, len(lanes), after)
        else:
            log.warning("%d of %d lane(s) ready after %.1f s; models that failed to load: %s", ready, len(lanes),
                        after, failed)
        if ready == len(lanes):  # a failed start is no estimate of the next one
            self._write(times)
        return True

    def failed_loads(self) -> str | None:
        """The models whose LOAD failed, with each lane's error, in words; None when none has."""
        parts = [f"{m} on lane {ln.id} ({e})" for ln in self.sup.lanes.values() for m, e in ln.load_errors.items()]
        return "; ".join(parts) or None

    def settled(self, binds: list[str]) -> None:
        """The daemon's line once every lane's first start has settled: ready, or degraded while a configured model
        failed to load."""
        if (failed := self.failed_loads()) is None:
            log.info("gpuworkerd ready: %s; lanes %s", ", ".join(binds), ", ".join(self.sup.lanes))
        else:
            log.warning("gpuworkerd degraded: %s; lanes %s; models that failed to load: %s", ", ".join(binds),
                        ", ".join(self.sup.lanes), failed)

    async def _settled(self, lane: Lane) -> None:
        await lane.first_start.settled.wait()
        after = lane.first_start.ready_after_s or 0.0
        if lane.state in SERVING_STATES and not lane.load_errors:
            log.info("lane %s ready after %.1f s: %s", lane.id, after, ", ".join(lane.models_loaded))
        elif lane.state in SERVING_STATES:
            log.warning("lane %s started after %.1f s, but models failed to load: %s", lane.id, after,
                        "; ".join(f"{m}: {e}" for m, e in lane.load_errors.items()))
        else:
            log.warning("lane %s did not start (%s after %.1f s): %s", lane.id, lane.state.value, after,
                        lane.last_error or lane.last_exit or "no error recorded")

    async def _tick(self, began: float) -> None:
        while True:
            await trio.sleep(self.interval_s)
            if (text := self.still_starting()) is not None:
                log.info("still starting (%.0f s): %s", trio.current_time() - began, text)


async def _cancel_when(event: trio.Event, scope: trio.CancelScope) -> None:
    await event.wait()
    scope.cancel()


__all__ = ["PROGRESS_INTERVAL_S", "StartupReport"]
