"""A lane's warm standby (`standby = true`): a second worker, spawned with its own nonce and socket, past
HELLO, with the lane's models loaded, idle. It never serves while the active worker is healthy. When the
active worker faults the lane promotes it at once, and a new standby starts in the background."""

from __future__ import annotations

from typing import Any, Protocol

import trio

from .._config import SupervisorConfig, Windows
from .._errors import BrokenWorkerError, EngineCrashed, InvalidRequest
from ._generation import Generation
from ._jobs import Job, LaneState


class Lane(Protocol):
    """What the keeper needs of its lane."""

    sup: SupervisorConfig
    windows: Windows

    @property
    def closing(self) -> bool: ...

    def spawn(self, *, standby: bool = False) -> Generation: ...

    def strike(self, gen: Generation) -> EngineCrashed: ...

    async def wait_state(self, *states: LaneState) -> None: ...


class StandbyKeeper:
    def __init__(self, lane: Lane) -> None:
        self.lane = lane
        self.gen: Generation | None = None
        self.promotions = 0
        self.faults = 0

    @property
    def ready(self) -> bool:
        gen = self.gen
        return gen is not None and gen.ready.is_set() and gen.alive and not gen.stop_requested.is_set()

    def take(self) -> Generation | None:
        """Hand the ready standby over to the lane as its next active worker, or None."""
        if not self.ready:
            return None
        gen, self.gen = self.gen, None
        assert gen is not None
        self.promotions += 1
        gen.promoted = True
        gen.released.set()
        return gen

    async def stop(self) -> None:
        """Stop the standby in order (quarantine, reload, shutdown) and wait until it is reaped: no strike."""
        gen, self.gen = self.gen, None
        if gen is not None:
            gen.stop_requested.set()
            with trio.CancelScope(shield=True):
                await gen.reaped.wait()

    async def apply(self, t: str, fields: dict[str, Any]) -> None:
        """A LOAD or UNLOAD the active worker acknowledged reaches the standby too. A standby that is still
        starting, or cannot apply it, is replaced: its successor loads the lane's models as they are now."""
        gen = self.gen
        if gen is None:
            return
        if gen.ready.is_set() and gen.alive:
            try:
                reply = await gen.call(Job(t, fields, None), self.lane.windows)
            except (BrokenWorkerError, InvalidRequest):
                reply = None
            if reply is not None and (reply.t != "ERR" or reply["code"] == "model_not_loaded"):
                if t == "LOAD" and reply.t != "ERR" and reply["model_ref"] not in gen.models:
                    gen.models.append(reply["model_ref"])
                elif t == "UNLOAD" and fields["model_ref"] in gen.models:
                    gen.models.remove(fields["model_ref"])
                return
        if self.gen is gen:
            await self.stop()

    def describe(self) -> dict[str, Any] | None:
        return self.gen.describe() if self.gen is not None else None

    async def run(self) -> None:
        """Keep one standby while the lane serves: spawn it once an active worker is up, strike and respawn it
        (with backoff) when it faults while idle, start a new one after each promotion."""
        lane, restart = self.lane, self.lane.sup.restart
        backoff = restart.backoff_initial_s
        while True:
            await lane.wait_state(LaneState.READY, LaneState.BUSY)
            if lane.closing:
                return
            gen = self.gen = lane.spawn(standby=True)
            await gen.released.wait()
            if self.gen is gen:
                self.gen = None
            if gen.promoted:
                backoff = restart.backoff_initial_s
            else:
                await gen.reaped.wait()
                if gen.faulted:  # a crash-looping standby must not go unnoticed: it counts like any fault
                    self.faults += 1
                    lane.strike(gen)
            await trio.sleep(backoff)
            if not gen.promoted and gen.faulted:
                backoff = min(backoff * restart.backoff_factor, restart.backoff_max_s)

