"""Known defects put back, one at a time, to show the simulation finds them: each undoes its
fix by monkeypatching, only inside `mutated(name)`, only in the simulation's process. tests/test_sim.py pins a
seed that catches each, and `python -m tests.sim mutate NAME` searches for more."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from trio_gpuworker._errors import DeadlineExceeded, UnexpectedFrame
from trio_gpuworker._proto import _lifecycle, _lifecycle_rules
from trio_gpuworker.supervisor import _dataplane, _gate, _generation, _steps, _supervisor, _worker


def _patch(obj: Any, name: str, make: Callable[[Any], Any]) -> contextlib.AbstractContextManager[None]:
    @contextlib.contextmanager
    def patched() -> Iterator[None]:
        original = getattr(obj, name)
        setattr(obj, name, make(original))
        try:
            yield
        finally:
            setattr(obj, name, original)
    return patched()


def _serving_ignores_own_requests(original: Any) -> Any:
    """Item 1: the serving loop (and a promotion) did not wait for the lane's own request on that connection
    (an admin LOAD applied to the standby, a PING): the next request went out beside it."""
    def serve_next(m: Any) -> bool:
        a = m.active
        hidden = a.open if a is not None and a.open is not None and a.open.internal else None
        if hidden is not None:
            a.open = None
        try:
            return bool(original(m))
        finally:
            if hidden is not None and a.open is None:
                a.open = hidden
    return serve_next


def _promote_ignores_the_standbys_request(original: Any) -> Any:
    def promote(m: Any, now: float) -> bool:
        s = m.standby
        hidden = s.open if s is not None and s.open is not None else None
        if hidden is not None:
            s.open = None
        try:
            return bool(original(m, now))
        finally:
            if hidden is not None and s.open is None:
                s.open = hidden
    return promote


def _ordered_end_drops_the_open_request(original: Any) -> Any:
    """Item 2: after an ordered stop nothing answered the request that was in flight."""
    def ended(self: Any, gen: int, salvaged: object, now: float) -> Any:
        g = self.gens.get(gen)
        if g is not None and g.cause == "ordered":
            g.open = None
        return original(self, gen, salvaged, now)
    return ended


def _quiesce_without_waking(original: Any) -> Any:
    """Item 3: RING_QUIESCED released the ring without faulting it, so its waiters stayed parked."""
    def on_lane_event(self: Any, lane: Any, generation: int, msg: Any) -> None:
        end = self.ends.get(getattr(msg, "ring_id", -1)) if msg is not None else None
        if msg is not None and msg.T == "RING_QUIESCED" and end is not None and end.lane is lane:
            end.ring.release()
            self.arena.release(end.lease, _dataplane.Quiesced(end.ring_id, pump_stopped=True))
            end.released = True
            self.ends.pop(end.ring_id, None)
            return
        original(self, lane, generation, msg)
    return on_lane_event


def _lane_local_generations(original: Any) -> Any:
    """Item 4: every lane numbered its generations from 1 and the daemon checked a handle's generation only."""
    def make_lane(self: Any, cfg: Any, specs: Any) -> Any:
        lane = original(self, cfg, specs)
        lane.machine.new_generation = _generation.numbering()
        return lane
    return make_lane


def _check_generation_only(original: Any) -> Any:
    def check(self: Any, lane: Any, handle: dict[str, int], code: str) -> None:
        if handle.get("worker_generation") != lane.generation:
            original(self, lane, handle, code)
    return check


def _replies_counted_in_frames(original: Any) -> Any:
    """Reply bursts: the reader's buffer held 64 frames and a full one faulted the worker as a flood."""
    async def put(self: Any, msg: Any, verdict: Any) -> None:
        if len(self) >= 64:
            raise UnexpectedFrame("worker floods replies nobody asked for")
        await original(self, msg, verdict)
    return put


def _reload_drops_its_settings(original: Any) -> Any:
    """Reload: the runner started workers from a copy of the settings made once, so a reload's new ones never
    reached the worker it started."""
    def reload(self: Any, now: float, settings: Any = None) -> Any:
        return original(self, now, None)
    return reload


@contextlib.contextmanager
def _undo_on_deadline_only() -> Iterator[None]:
    """Cancel-safety of the data plane: what a call had done was undone when its own deadline ended it, but not
    when it was cancelled otherwise (an outer cancel scope, a failing sibling): its lease and ring stayed. Put back
    by narrowing every `except BaseException` of the data plane's module to DeadlineExceeded."""
    _dataplane.BaseException = DeadlineExceeded  # type: ignore[attr-defined]
    try:
        yield
    finally:
        del _dataplane.BaseException  # type: ignore[attr-defined]


def _holds_ignored(original: Any) -> Any:
    """Batched generation: the lane did not know a generation held live sequences, so a roll-over took over, or a
    reload stopped it, between two of their chunks."""
    def hold(self: Any, gen: int, on: bool, now: float) -> Any:
        return original(self, gen, False, now)
    return hold


def _model_changes_at_once(original: Any) -> Any:
    """Reload ordering: a model's new settings (the model table, its tokenizer) applied at once, before the
    lanes' reloads were queued behind the requests in flight: a request tokenized in that window with the new
    settings was served by a worker loaded with the old."""
    @contextlib.asynccontextmanager
    async def changing(self: Any, models: Any) -> Any:
        yield
    return changing


def _uninstall_dropped_with_its_caller(original: Any) -> Any:
    """Cancel-safety of an uninstall: one whose caller left while it was queued (behind an abandoned step still
    blocked on the session's other ring) was dropped with it, so the ring and its lease stayed on a healthy worker."""
    async def uninstall_ring(self: Any, end: Any, reason: str = "edge_stopped", timeout: float | None = None) -> None:
        await self._uninstall(end, reason, timeout, requeue=False)
    return uninstall_ring


def _unsent_install_counted_as_sent(original: Any) -> Any:
    """Cancel-safety of an install: one never sent (refused by its quarantined lane, say) whose caller left kept
    its lease until the worker was reaped, as if it might have been installed."""
    def orphan_answered(self: Any, end: Any, reply: Any, error: Any, *, sent: bool) -> None:
        original(self, end, reply, error, sent=True)
    return orphan_answered


def _faulted_ring_waits_on_us(original: Any) -> Any:
    """Hang detection behind a faulted ring: a step blocked on a ring we had faulted or were uninstalling (its
    session abandoned) counted as waiting on us, so its window was extended and a worker hung behind it was never
    struck: the ring's other requests waited past every bound."""
    def waits_on_us(self: Any, lane: Any) -> bool:
        stalled = False
        for e in self.ends.values():
            if e.lane is lane and e.steps and not e.released and e.ring.writable < _dataplane.STALL_BYTES:
                e.hint.set()
                stalled = True
        return stalled
    return waits_on_us


def _quarantine_drops_reload_settings(original: Any) -> Any:
    """A quarantine that failed a queued reload dropped the settings it brought: once the quarantine was lifted the
    lane's workers started with the old settings while admission already used the models' new ones."""
    def quarantine(m: Any) -> None:
        m.tickets.fail_queued(_lifecycle_rules.Outcome.QUARANTINED)
        m.rolling = False
        _lifecycle_rules.retire_standby(m)
        if m.active is not None:
            m.quarantine_pending = True
        elif m.state is _lifecycle_rules.L.RESTARTING:
            m.quarantine_pending = False
            m.step_lane(_lifecycle_rules.E.QUARANTINE)
    return quarantine


def _changes_of_one_model_overlap(original: Any) -> Any:
    """The gate let a second change of a model's settings through while the first still waited for the requests
    admitted before it: the second queued its lanes' reloads ahead of such a request, which a worker with the new
    settings then served."""
    @contextlib.asynccontextmanager
    async def changing(self: Any, models: Any) -> Any:
        models = set(models) - self._changing
        self._changing |= models
        try:
            while any(self._serving[m] for m in models):
                await self._moved.park()
            yield
        finally:
            self._changing -= models
            self._moved.unpark_all()
    return changing


MUTATIONS: dict[str, list[tuple[Any, str, Callable[[Any], Any]]]] = {
    "standby_carries_two": [(_lifecycle_rules, "_serve_next", _serving_ignores_own_requests),
                            (_lifecycle_rules, "_promote", _promote_ignores_the_standbys_request)],
    "ordered_stop_unanswered": [(_lifecycle.LaneLifecycle, "ended", _ordered_end_drops_the_open_request)],
    "quiesced_ring_waiters_hang": [(_dataplane.DataPlane, "on_lane_event", _quiesce_without_waking)],
    "handles_cross_lanes": [(_steps.HandleRegistry, "check", _check_generation_only),
                            (_supervisor.Supervisor, "_lane", _lane_local_generations)],
    "reply_bursts_fault_the_worker": [(_worker.Replies, "put", _replies_counted_in_frames)],
    "reload_keeps_old_settings": [(_lifecycle.LaneLifecycle, "reload", _reload_drops_its_settings)],
    "handover_cuts_a_held_batch": [(_lifecycle.LaneLifecycle, "hold", _holds_ignored)],
    "model_change_outruns_its_requests": [(_gate.ModelGate, "changing", _model_changes_at_once)],
    "uninstall_dropped_with_its_caller": [(_dataplane.DataPlane, "uninstall_ring", _uninstall_dropped_with_its_caller)],
    "unsent_install_keeps_its_lease": [(_dataplane.DataPlane, "_orphan_answered", _unsent_install_counted_as_sent)],
    "quarantine_drops_reload_settings": [(_lifecycle_rules, "quarantine", _quarantine_drops_reload_settings)],
    "changes_of_one_model_overlap": [(_gate.ModelGate, "changing", _changes_of_one_model_overlap)],
    "faulted_ring_waits_on_us": [(_dataplane.DataPlane, "_step_waits_on_us", _faulted_ring_waits_on_us)],
}


# defects put back by a context of their own rather than by patching attributes
CONTEXTS: dict[str, Callable[[], contextlib.AbstractContextManager[None]]] = {
    "cancelled_calls_leave_leases": _undo_on_deadline_only,
}


NAMES = sorted({*MUTATIONS, *CONTEXTS})  # every known defect the simulation can put back


@contextlib.contextmanager
def mutated(name: str | None) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for obj, attr, make in MUTATIONS.get(name or "", []):
            stack.enter_context(_patch(obj, attr, make))
        if (context := CONTEXTS.get(name or "")) is not None:
            stack.enter_context(context())
        yield


__all__ = ["CONTEXTS", "MUTATIONS", "NAMES", "mutated"]
