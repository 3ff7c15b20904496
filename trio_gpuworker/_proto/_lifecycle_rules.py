"""What a lane does next whenever something changed: send what can be sent, finish loads, serve the queue or stop,
promote the standby, respawn. Functions over a LaneLifecycle, called only by it (`settle` after every event), so
the machine's public methods say what happened and these say what follows."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

from ._lifecycle_parts import (
    RELOAD,
    Abort,
    Generation,
    Kill,
    Outcome,
    Restarts,
    Role,
    Settings,
    Stop,
    Ticket,
    Tickets,
)
from ._lifecycle_table import Event, GenState, LaneState
from ._strikes import StrikePolicy

E, G, L = Event, GenState, LaneState


class LaneLifecycle(Protocol):
    """What the rules read and change of the machine (_lifecycle.LaneLifecycle)."""

    state: LaneState
    active: Generation | None
    standby: Generation | None
    retiring: list[Generation]
    tickets: Tickets
    timing: Restarts
    policy: StrikePolicy
    closing: bool
    settings: Settings
    after_stop: Stop | None
    quarantine_pending: bool
    generation: int
    restarts: int
    promotions: int
    rollovers: int
    rolling: bool

    def live(self) -> Iterator[Generation]: ...

    def step_lane(self, event: Event) -> None: ...

    def spawn(self, role: Role) -> None: ...

    def send(self, g: Generation, t: Ticket) -> None: ...


def settle(m: LaneLifecycle, now: float) -> None:
    while m.state is not L.STOPPED and _step(m, now):
        pass
    if m.state is L.STOPPING and m.after_stop is Stop.CLOSE and not any(m.live()):
        m.step_lane(E.STOPPED)


def stop(m: LaneLifecycle, g: Generation, why: Stop) -> None:
    """Stop `g` in order: SHUTDOWN once its connection is free (graceful), SHUTDOWN abort_in_flight now, or a kill
    while it has no connection yet. The lane's own requests still waiting for it are dropped."""
    if g.state in (G.ENDING, G.ENDED):
        return
    if g.state is G.STOPPING:  # only an abort escalates a stop already under way
        if why is Stop.ABORT and g.stop is not Stop.ABORT:
            g.step(E.ABORT)
            g.stop = why
            m.tickets.out.append(Abort(g.number) if g.connected else Kill(g.number))
        return
    g.step(E.ABORT if why is Stop.ABORT else E.ORDERED_STOP)
    g.stop = why
    m.tickets.drop_pending(g, Outcome.SHUTTING_DOWN)
    if not g.connected:
        m.tickets.out.append(Kill(g.number))
    elif why is Stop.ABORT:
        m.tickets.out.append(Abort(g.number))


def retire_standby(m: LaneLifecycle) -> None:
    s, m.standby = m.standby, None
    if s is not None:
        m.retiring.append(s)
        stop(m, s, Stop.RETIRE)


def quarantine(m: LaneLifecycle) -> None:
    """Quarantine wins over everything: queued requests fail fast, the standby stops, and the active generation
    stops at its next request boundary. A queued reload fails with the rest, but the settings it brings are the
    lane's from now on (no generation serves between): the generation after the quarantine starts with them, as
    the models' new settings, already in force for admission, require."""
    for t in m.tickets.queue:
        if t.kind == RELOAD and t.settings is not None:
            m.settings = t.settings
    m.tickets.fail_queued(Outcome.QUARANTINED)
    m.rolling = False  # its successor stops with the standby; the generation after the quarantine loads anew
    retire_standby(m)
    if m.active is not None:
        m.quarantine_pending = True
    elif m.state is L.RESTARTING:
        m.quarantine_pending = False
        m.step_lane(E.QUARANTINE)


def active_ended(m: LaneLifecycle, now: float) -> None:
    """The last active generation is reaped and none replaced it: what the lane does next."""
    m.step_lane(E.ENDED)
    if m.state is L.RESTARTING:
        m.timing.active_ended(now)
    elif m.state is L.STOPPING:
        if m.closing:
            m.after_stop = Stop.CLOSE
        elif m.after_stop is Stop.QUARANTINE:
            m.after_stop = None
            m.step_lane(E.QUARANTINE)
        else:  # reload, abort: a fresh generation at once, no backoff, no strike
            m.restarts += m.after_stop is Stop.ABORT
            m.after_stop = None
            m.spawn(Role.ACTIVE)


def can_respawn(m: LaneLifecycle) -> bool:
    return m.state is L.RESTARTING and m.active is None and m.standby is None \
        and not any(g.role is Role.ACTIVE for g in m.retiring)


def wants_standby(m: LaneLifecycle) -> bool:
    """A standby to start: the configured one, or a roll-over's successor (which loads as a standby does)."""
    return (m.settings.standby or m.rolling) and m.standby is None and not m.closing \
        and m.policy.quarantined_until is None and m.state in (L.READY, L.BUSY)


def _step(m: LaneLifecycle, now: float) -> bool:
    if m.state is L.QUARANTINED and m.policy.cooldown_remaining(now) is None:
        m.step_lane(E.COOLDOWN_OVER)  # a fresh worker with zero strikes, at once
        m.timing.at_once(now)
        return True
    for g in list(m.live()):
        if g.open is not None or not g.connected or g.state in (G.ENDING, G.ENDED):
            continue
        if g.pending:
            m.send(g, g.pending.popleft())
            return True
        if g.state is G.LOADING:
            _loaded(m, g)
            return True
        if g.state is G.STOPPING and not g.shutdown_sent and g.stop is not Stop.ABORT:
            g.shutdown_sent = True
            m.send(g, m.tickets.new("SHUTDOWN", internal=True))
            return True
    return _roll_over(m, now) or _serve_next(m) or _promote(m, now) or _respawn(m, now)


def _loaded(m: LaneLifecycle, g: Generation) -> None:
    g.step(E.LOADED)
    g.loaded = True
    if g is m.active:
        m.step_lane(E.LOADED)
        m.tickets.answer_reloads(Outcome.RELOADED, g.number)


def _serve_next(m: LaneLifecycle) -> bool:
    a = m.active
    if a is None or a.state is not G.READY or a.open is not None or a.pending:
        return False
    if m.quarantine_pending:
        m.quarantine_pending = False
        _stop_active(m, a, Stop.QUARANTINE, E.ORDERED_STOP)
        return True
    queue = m.tickets.queue
    while queue:
        if queue[0].kind == RELOAD and a.holds and not m.closing:
            # the active generation's held work goes on first: only the requests that continue it pass
            if (more := next((t for t in queue if t.pinned == a.number), None)) is None:
                return False
            queue.remove(more)
            m.send(a, more)
            return True
        t = queue.popleft()
        if t.pinned is not None and t.pinned != a.number:
            m.tickets.finish(t, Outcome.GONE, t.pinned)  # its generation is not the one serving now
            continue
        if t.kind != RELOAD:
            m.send(a, t)
            return True
        if a.number > t.after and (t.settings is None or a.settings == t.settings):
            m.tickets.finish(t, Outcome.RELOADED, a.number)  # fresher than the one the reload was asked of
            continue
        if m.closing:  # no fresh generation will come
            m.tickets.finish(t, Outcome.SHUTTING_DOWN)
            continue
        if t.settings is not None:  # what it brings applies from the generation it starts on
            m.settings = t.settings
        m.tickets.reloads.append(t)
        _stop_active(m, a, Stop.RELOAD, E.RELOAD)
        return True
    if m.closing:
        _stop_active(m, a, Stop.CLOSE, E.ORDERED_STOP)
        return True
    return False


def _stop_active(m: LaneLifecycle, a: Generation, why: Stop, event: Event) -> None:
    m.step_lane(event)
    m.after_stop = why
    stop(m, a, why)
    retire_standby(m)  # a reload restarts both: the standby has the old settings
    m.timing.standby_at = 0.0  # the successor's standby starts as soon as it serves


def _roll_over(m: LaneLifecycle, now: float) -> bool:
    """The successor is loaded and the active generation is between requests: it takes over, before the next
    queued request is sent, so no request waits for a load and none sees two workers of the lane at once."""
    a, s = m.active, m.standby
    if not m.rolling or m.state is not L.READY or a is None or a.state is not G.READY or a.open is not None \
            or a.pending or a.holds or s is None or s.state is not G.READY or s.open is not None or s.pending:
        return False
    m.rolling = False
    m.retiring.append(a)
    stop(m, a, Stop.RETIRE)  # SHUTDOWN graceful on its idle connection: it has nothing open
    s.step(E.PROMOTE)
    s.role = Role.ACTIVE
    m.active, m.standby, m.generation = s, None, s.number
    m.step_lane(E.ROLL_OVER)
    m.rollovers += 1
    m.timing.standby_at = now  # a configured standby comes back at once, with the new settings
    return True


def _promote(m: LaneLifecycle, now: float) -> bool:
    s = m.standby
    if m.state is not L.RESTARTING or m.active is not None or s is None or s.state is not G.READY \
            or s.open is not None or s.pending:
        return False
    s.step(E.PROMOTE)
    s.role = Role.ACTIVE
    m.active, m.standby, m.generation = s, None, s.number
    m.rolling = False  # a roll-over's successor promoted after a fault: it has the new settings already
    m.step_lane(E.PROMOTE)
    m.promotions += 1
    m.timing.standby_promoted(now)
    return True


def _respawn(m: LaneLifecycle, now: float) -> bool:
    if can_respawn(m) and now >= m.timing.respawn_at:
        m.spawn(Role.ACTIVE)
        return True
    if wants_standby(m) and now >= m.timing.standby_at:
        m.spawn(Role.STANDBY)
        return True
    return False
