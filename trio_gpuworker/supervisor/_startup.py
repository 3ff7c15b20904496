"""A lane's first start as the outside reads it: /healthz, STATUS=, the terminal and `model_loading` answers.

Only the first start is tracked. The daemon listens before its workers are ready, so until a lane has served (or
its first start has failed) a request for a model that no serving lane has is refused with `model_loading` and a
Retry-After, rather than queued behind a LOAD that may take minutes. After that the lane's own rules apply: a
restarting lane queues requests, as it always has.
"""

from __future__ import annotations

from typing import Any

import trio

from .._proto import LaneState

# The Retry-After of a `model_loading` answer: short, since a start on a warm cache takes seconds.
MODEL_LOADING_RETRY_AFTER_S = 2.0


class FirstStart:
    """Phase (spawn: the process starts and says HELLO; load: the lane's models load and compile), the model being
    loaded, the PROGRESS steps its LOAD reported, and how long it has taken so far."""

    def __init__(self) -> None:
        self.began: float | None = None
        self.model: str | None = None
        self.steps = 0
        self.ready_after_s: float | None = None  # spawn -> the first settle, once settled
        self.settled = trio.Event()  # serving, or the first start failed (the lane's rules take over)

    def begin(self, now: float) -> None:
        self.began = now

    def loading(self, model: str | None) -> None:
        """A LOAD of the first start was written."""
        if not self.settled.is_set():
            self.model, self.steps = model, 0

    def progressed(self) -> None:
        """A valid PROGRESS for that LOAD."""
        if not self.settled.is_set():
            self.steps += 1

    def settle(self, now: float) -> None:
        if not self.settled.is_set():
            self.ready_after_s = round(now - (self.began if self.began is not None else now), 3)
            self.settled.set()

    def describe(self, state: LaneState, now: float) -> dict[str, Any] | None:
        """Where the first start is, or None once it has settled."""
        if self.settled.is_set():
            return None
        phase = "load" if state is LaneState.LOADING else "spawn"
        return {"phase": phase, "model": self.model if phase == "load" else None, "steps": self.steps,
                "elapsed_s": round(now - self.began, 1) if self.began is not None else 0.0}


def describe_progress(lane_id: str, p: dict[str, Any]) -> str:
    """One lane's first start in words: "embed loading all-MiniLM-L6-v2 (3 steps, 4 s)"."""
    if p["phase"] == "load":
        what = f"loading {p['model']}" if p["model"] else "loading"
        return f"{lane_id} {what} ({p['steps']} steps, {p['elapsed_s']:.0f} s)"
    return f"{lane_id} starting its worker ({p['elapsed_s']:.0f} s)"


__all__ = ["MODEL_LOADING_RETRY_AFTER_S", "FirstStart", "describe_progress"]
