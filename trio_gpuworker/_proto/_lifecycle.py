"""The lane lifecycle (docs/architecture.md, 'The lane lifecycle') as one pure machine, fed events and timestamps,
returning effects.

It holds which generation is active, the warm standby, the generations being retired, the accepted requests
("tickets") and the one request open on each generation's connection, and it decides what becomes of every
ticket at every transition. The trio lane (supervisor/_lane.py) carries the effects out (spawn, send, kill,
answer a caller) and reports back what happened. States change only through the tables in _lifecycle_table.py;
what follows each event is _lifecycle_rules.py.

Invariant, by construction: every ticket is finished exactly once (Tickets.finish refuses a second answer), and
a ticket sent to generation g is finished only by g's reply or by g's end.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from . import _lifecycle_rules as rules
from ._lifecycle_parts import (
    RELOAD,
    Backoff,
    Crashed,
    Effect,
    Generation,
    Kill,
    Outcome,
    Restarts,
    Role,
    Send,
    Settings,
    Spawn,
    Stop,
    Ticket,
    Tickets,
)
from ._lifecycle_table import Event, GenState, LaneState, LifecycleError, step_lane
from ._schema import SERVING  # the requests whose success clears strikes, marked on their classes
from ._strikes import Fault, StrikePolicy

E, G, L = Event, GenState, LaneState


class LaneLifecycle:
    def __init__(self, settings: Settings, *, policy: StrikePolicy, new_generation: Callable[[], int],
                 backoff: Backoff | None = None) -> None:
        self.settings = settings  # what every new generation is spawned with (its models load after HELLO)
        self.policy = policy
        self.new_generation = new_generation  # daemon-unique numbers, so no handle resolves on another lane
        self.timing = Restarts(backoff or Backoff())
        self.tickets = Tickets()
        self.state = L.STARTING
        self.active: Generation | None = None
        self.standby: Generation | None = None
        self.retiring: list[Generation] = []  # faulted or stopped, not reaped yet
        self.gens: dict[int, Generation] = {}
        self.closing = False
        self.generation = 0  # the active generation's number (the last one's while none is active)
        self.restarts = self.promotions = self.standby_faults = self.rollovers = 0
        # roll_over asked for a successor that has not taken over yet (it loads as the standby does)
        self.rolling = False
        self.after_stop: Stop | None = None  # why the active is STOPPING: what comes once it has ended
        self.quarantine_pending = False  # quarantined while the active generation had work open

    def live(self) -> Iterator[Generation]:
        yield from (g for g in (self.active, self.standby, *self.retiring) if g is not None)

    def next_deadline(self) -> float:
        """When `tick` has something to do (a respawn, a standby, the cool-down's end); inf when nothing."""
        at = [float("inf")]
        if rules.can_respawn(self):
            at.append(self.timing.respawn_at)
        if self.state is L.QUARANTINED and self.policy.quarantined_until is not None:
            at.append(self.policy.quarantined_until)
        if rules.wants_standby(self):
            at.append(self.timing.standby_at)
        return min(at)

    # --- callers -----------------------------------------------------------------------------------

    def submit(self, kind: str, now: float, pinned: int | None = None) -> tuple[Ticket, list[Effect]]:
        """Accept a request (queued in arrival order) or refuse it at once (closing, quarantined). A request
        `pinned` to a generation is sent to that one only, or finished GONE once it has ended."""
        t = self.tickets.new(kind)
        t.pinned = pinned
        if pinned is not None and pinned not in self.gens:
            self.tickets.finish(t, Outcome.GONE, pinned)
        elif self.closing:
            self.tickets.finish(t, Outcome.SHUTTING_DOWN)
        elif self.policy.cooldown_remaining(now) is not None:
            self.tickets.finish(t, Outcome.QUARANTINED)
        else:
            self.tickets.queue.append(t)
        return t, self._settled(now)

    def abandon(self, t: Ticket, now: float) -> list[Effect]:
        """Its caller left. Queued: finished now, it never reaches a worker. Open: its reply still drains."""
        if t.open:
            t.abandoned = True
        elif not t.done and t.kind != RELOAD and t in self.tickets.queue:
            self.tickets.queue.remove(t)
            self.tickets.finish(t, Outcome.ABANDONED)
        return self.tickets.take()

    @property
    def models(self) -> list[str]:
        return list(self.settings.models)

    def retarget(self, settings: Settings) -> None:
        """New settings at once, for the live generations too (an admin LOAD or UNLOAD, applied to them as well)
        and for every later one."""
        self.settings = settings
        for g in self.live():
            g.settings = settings

    def reload(self, now: float, settings: Settings | None = None) -> tuple[Ticket, list[Effect]]:
        """Ordered restart of both workers after what is queued now, the fresh ones with `settings` (None: the
        lane's as they are then). Requests queued before it are served with the old settings, later ones with
        the new. It lifts a quarantine at once; outside one it forgives no strike (only drained serving work
        clears strikes)."""
        t = self.tickets.new(RELOAD)
        t.after, t.settings = self.generation, settings
        if self.closing:
            self.tickets.finish(t, Outcome.SHUTTING_DOWN)
        else:
            self._lift()
            self.tickets.queue.append(t)
        return t, self._settled(now)

    def hold(self, gen: int, on: bool, now: float) -> list[Effect]:
        """Generation `gen` holds work that later requests pinned to it continue (`on`), or no longer does. While
        the active one holds, a roll-over does not take over and a reload at the head of the queue lets those
        requests pass, so no held work is cut off by an ordered stop."""
        if (g := self.gens.get(gen)) is not None:
            g.holds = on
        return self._settled(now)

    @property
    def handing_over(self) -> bool:
        """A roll-over or a queued reload waits for the active generation's held work: add none to it."""
        return self.rolling or any(t.kind == RELOAD for t in self.tickets.queue)

    def lift_quarantine(self, now: float) -> list[Effect]:
        """An unload lifts a quarantine at once, as a reload does."""
        self._lift()
        return self._settled(now)

    def abort(self, now: float) -> list[Effect]:
        """Stop the active generation now, past its open request (which ends aborted), then start a fresh one."""
        a = self.active
        if a is not None and a.state not in (G.ENDING, G.ENDED) and a.stop is not Stop.ABORT:
            self.step_lane(E.ABORT)
            self.after_stop = self.after_stop or Stop.ABORT
            rules.stop(self, a, Stop.ABORT)
        return self.tickets.take()

    def close(self, now: float) -> list[Effect]:
        """Stop admitting. An active generation serves what is queued, then every generation stops in order."""
        if not self.closing:
            self.closing, self.rolling = True, False
            if self.state in (L.RESTARTING, L.QUARANTINED, L.STOPPING):  # no generation will serve them
                self.tickets.fail_queued(Outcome.SHUTTING_DOWN)
            self.step_lane(E.CLOSE)
            if self.state is L.STOPPING:
                self.after_stop = Stop.CLOSE
            rules.retire_standby(self)
        return self._settled(now)

    def cancel(self) -> list[Effect]:
        """The lane task is cancelled: every ticket is answered now, every generation still running is killed."""
        for g in self.live():
            if g.open is not None:
                self.tickets.finish(g.open, Outcome.SHUTTING_DOWN)
                g.open = None
            self.tickets.drop_pending(g, Outcome.SHUTTING_DOWN)
            if g.state not in (G.ENDING, G.ENDED):
                self.tickets.out.append(Kill(g.number))
        self.tickets.fail_queued(Outcome.SHUTTING_DOWN)
        self.closing = True
        self.retiring, self.active, self.standby = list(self.live()), None, None
        if self.state is not L.STOPPED:
            self.step_lane(E.CANCEL)
        return self.tickets.take()

    def ping(self, now: float) -> tuple[Ticket | None, list[Effect]]:
        """A health PING for the active generation, only while it is idle with nothing queued."""
        a = self.active
        if a is None or self.state is not L.READY or a.open or a.pending or self.tickets.queue:
            return None, []
        return self._own(a, "PING", None, now)

    def apply_to_standby(self, kind: str, model: str | None, now: float) -> tuple[Ticket | None, list[Effect]]:
        """An admin LOAD / UNLOAD the active generation acknowledged, for the standby too (or a PING of it). None
        when it needs none: no standby, or one still spawning (its HELLO loads the lane's models as they are)."""
        s = self.standby
        if s is None or s.state not in (G.LOADING, G.READY):
            return None, []
        return self._own(s, kind, model, now)

    def roll_over(self, now: float) -> list[Effect]:
        """Replace the active generation by a fresh one that loads the lane's models as they are now (new settings,
        tuned kernels), failing and delaying no request: the successor starts beside it as the standby does, loads,
        and takes over at the first request boundary after that; the old one then stops in order. A standby with
        the old settings is retired first. Closing or quarantined, there is nothing to roll over."""
        if self.closing or self.policy.quarantined_until is not None or self.active is None:
            return self._settled(now)
        rules.retire_standby(self)
        self.rolling = True
        self.timing.standby_at = now
        return self._settled(now)

    def stop_rolling(self, now: float) -> list[Effect]:
        """The roll-over's caller gave up: a successor that is not a configured standby stops."""
        if self.rolling:
            self.rolling = False
            if not self.settings.standby:
                rules.retire_standby(self)
        return self._settled(now)

    def replace_standby(self, now: float) -> list[Effect]:
        """The standby could not apply what the active generation did: stop it; a fresh one loads the models."""
        if self.standby is not None:
            rules.retire_standby(self)
            self.timing.standby_at = now
        return self._settled(now)

    # --- generations ---------------------------------------------------------------------------------

    def start(self, now: float) -> list[Effect]:
        self.spawn(Role.ACTIVE)
        return self.tickets.take()

    def hello(self, gen: int, now: float) -> list[Effect]:
        g = self.gens[gen]
        g.step(E.HELLO)
        g.connected = True
        if g is self.active:
            self.step_lane(E.HELLO)
        g.pending.extend(self.tickets.new("LOAD", internal=True, model=m) for m in self.models)
        return self._settled(now)

    def progress(self, gen: int, t: Ticket) -> None:
        g = self.gens[gen]
        if g.open is not t:
            raise LifecycleError(f"PROGRESS for ticket {t.id} on generation {gen}, which does not have it open")
        g.step(E.PROGRESS)
        if g is self.active and not t.internal:
            self.step_lane(E.PROGRESS)

    def replied(self, gen: int, t: Ticket, payload: object, *, success: bool, now: float,
                refused: bool = False) -> list[Effect]:
        """The open ticket's terminal reply was drained (`success`: not ERR, not a failed step), or it was refused
        before a byte was written (`refused`: the payload is the error)."""
        g = self.gens.get(gen)
        if g is None or g.open is not t:
            if t.done:  # answered already: the lane was cancelled around it
                return []
            raise LifecycleError(f"reply for ticket {t.id} on generation {gen}, which does not have it open")
        g.step(E.REPLY)
        if g is self.active and not t.internal:
            self.step_lane(E.REPLY)
        g.open, t.open = None, False
        if success and t.kind in SERVING and g is self.active:
            self.policy.success()
            g.served = True
        self.tickets.finish(t, Outcome.REFUSED if refused else Outcome.REPLY, payload)
        if t.kind == "SHUTDOWN":
            self.tickets.out.append(Kill(g.number))  # WORKER_STOPPED: nothing more will come from it
        return self._settled(now)

    def said_stopped(self, gen: int, now: float) -> list[Effect]:
        """WORKER_STOPPED without req_id: the answer to SHUTDOWN abort_in_flight. Unasked for, it is a fault."""
        g = self.gens.get(gen)
        if g is None or g.state in (G.ENDING, G.ENDED):
            return []
        if g.stop is not Stop.ABORT:
            return self.fault(gen, "protocol", now)
        self.tickets.out.append(Kill(gen))
        return self.tickets.take()

    def fault(self, gen: int, cause: str, now: float) -> list[Effect]:
        """It crashed, hung or broke the protocol (`cause`), or its ordered stop ended it (`ordered`). Nothing more
        is sent to it; its open ticket is answered once it is reaped (`ended`), when its exit status is known."""
        g = self.gens[gen]
        if g.state in (G.ENDING, G.ENDED):
            return []
        g.step(E.FAULT)
        genuine = cause != "ordered" and g.stop is None  # what we were stopping anyway is no fault of its own
        g.cause = cause if genuine else "ordered"
        self.tickets.drop_pending(g, Outcome.CRASHED if genuine else Outcome.SHUTTING_DOWN)
        if genuine:
            self.policy.strike(Fault(cause), now)
        if g is self.active:
            self.active = None
            self.retiring.append(g)
            self.step_lane(E.FAULT)
            if genuine:
                self.restarts += 1
                self.timing.active_faulted(g.served)
            if self.closing:  # faulted while draining: what is left fails, the lane stops
                self.after_stop = Stop.CLOSE
                self.tickets.fail_queued(Outcome.SHUTTING_DOWN)
                rules.retire_standby(self)
        elif g is self.standby:
            self.standby = None
            self.retiring.append(g)
            if genuine:
                self.standby_faults += 1
                self.timing.standby_faulted(now)
        if self.policy.cooldown_remaining(now) is not None:
            rules.quarantine(self)
        return self._settled(now)

    def ended(self, gen: int, salvaged: object | None, now: float) -> list[Effect]:
        """Its process is reaped. Its open ticket gets `salvaged` (a complete reply it wrote before exiting) or
        the typed end of that generation."""
        g = self.gens.pop(gen)
        g.step(E.ENDED)
        self.retiring.remove(g)
        self.tickets.drop_pinned(gen)
        if (t := g.open) is not None:
            g.open, t.open = None, False
            if salvaged is not None:
                self.tickets.finish(t, Outcome.REPLY, salvaged)
            elif g.stop is Stop.ABORT:
                self.tickets.finish(t, Outcome.ABORTED, gen)
            elif g.cause == "ordered":
                self.tickets.finish(t, Outcome.SHUTTING_DOWN)
            else:
                self.tickets.finish(t, Outcome.CRASHED, gen)
        if g.cause != "ordered":
            self.tickets.out.append(Crashed(gen, g.role, g.cause or "crash"))
            if g.role is Role.ACTIVE and not g.loaded:  # a reload's fresh generation failed before it loaded
                self.tickets.answer_reloads(Outcome.CRASHED, gen)
        if g.role is Role.ACTIVE and self.active is None and self.state is not L.STOPPED \
                and not any(r.role is Role.ACTIVE for r in self.retiring):
            rules.active_ended(self, now)
        return self._settled(now)

    def tick(self, now: float) -> list[Effect]:
        return self._settled(now)

    # --- primitives, for this class and _lifecycle_rules -----------------------------------------------

    def step_lane(self, event: Event) -> None:
        self.state = step_lane(self.state, event)

    def spawn(self, role: Role) -> None:
        g = Generation(self.new_generation(), role, settings=self.settings)
        self.gens[g.number] = g
        if role is Role.ACTIVE:
            self.active, self.generation = g, g.number
            self.rolling = False  # a fresh active loads the models as they are now: nothing is left to roll over
            self.step_lane(E.SPAWNED)
        else:
            self.standby = g
        self.tickets.out.append(Spawn(g.number, role))

    def send(self, g: Generation, t: Ticket) -> None:
        g.step(E.REQUEST)
        if g is self.active and not t.internal:
            self.step_lane(E.REQUEST)
        g.open, t.open, t.gen = t, True, g.number
        self.tickets.out.append(Send(g.number, t))

    def _own(self, g: Generation, kind: str, model: str | None, now: float) -> tuple[Ticket, list[Effect]]:
        t = self.tickets.new(kind, internal=True, model=model)
        g.pending.append(t)
        return t, self._settled(now)

    def _lift(self) -> None:
        if self.policy.lift():
            self.quarantine_pending = False

    def _settled(self, now: float) -> list[Effect]:
        rules.settle(self, now)
        return self.tickets.take()


__all__ = ["LaneLifecycle", "LifecycleError"]
