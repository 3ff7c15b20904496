"""The lane lifecycle's states, events and its two transition tables (docs/architecture.md, 'Lane states').

A lane's state is the state of its *active* slot as callers see it; each worker generation (active, standby or
one being retired) has a state of its own. Nothing changes either state except `step_lane` / `step_generation`
below, which look the pair (state, event) up and raise LifecycleError when the table has no entry: a bug of
ours, never of the worker's. The machine that feeds these events is `_lifecycle.LaneLifecycle`.
"""

from __future__ import annotations

from enum import StrEnum

from .._errors import LocalProtocolError


class LifecycleError(LocalProtocolError):
    """An event the lane's transition table does not allow in the current state (our bug, not the worker's)."""

    code = "lifecycle_violation"


class LaneState(StrEnum):
    """A lane's state as /v1/lanes reports it (docs/architecture.md, 'Lane states')."""
    STARTING = "starting"  # the active generation is spawning or in HELLO
    LOADING = "loading"  # past HELLO, loading the lane's models
    READY = "ready"  # serving, nothing open
    BUSY = "busy"  # a request is open on the active generation
    DRAINING = "draining"  # closing: the active generation serves what is queued, nothing new is accepted
    STOPPING = "stopping"  # the active generation is being stopped in order (reload, abort, close, quarantine)
    RESTARTING = "restarting"  # no active generation: backoff after a fault, or waiting for the standby to settle
    QUARANTINED = "quarantined"  # consecutive faults: no worker runs until the cool-down is over
    STOPPED = "stopped"  # closed for good


# a lane that takes requests now; StrEnum members equal their values, so this also matches status() strings
SERVING_STATES = frozenset({LaneState.READY, LaneState.BUSY})


class GenState(StrEnum):
    SPAWNING = "spawning"  # its process runs; HELLO not accepted yet
    LOADING = "loading"  # past HELLO, loading the lane's models
    READY = "ready"  # loaded: serves (active) or waits idle (standby)
    STOPPING = "stopping"  # an ordered stop is under way (SHUTDOWN graceful, abort_in_flight, or a kill)
    ENDING = "ending"  # faulted or stopped: nothing more is sent, its process is being reaped
    ENDED = "ended"  # reaped


class Event(StrEnum):
    SPAWNED = "spawned"  # a generation's process was started
    HELLO = "hello"  # its handshake completed
    LOADED = "loaded"  # it loaded the lane's models (failed loads are recorded, not fatal)
    REQUEST = "request"  # a request was written on its connection
    REPLY = "reply"  # the open request's terminal reply was drained (or it was refused before a byte went out)
    PROGRESS = "progress"  # validated PROGRESS for the open request
    FAULT = "fault"  # it crashed, hung or broke the protocol, or its ordered stop ended it
    ENDED = "ended"  # its process is reaped
    ORDERED_STOP = "ordered_stop"  # stop in order: close, quarantine, or a standby's retirement
    RELOAD = "reload"  # a reload reached the head of the queue: stop in order, then a fresh generation
    ABORT = "abort"  # abort_in_flight: SHUTDOWN now, past the open request, then a fresh generation
    PROMOTE = "promote"  # the ready standby takes over as the active generation
    ROLL_OVER = "roll_over"  # a loaded successor takes over from the idle active generation, which stops in order
    QUARANTINE = "quarantine"  # the strike policy quarantined the lane
    COOLDOWN_OVER = "cooldown_over"  # the quarantine's cool-down ended (or a reload lifted it)
    CLOSE = "close"  # stop admitting; what is queued is still served
    STOPPED = "stopped"  # closing, and every generation is reaped
    CANCEL = "cancel"  # the lane task itself is cancelled: every open and queued request is answered now


L, G, E = LaneState, GenState, Event

# What callers see. Several events leave the state as it is; they are listed so that an event arriving where it
# cannot happen (a REPLY while RESTARTING, a REQUEST while STOPPING) is a LifecycleError.
LANE_TRANSITIONS: dict[LaneState, dict[Event, LaneState]] = {
    L.STARTING: {E.SPAWNED: L.STARTING, E.HELLO: L.LOADING, E.FAULT: L.RESTARTING, E.ABORT: L.STOPPING,
                 E.ORDERED_STOP: L.STOPPING, E.RELOAD: L.STOPPING, E.CLOSE: L.DRAINING},
    L.LOADING: {E.LOADED: L.READY, E.PROGRESS: L.LOADING, E.FAULT: L.RESTARTING, E.ABORT: L.STOPPING,
                E.ORDERED_STOP: L.STOPPING, E.RELOAD: L.STOPPING, E.CLOSE: L.DRAINING},
    L.READY: {E.REQUEST: L.BUSY, E.FAULT: L.RESTARTING, E.ABORT: L.STOPPING, E.ORDERED_STOP: L.STOPPING,
              E.RELOAD: L.STOPPING, E.CLOSE: L.DRAINING, E.ROLL_OVER: L.READY},
    L.BUSY: {E.REPLY: L.READY, E.PROGRESS: L.BUSY, E.FAULT: L.RESTARTING, E.ABORT: L.STOPPING,
             E.CLOSE: L.DRAINING},
    L.DRAINING: {E.HELLO: L.DRAINING, E.LOADED: L.DRAINING, E.REQUEST: L.DRAINING, E.REPLY: L.DRAINING,
                 E.PROGRESS: L.DRAINING, E.FAULT: L.STOPPING, E.ABORT: L.STOPPING, E.ORDERED_STOP: L.STOPPING,
                 E.CLOSE: L.DRAINING},
    L.STOPPING: {E.REQUEST: L.STOPPING, E.REPLY: L.STOPPING, E.PROGRESS: L.STOPPING, E.FAULT: L.STOPPING,
                 E.ENDED: L.STOPPING, E.SPAWNED: L.STARTING, E.QUARANTINE: L.QUARANTINED, E.STOPPED: L.STOPPED,
                 E.CLOSE: L.STOPPING, E.ABORT: L.STOPPING},
    L.RESTARTING: {E.SPAWNED: L.STARTING, E.PROMOTE: L.READY, E.QUARANTINE: L.QUARANTINED, E.ENDED: L.RESTARTING,
                   E.RELOAD: L.RESTARTING, E.CLOSE: L.STOPPING},
    L.QUARANTINED: {E.COOLDOWN_OVER: L.RESTARTING, E.ENDED: L.QUARANTINED, E.CLOSE: L.STOPPING},
    L.STOPPED: {},
}
for _state, _table in LANE_TRANSITIONS.items():
    if _state is not L.STOPPED:
        _table[E.CANCEL] = L.STOPPED

# One worker generation, whichever role it plays. REQUEST/REPLY/PROGRESS are the one request open on its
# connection (the machine holds which): allowed only where a request can be open.
GENERATION_TRANSITIONS: dict[GenState, dict[Event, GenState]] = {
    G.SPAWNING: {E.HELLO: G.LOADING, E.FAULT: G.ENDING, E.ORDERED_STOP: G.STOPPING, E.ABORT: G.STOPPING},
    G.LOADING: {E.REQUEST: G.LOADING, E.REPLY: G.LOADING, E.PROGRESS: G.LOADING, E.LOADED: G.READY,
                E.FAULT: G.ENDING, E.ORDERED_STOP: G.STOPPING, E.ABORT: G.STOPPING},
    G.READY: {E.REQUEST: G.READY, E.REPLY: G.READY, E.PROGRESS: G.READY, E.PROMOTE: G.READY, E.FAULT: G.ENDING,
              E.ORDERED_STOP: G.STOPPING, E.ABORT: G.STOPPING},
    G.STOPPING: {E.REQUEST: G.STOPPING, E.REPLY: G.STOPPING, E.PROGRESS: G.STOPPING, E.FAULT: G.ENDING,
                 E.ABORT: G.STOPPING},
    # a reply (or PROGRESS) read just before the fault is still its own: the exchange had it when the fault came
    G.ENDING: {E.ENDED: G.ENDED, E.REPLY: G.ENDING, E.PROGRESS: G.ENDING},
    G.ENDED: {},
}


def step_lane(state: LaneState, event: Event) -> LaneState:
    try:
        return LANE_TRANSITIONS[state][event]
    except KeyError:
        raise LifecycleError(f"lane: {event.value} is not allowed while {state.value}") from None


def step_generation(state: GenState, event: Event) -> GenState:
    try:
        return GENERATION_TRANSITIONS[state][event]
    except KeyError:
        raise LifecycleError(f"generation: {event.value} is not allowed while {state.value}") from None
