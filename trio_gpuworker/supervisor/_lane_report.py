"""How a lane reads from outside: the typed error or result each of its tickets ends with, the WORKER_CRASHED a
genuine fault publishes, its cached status (the /v1/lanes body) and a view of its standby. All of it is read from
the lane lifecycle machine and the generations' shells; nothing here decides anything."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import trio

from .._config import SupervisorConfig
from .._errors import BrokenWorkerError, ClosedSupervisorError, EngineCrashed, WorkerError
from .._proto import Err, Finish, GenState, LaneLifecycle, Outcome, Reply, WireMessage
from ._events import EventBus
from ._generation import Generation
from ._logring import LogRing
from ._startup import FirstStart
from ._worker import describe_exit

log = logging.getLogger("trio_gpuworker.lane")


class StandbyView:
    """The lane's warm standby as status, metrics and tests read it."""

    def __init__(self, machine: LaneLifecycle, gens: dict[int, Generation]) -> None:
        self._machine, self._gens = machine, gens

    @property
    def gen(self) -> Generation | None:
        s = self._machine.standby
        return self._gens.get(s.number) if s is not None else None

    @property
    def ready(self) -> bool:
        s = self._machine.standby
        return s is not None and s.state is GenState.READY and s.open is None and not s.pending

    @property
    def promotions(self) -> int:
        return self._machine.promotions

    @property
    def faults(self) -> int:
        return self._machine.standby_faults

    def describe(self) -> dict[str, Any] | None:
        s, gen = self._machine.standby, self.gen
        if s is None or gen is None:
            return None
        state = "ready" if self.ready else "starting" if s.state in (GenState.SPAWNING, GenState.LOADING) else \
            s.state.value
        return gen.describe(state)


class LaneReport:
    """What a lane shows: kept here, read from its machine and its generations' shells."""

    def __init__(self, lane_id: str, sup: SupervisorConfig, machine: LaneLifecycle, gens: dict[int, Generation],
                 log_ring: LogRing, bus: EventBus, step_waits: list[Callable[[], bool]]) -> None:
        self.id, self.sup, self.machine, self.gens = lane_id, sup, machine, gens
        self.log, self.bus, self.step_waits = log_ring, bus, step_waits
        self.policy = machine.policy
        self.standby = StandbyView(machine, gens)
        self.rss_mb: float | None = None
        self.last_exit: str | None = None
        self.last_error: str | None = None
        self.first = FirstStart()

    def active(self) -> Generation | None:
        a = self.machine.active
        return self.gens.get(a.number) if a is not None else None

    def cooldown_remaining(self) -> float | None:
        return self.policy.cooldown_remaining(trio.current_time())

    # --- what a ticket's end reads as ------------------------------------------------------------

    def outcome(self, e: Finish) -> tuple[WireMessage | None, BaseException | None]:
        """The reply as its class (ERR raised as WorkerError), or the error the ticket ended with."""
        lane, o, payload = self, e.outcome, e.payload
        if o is Outcome.REPLY:
            assert isinstance(payload, Reply)
            reply = payload.msg
            if isinstance(reply, Err):
                return None, WorkerError(reply.code, reply.msg)
            return reply, None
        if o is Outcome.RELOADED:
            return None, None  # a reload answers nothing: its caller only waits for the new generation
        if o is Outcome.REFUSED:
            assert isinstance(payload, BaseException)
            return None, payload
        if o is Outcome.CRASHED:
            gen = lane.gens.get(payload) if isinstance(payload, int) else None
            return None, (gen.error or self.fault_error(gen)) if gen is not None else \
                EngineCrashed(f"lane {lane.id}: worker generation {payload} failed", lane_id=lane.id,
                              generation=payload if isinstance(payload, int) else None)
        if o is Outcome.ABORTED:
            return None, WorkerError("worker_shutting_down", f"abort_in_flight stopped lane {lane.id}'s worker "
                                                             f"(generation {payload}) before it answered")
        if o is Outcome.GONE:
            return None, BrokenWorkerError(f"{e.ticket.kind} was for lane {lane.id}'s worker generation {payload}, "
                                           "which ended before it could be sent")
        if o is Outcome.QUARANTINED:
            return None, self.quarantine_error(lane.cooldown_remaining() or 0.0)
        if o is Outcome.SHUTTING_DOWN:
            return None, ClosedSupervisorError(f"lane {lane.id} is shutting down")
        return None, None  # ABANDONED: its caller is gone

    def quarantine_error(self, remaining: float) -> EngineCrashed:
        policy = self.policy
        return EngineCrashed(
            f"lane {self.id} is quarantined after {policy.max_strikes} consecutive faults; "
            f"retry in {remaining:.0f} s", lane_id=self.id, generation=self.machine.generation,
            cause=policy.last_fault.value if policy.last_fault else "crash",
            quarantined=True, cooldown_remaining_s=round(remaining, 3))

    def fault_error(self, gen: Generation) -> EngineCrashed:
        lane, fault, rc = self, gen.wp.fault, gen.rc
        mg = self.machine.gens.get(gen.number)  # its role now: a standby may have been promoted since its spawn
        role = "standby worker" if (mg.role.value if mg is not None else gen.role) == "standby" else "worker"
        detail = fault.detail if fault is not None else "ended"
        err = EngineCrashed(
            f"{role} of lane {lane.id} (generation {gen.number}) failed: {detail}; {describe_exit(rc)}",
            lane_id=lane.id, generation=gen.number, cause=fault.cause if fault is not None else "crash",
            exit_code=rc if rc is not None and rc >= 0 else None, signal=-rc if rc is not None and rc < 0 else None,
            log_tail=lane.log.tail(lane.sup.log_tail_bytes))
        if fault is not None and fault.error is not None:
            err.__cause__ = fault.error
        return err

    # --- a generation's end --------------------------------------------------------------------

    def ended(self, gen: Generation) -> None:
        """Reaped: its exit status is known, so is how its end reads."""
        self.last_exit = describe_exit(gen.rc)
        if gen.wp.fault is not None and gen.wp.fault.cause != "ordered":
            gen.error = self.fault_error(gen)

    def crashed(self, gen: Generation, role: str) -> None:
        """A genuine fault ended `gen`: log it and tell subscribers (before the data plane's RING_FAULTs)."""
        err = gen.error or self.fault_error(gen)
        self.last_error = str(err)
        log.warning("%s", err, extra={"lane_id": self.id, "generation": gen.number})
        self.bus.publish({"t": "WORKER_CRASHED", "lane_id": self.id, "generation": gen.number,
                               "status": describe_exit(gen.rc), "cause": err.cause, "standby": role == "standby"})

    # --- status --------------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        remaining, m, gen = self.cooldown_remaining(), self.machine, self.active()
        cfg = m.settings.cfg  # the settings it runs (a reload's are adopted when it is carried out)
        return {
            "lane_id": self.id,
            "state": m.state.value,
            "generation": m.generation,
            "pid": gen.wp.pid if gen is not None else None,
            "strikes": self.policy.strikes,
            "quarantined_until": time.time() + remaining if remaining is not None else None,
            "cooldown_remaining_s": remaining,
            "models": list(gen.models) if gen is not None else [],
            "load_errors": dict(gen.load_errors) if gen is not None else {},
            "rss_mb": self.rss_mb,
            "queued": len(m.tickets.queue),
            "restarts": m.restarts,
            "rollovers": m.rollovers,
            "beams": dict(gen.beams) if gen is not None else {},
            "last_exit": self.last_exit,
            "last_error": self.last_error,
            "device": cfg.device,
            "standby": self.standby.describe() if cfg.standby else None,
            "standby_enabled": cfg.standby,
            "starting": self.first.describe(m.state, trio.current_time()),  # None once the first start settled
            "ready_after_s": self.first.ready_after_s,
        }

    def step_waits_on_us(self) -> bool:
        """An EXECUTE_STEP silent for its whole window is waiting on us, not hung, while one of its egress rings
        is full and unpulled (the data plane answers; no data plane, no such wait)."""
        return any(check() for check in self.step_waits)


__all__ = ["LaneReport", "StandbyView"]
