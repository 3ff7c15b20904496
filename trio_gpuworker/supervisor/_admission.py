"""Admission and lane choice: a byte budget per model queue, drained lanes, the least loaded ready lane.

    sched = Scheduler(AdmissionPolicy(queue_bytes=64 << 20))
    with sched.admit("all-MiniLM-L6-v2", nbytes):   # OverCapacity (429) when the model's queue is full
        ...                                        # queued + in flight until the block exits

The budget counts (an upper bound of) the token-id bytes a request sends to a worker, from admission, which
comes before tokenization, until the lane has drained its reply, so the memory held for queued work is bounded
per model whatever the callers do.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING

from .._config import AdmissionPolicy, SupervisorConfig
from .._errors import (
    ClosedSupervisorError,
    InvalidRequest,
    ModelLoadFailed,
    ModelLoading,
    NoLaneAvailable,
    OverCapacity,
)
from .._proto import SERVING_STATES, LaneState
from ._startup import MODEL_LOADING_RETRY_AFTER_S, describe_progress

if TYPE_CHECKING:
    from ._lane import Lane


class Scheduler:
    """Per-model admission counters: token-id bytes queued or in flight, against the model's budget."""

    def __init__(self, policy: AdmissionPolicy | None = None) -> None:
        self.policy = policy or AdmissionPolicy()
        self.queued_bytes: dict[str, int] = {}
        self.queued: dict[str, int] = {}  # admitted requests not yet answered
        self.rejected: dict[str, int] = {}
        # tokens of the inputs the model's workers were sent, and of the text they generated (usage)
        self.prompt_tokens: dict[str, int] = {}
        self.generated_tokens: dict[str, int] = {}
        # (what, model, seconds) for the latency histograms: queue_wait, time_to_first_token, inter_token
        self.observe: Callable[[str, str, float], None] | None = None

    def acquire(self, model: str, nbytes: int) -> Ticket:
        """Count `nbytes` against the model's budget until the ticket is released."""
        budget = self.policy.queue_bytes
        if nbytes > budget:
            raise InvalidRequest(f"the request needs {nbytes} bytes of token ids; the queue budget of model "
                                  f"{model!r} is {budget} bytes (admission.queue_bytes)")
        held = self.queued_bytes.get(model, 0)
        if held + nbytes > budget:
            self.rejected[model] = self.rejected.get(model, 0) + 1
            raise OverCapacity(f"model {model!r} has {held} bytes queued or in flight; this request needs {nbytes} "
                               f"more and the budget is {budget}", model=model, queued_bytes=held,
                               budget_bytes=budget, retry_after_s=self.policy.retry_after_s)
        self.queued_bytes[model] = held + nbytes
        self.queued[model] = self.queued.get(model, 0) + 1
        return Ticket(self, model, nbytes)

    @contextmanager
    def admit(self, model: str, nbytes: int) -> Iterator[Ticket]:
        """The ticket is released when the block exits, unless the block handed it to lane jobs that are
        still draining (`Ticket.job()`): then when the last of them settles."""
        ticket = self.acquire(model, nbytes)
        try:
            yield ticket
        finally:
            ticket.caller_done()


class Ticket:
    """Admitted bytes: released once the caller is done and every lane job it started has settled, so the
    budget still counts a reply a gone caller left the lane to drain."""

    def __init__(self, scheduler: Scheduler, model: str, nbytes: int) -> None:
        self._scheduler = scheduler
        self.model = model
        self.nbytes = nbytes
        self.pending = 0
        self._caller = True
        self.released = False
        self.admitted_at = time.monotonic()  # latency metrics are wall time, whatever clock trio runs

    def timing(self) -> Timing:
        """Latency observations of one worker request of this ticket: its queue wait, first token, gaps."""
        return Timing(self)

    def observe(self, what: str, seconds: float) -> None:
        if (hook := self._scheduler.observe) is not None:
            hook(what, self.model, seconds)

    def job(self) -> Callable[[], None]:
        """An `on_settled` callback for one lane job."""
        self.pending += 1
        fired = False

        def settled() -> None:
            nonlocal fired
            if not fired:
                fired = True
                self.pending -= 1
                self._maybe_release()

        return settled

    def count_tokens(self, prompt: int, generated: int = 0) -> None:
        """Usage of a request that was served."""
        s = self._scheduler
        s.prompt_tokens[self.model] = s.prompt_tokens.get(self.model, 0) + prompt
        s.generated_tokens[self.model] = s.generated_tokens.get(self.model, 0) + generated

    def caller_done(self) -> None:
        self._caller = False
        self._maybe_release()

    def _maybe_release(self) -> None:
        if self.released or self._caller or self.pending:
            return
        self.released = True
        s = self._scheduler
        s.queued_bytes[self.model] -= self.nbytes
        s.queued[self.model] -= 1


class Timing:
    """Times from admission: to the request's write to a worker (queue wait: tokenization, the model's queue and
    the lane's), to its first generated token, and between tokens (from the worker's PROGRESS as it arrives)."""

    def __init__(self, ticket: Ticket) -> None:
        self.ticket = ticket
        self._last: float | None = None
        self._seen = 0
        self._started = False

    def started(self) -> None:
        """Once per ticket request: a request split over micro-batches or replicas waited until its first went."""
        if not self._started:
            self._started = True
            self.ticket.observe("queue_wait", time.monotonic() - self.ticket.admitted_at)

    def token(self, n: int) -> None:
        now = time.monotonic()
        if self._last is None:
            self.ticket.observe("time_to_first_token", now - self.ticket.admitted_at)
        elif n > self._seen:
            gap = (now - self._last) / (n - self._seen)  # PROGRESS frames may coalesce several tokens
            for _ in range(n - self._seen):
                self.ticket.observe("inter_token", gap)
        else:
            return  # a second report of a token already seen (a worker may send PROGRESS and a delta)
        self._last, self._seen = now, n


def choose_lane(model: str, lanes: Iterable[Lane], drained: set[str] | frozenset[str] = frozenset()) -> Lane:
    """The least loaded lane serving `model`: not drained, not quarantined, ready before starting, restarting before
    in its first start, and one that loaded the model before one whose LOAD of it failed. Load = queued requests +
    the one running. When every such lane is in its first start: ModelLoading; when the model's LOAD failed on every
    one that has settled, and none is still starting: ModelLoadFailed, with their load errors."""
    candidates = [lane for lane in lanes if model in lane.loads]
    if not candidates:
        raise NoLaneAvailable(f"no lane is configured to serve {model!r}")
    routable = [lane for lane in candidates if lane.id not in drained]
    if not routable:
        raise NoLaneAvailable(f"every lane serving {model!r} is drained: {', '.join(ln.id for ln in candidates)}")
    open_lanes = [lane for lane in routable if lane.cooldown_remaining() is None]
    if not open_lanes:
        lane = min(routable, key=lambda ln: ln.cooldown_remaining() or 0.0)
        raise lane.quarantine_error(lane.cooldown_remaining() or 0.0)
    closing = (LaneState.DRAINING, LaneState.STOPPING, LaneState.STOPPED)
    starting = {ln.id: p for ln in open_lanes if (p := ln.starting_first()) is not None}
    if len(starting) == len(open_lanes):  # none has served yet: refuse rather than queue behind the first LOAD
        raise ModelLoading(f"{model!r} is loading: " + "; ".join(describe_progress(k, p) for k, p in starting.items()),
                           model=model, lanes=starting, retry_after_s=MODEL_LOADING_RETRY_AFTER_S)
    failed = {ln.id: err for ln in open_lanes if (err := ln.load_errors.get(model)) is not None}
    if not starting and len(failed) == len(open_lanes):
        raise ModelLoadFailed(f"{model!r} failed to load: " + "; ".join(f"lane {k}: {e}" for k, e in failed.items()),
                              model=model, lanes=failed)

    def rank(ln: Lane) -> tuple[int, int, int, int]:
        state = 0 if ln.state in SERVING_STATES else 2 if ln.state in closing else 1
        return state, int(ln.id in starting), int(model in ln.load_errors), ln.queued + (ln.state == LaneState.BUSY)

    return min(open_lanes, key=rank)


class Router:
    """Which lane serves a model's next request (`choose_lane`), and the one owner of the drained set: lanes
    that get no new requests (admin drain, a reload, a lane being removed)."""

    def __init__(self, config: SupervisorConfig, lanes: Mapping[str, Lane]) -> None:
        self.config = config
        self.lanes = lanes
        self._drained: set[str] = set()
        self.closed = False

    @property
    def drained(self) -> frozenset[str]:
        return frozenset(self._drained)

    def drain(self, lane_id: str) -> None:
        self._drained.add(lane_id)

    def resume(self, lane_id: str) -> None:
        self._drained.discard(lane_id)

    def pick(self, model: str) -> Lane:
        if self.closed:
            raise ClosedSupervisorError("the supervisor is shutting down")
        self.config.model(model)
        return choose_lane(model, self.lanes.values(), self._drained)

    def idle(self, model: str) -> list[Lane]:
        """Ready lanes serving `model` with nothing queued or running, not drained or quarantined: where the
        rows of one large request can be spread (replicas)."""
        if self.closed:
            return []
        return [ln for ln in self.lanes.values()
                if model in ln.loads and ln.id not in self._drained and ln.cooldown_remaining() is None
                and ln.state == LaneState.READY and not ln.queued and model not in ln.load_errors]

    def ready_lanes(self, model: str) -> list[str]:
        """Lanes that can serve `model` now: ready or busy with it loaded, not drained, not quarantined (what
        /readyz reports). Empty once the supervisor is closing."""
        if self.closed:
            return []
        return [ln.id for ln in self.lanes.values()
                if model in ln.loads and model in ln.models_loaded and ln.id not in self._drained
                and ln.cooldown_remaining() is None and ln.state in SERVING_STATES]

    def served_models(self) -> list[str]:
        """Models some lane is configured to serve, in configuration order."""
        return [m.id for m in self.config.models if any(m.id in ln.loads for ln in self.lanes.values())]

    def load(self, model: str) -> tuple[int, int]:
        """(queued, running) worker requests on the lanes that serve `model`: waiting in their queues, and being
        run (one per busy lane). A lane that serves several models counts toward each: it is the work ahead of
        that model's next request."""
        lanes = [ln for ln in self.lanes.values() if model in ln.loads]
        return sum(ln.queued for ln in lanes), sum(ln.state == LaneState.BUSY for ln in lanes)

    def serving(self, model: str) -> int:
        """How many lanes may take the model's requests now (how many batches of it may be out at once)."""
        return sum(1 for ln in self.lanes.values() if model in ln.loads and ln.id not in self._drained)
