"""What the lane lifecycle machine (_lifecycle.py) is made of: tickets, generations, the effects it returns for
the trio lane to carry out, and the restart timing."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol

from ._lifecycle_table import Event, GenState, LifecycleError, step_generation

RELOAD = "__RELOAD__"  # a queued reload: in order behind the requests queued before it


class Settings(Protocol):
    """What a lane's generations are started with. The machine reads the models each loads after HELLO and whether
    a warm standby is kept; the rest (the worker's command, environment and device, each model's settings) belongs
    to the trio lane, which reads it back from the generation that was spawned with it."""

    @property
    def models(self) -> Sequence[str]: ...

    @property
    def standby(self) -> bool: ...


@dataclass(frozen=True)
class PlainSettings:
    """Settings that are only what the machine reads (its tests, the simulation of the machine alone)."""

    models: tuple[str, ...] = ()
    standby: bool = False


class Role(StrEnum):
    ACTIVE = "active"
    STANDBY = "standby"


class Outcome(StrEnum):
    REPLY = "reply"  # the terminal reply (or ERR) of the generation it was sent to; payload: that reply
    REFUSED = "refused"  # failed local validation, nothing was written; payload: the error
    CRASHED = "crashed"  # the generation it was sent to ended before a complete reply; payload: its number
    ABORTED = "aborted"  # abort_in_flight ended it (worker_shutting_down); payload: the generation's number
    QUARANTINED = "quarantined"  # the lane is quarantined
    SHUTTING_DOWN = "shutting_down"  # the lane closed (or stopped that generation) before it was served
    ABANDONED = "abandoned"  # its caller left before it was sent: it never reached a worker
    RELOADED = "reloaded"  # a reload: a fresh generation has loaded; payload: its number
    GONE = "gone"  # it was for one generation (a ring's, a handle's) that ended before it was sent; payload: it


class Stop(StrEnum):
    RELOAD = "reload"
    ABORT = "abort"
    CLOSE = "close"
    QUARANTINE = "quarantine"
    RETIRE = "retire"  # a standby stopped in order (reload, quarantine, close, replaced), or a rolled-over active


@dataclass(eq=False)
class Ticket:
    id: int
    kind: str  # the request type (EMBED_BATCH, LOAD, ...) or RELOAD
    internal: bool = False  # the lane's own: model loads, standby applies, PING, SHUTDOWN
    model: str | None = None  # LOAD / UNLOAD of the lane's own
    after: int = 0  # RELOAD: served once a generation newer than this one has loaded
    settings: Any = None  # RELOAD: the settings it brings, adopted when it reaches the head of the queue
    pinned: int | None = None  # only this generation may get it (it names that generation's rings or handles)
    gen: int | None = None  # the generation it was sent to
    open: bool = False
    done: bool = False
    abandoned: bool = False  # its caller left while it was open: the reply drains to nobody


@dataclass(eq=False)
class Generation:
    number: int
    role: Role
    state: GenState = GenState.SPAWNING
    open: Ticket | None = None  # the one request on its connection
    pending: deque[Ticket] = field(default_factory=deque)  # the lane's own requests for it, sent before others
    stop: Stop | None = None  # why it is being stopped in order
    shutdown_sent: bool = False
    connected: bool = False  # past HELLO: it can be sent SHUTDOWN
    loaded: bool = False
    served: bool = False  # drained a successful serving reply: the restart backoff starts over after it
    cause: str | None = None  # why it ended: crash | hang | protocol | ordered
    settings: Any = None  # what it was spawned with (the lane's settings then, or an admin LOAD's since)
    holds: bool = False  # it holds work that later requests pinned to it continue (a batch's live sequences)

    def step(self, event: Event) -> None:
        self.state = step_generation(self.state, event)


@dataclass(frozen=True)
class Spawn:
    gen: int
    role: Role


@dataclass(frozen=True)
class Send:
    gen: int
    ticket: Ticket


@dataclass(frozen=True)
class Abort:
    gen: int  # SHUTDOWN abort_in_flight, out of band, now


@dataclass(frozen=True)
class Kill:
    gen: int  # end it now: it said WORKER_STOPPED, or it has no connection to stop in order


@dataclass(frozen=True)
class Finish:
    ticket: Ticket
    outcome: Outcome
    payload: object = None


@dataclass(frozen=True)
class Crashed:
    gen: int  # a genuine fault ended it: WORKER_CRASHED for subscribers
    role: Role
    cause: str


Effect = Spawn | Send | Abort | Kill | Finish | Crashed


@dataclass(frozen=True)
class Backoff:
    initial_s: float = 0.1
    factor: float = 2.0
    max_s: float = 30.0


class Restarts:
    """When the next active and standby generations may start: exponential backoff after faults, starting over
    after a generation that served (active) or a promotion (standby)."""

    def __init__(self, backoff: Backoff) -> None:
        self.backoff = backoff
        self.delay = self.standby_delay = backoff.initial_s
        self.respawn_at = self.standby_at = 0.0

    def _grow(self, s: float) -> float:
        return min(s * self.backoff.factor, self.backoff.max_s)

    def active_faulted(self, served: bool) -> None:
        if served:
            self.delay = self.backoff.initial_s

    def active_ended(self, now: float) -> None:
        self.respawn_at, self.delay = now + self.delay, self._grow(self.delay)

    def at_once(self, now: float) -> None:
        """A cool-down ended or a reload lifted a quarantine: a fresh worker now, the backoff from the start."""
        self.respawn_at, self.delay = now, self.backoff.initial_s

    def standby_faulted(self, now: float) -> None:
        self.standby_at, self.standby_delay = now + self.standby_delay, self._grow(self.standby_delay)

    def standby_promoted(self, now: float) -> None:
        self.standby_delay = self.backoff.initial_s
        self.standby_at = now + self.standby_delay


class Tickets:
    """Every request a lane accepted, until its one Finish: the queue in arrival order, the reloads waiting for a
    fresh generation, and the effects the machine hands the trio lane. `finish` refuses a second answer."""

    def __init__(self) -> None:
        self.queue: deque[Ticket] = deque()
        self.reloads: list[Ticket] = []  # taken from the queue; answered once a fresh generation has loaded
        self.out: list[Effect] = []
        self._ids = 0

    def new(self, kind: str, *, internal: bool = False, model: str | None = None) -> Ticket:
        self._ids += 1
        return Ticket(self._ids, kind, internal=internal, model=model)

    def take(self) -> list[Effect]:
        out, self.out = self.out, []
        return out

    def finish(self, t: Ticket, outcome: Outcome, payload: object = None) -> None:
        if t.done:
            raise LifecycleError(f"ticket {t.id} ({t.kind}) finished twice: {outcome.value}")
        t.done = True
        self.out.append(Finish(t, outcome, payload))

    def drop_pinned(self, gen: int) -> None:
        """Generation `gen` ended: what was queued for it alone can never be sent."""
        for t in [t for t in self.queue if t.pinned == gen]:
            self.queue.remove(t)
            self.finish(t, Outcome.GONE, gen)

    def fail_queued(self, outcome: Outcome) -> None:
        while self.queue:
            self.finish(self.queue.popleft(), outcome)
        self.answer_reloads(outcome)

    def answer_reloads(self, outcome: Outcome, payload: object = None) -> None:
        for r in self.reloads:
            self.finish(r, outcome, payload)
        self.reloads.clear()

    def drop_pending(self, g: Generation, outcome: Outcome) -> None:
        while g.pending:
            self.finish(g.pending.popleft(), outcome, g.number)
