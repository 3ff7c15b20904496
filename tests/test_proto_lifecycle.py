"""The pure lane lifecycle machine on its own: its tables, hand-written transitions, every short sequence of
events, and hypothesis over longer ones. Every ticket must end in exactly one answer, from the generation it was
sent to, and the lane must be able to stop from anywhere."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.lifecycle_world import World
from trio_gpuworker._proto import PlainSettings
from trio_gpuworker._proto._lifecycle_parts import Outcome, Send, Ticket
from trio_gpuworker._proto._lifecycle_table import (
    GENERATION_TRANSITIONS,
    LANE_TRANSITIONS,
    Event,
    GenState,
    LaneState,
    LifecycleError,
    step_lane,
)

L = LaneState


def ready(w: World, gen: int = 1) -> None:
    w.do("hello", (gen,))
    while gen in w.sent and w.sent[gen].internal:  # its model loads
        w.do("reply", (gen, True))


def sent_user(w: World, gen: int) -> Ticket:
    t = w.sent[gen]
    assert not t.internal
    return t


# --- the tables ------------------------------------------------------------------------------------


def test_every_state_is_in_both_tables_and_targets_are_states() -> None:
    assert set(LANE_TRANSITIONS) == set(LaneState)
    assert set(GENERATION_TRANSITIONS) == set(GenState)
    for table in (*LANE_TRANSITIONS.values(), *GENERATION_TRANSITIONS.values()):
        assert all(isinstance(e, Event) for e in table)


def test_stopped_is_terminal_and_cancel_reaches_it_from_everywhere() -> None:
    assert LANE_TRANSITIONS[L.STOPPED] == {}
    for state in LaneState:
        if state is not L.STOPPED:
            assert step_lane(state, Event.CANCEL) is L.STOPPED


def test_an_event_the_table_lacks_is_our_bug() -> None:
    with pytest.raises(LifecycleError, match="reply is not allowed while restarting"):
        step_lane(L.RESTARTING, Event.REPLY)


# --- hand-written paths ----------------------------------------------------------------------------


def test_start_load_serve() -> None:
    w = World(standby=False)
    assert w.machine.state is L.STARTING and w.spawned == {1: "active"}
    w.do("hello", (1,))
    assert w.machine.state is L.LOADING and w.sent[1].kind == "LOAD" and w.sent[1].internal
    w.do("reply", (1, True))
    assert w.machine.state is L.READY
    w.do("submit", ("EMBED_BATCH",))
    t = sent_user(w, 1)
    assert w.machine.state is L.BUSY and t.gen == 1
    w.do("reply", (1, True))
    assert w.answers[t.id] == [(Outcome.REPLY, ("reply", 1, t.id))]
    assert w.machine.state is L.READY


def test_one_request_at_a_time_in_arrival_order() -> None:
    w = World(standby=False)
    ready(w)
    for _ in range(3):
        w.do("submit", ("EMBED_BATCH",))
    order = []
    while 1 in w.sent:
        order.append(w.sent[1].id)
        w.do("reply", (1, True))
    assert order == sorted(order) and len(order) == 3


def test_a_crash_answers_the_open_request_then_restarts_with_backoff() -> None:
    w = World(standby=False)
    ready(w)
    w.do("submit", ("EMBED_BATCH",))
    w.do("submit", ("EMBED_BATCH",))
    t = sent_user(w, 1)
    w.do("fault", (1, "crash"))
    assert w.machine.state is L.RESTARTING and w.machine.policy.strikes == 1
    assert t.id not in w.answers  # answered once reaped, with its exit status
    w.do("end", (1,))
    assert w.answers[t.id] == [(Outcome.CRASHED, 1)] or t.id % 3 == 0
    assert w.crashed == [1] and 2 not in w.spawned  # the backoff first
    w.do("tick", (0.5,))
    assert w.spawned == {2: "active"} and w.machine.state is L.STARTING
    ready(w, 2)
    assert sent_user(w, 2).gen == 2  # the queued request goes to the new generation, never the old one


def test_ordered_abort_answers_the_request_in_flight() -> None:
    """A request in flight during an ordered stop is answered, typed, from its generation."""
    w = World(standby=False)
    ready(w)
    w.do("submit", ("GENERATE",))
    w.do("submit", ("GENERATE",))
    t = sent_user(w, 1)
    w.do("abort", ())
    assert w.aborted == {1} and w.machine.state is L.STOPPING
    w.do("said_stopped", (1,))
    w.do("fault", (1, "ordered"))
    w.do("end", (1,))
    if t.id % 3:
        assert w.answers[t.id] == [(Outcome.ABORTED, 1)]
    assert w.machine.policy.strikes == 0 and w.crashed == []
    assert 2 in w.spawned  # a fresh worker at once, no backoff
    ready(w, 2)
    assert sent_user(w, 2).gen == 2


def test_a_promoted_standby_never_carries_two_requests() -> None:
    """The standby is applying an admin LOAD when the active crashes; it is promoted only once
    that LOAD is answered, and the next request goes to it alone."""
    w = World(standby=True)
    ready(w)
    ready(w, 2)  # the standby
    t, eff = w.machine.apply_to_standby("LOAD", "m2", w.now)
    w.apply(eff)
    assert w.sent[2] is t
    w.do("fault", (1, "crash"))
    w.do("submit", ("EMBED_BATCH",))
    assert w.machine.state is L.RESTARTING and w.machine.active is None  # not promoted while it is busy
    assert w.sent[2] is t
    w.do("end", (1,))
    w.do("reply", (2, True))  # the LOAD is answered: now it is promoted and gets the request
    assert w.machine.state is L.BUSY and w.machine.generation == 2
    user = sent_user(w, 2)
    assert user.gen == 2 and w.machine.promotions == 1


@pytest.mark.parametrize("standby", [False, True])
def test_a_roll_over_hands_over_at_a_request_boundary_and_fails_nothing(standby: bool) -> None:
    """Roll-over: tuned kernels take over without failing or delaying a request. The successor loads beside the
    busy active generation; the request queued meanwhile goes to the successor once the open one is answered,
    and the old generation then gets SHUTDOWN, in order, with no strike."""
    w = World(standby=standby)
    ready(w)
    if standby:
        ready(w, 2)
    w.do("submit", ("EMBED_BATCH",))
    first = sent_user(w, 1)
    w.do("roll_over", ())
    succ = 3 if standby else 2
    if standby:  # the old settings' standby is retired, its successor spawned
        assert 2 in w.killed or w.sent[2].kind == "SHUTDOWN"
    assert w.spawned[succ] == "standby" and w.machine.rolling
    ready(w, succ)
    w.do("submit", ("EMBED_BATCH",))
    assert w.machine.generation == 1 and succ not in w.sent  # not beside the open request
    w.do("reply", (1, True))
    assert w.answers[first.id] == [(Outcome.REPLY, ("reply", 1, first.id))]
    assert w.machine.generation == succ and w.machine.rollovers == 1 and not w.machine.rolling
    assert sent_user(w, succ).gen == succ and w.sent[1].kind == "SHUTDOWN"
    w.do("reply", (1, True))
    w.do("fault", (1, "ordered"))
    w.do("end", (1,))
    assert w.crashed == [] and w.machine.policy.strikes == 0 and w.machine.state is L.BUSY
    w.do("reply", (succ, True))
    assert not w.unanswered()
    if standby:  # the configured standby comes back with the new settings
        w.do("tick", (0.5,))
        assert [r for g, r in w.spawned.items() if g > succ] == ["standby"]


def test_a_roll_over_whose_active_crashes_promotes_the_successor() -> None:
    w = World(standby=False)
    ready(w)
    w.do("submit", ("EMBED_BATCH",))
    t = sent_user(w, 1)
    w.do("roll_over", ())
    ready(w, 2)
    w.do("fault", (1, "crash"))
    w.do("end", (1,))
    assert w.answers[t.id][0][0] in (Outcome.CRASHED, Outcome.REPLY)
    assert w.machine.generation == 2 and w.machine.state is L.READY and not w.machine.rolling
    assert w.machine.rollovers == 0 and w.machine.promotions == 1


def test_a_roll_over_given_up_stops_its_successor_and_none_while_closing() -> None:
    w = World(standby=False)
    ready(w)
    w.do("roll_over", ())
    w.do("stop_rolling", ())
    assert 2 in w.killed and w.machine.standby is None and not w.machine.rolling
    w.do("close", ())
    w.do("roll_over", ())
    assert not w.machine.rolling and 3 not in w.spawned


def test_two_strikes_quarantine_and_a_reload_lifts_it() -> None:
    w = World(standby=False)
    ready(w)
    w.do("fault", (1, "crash"))
    w.do("end", (1,))
    w.do("tick", (0.5,))
    w.do("fault", (2, "hang"))
    assert w.machine.state is L.QUARANTINED
    w.do("submit", ("EMBED_BATCH",))
    assert list(w.answers.values())[-1] == [(Outcome.QUARANTINED, None)]
    w.do("end", (2,))
    w.do("reload", ())
    assert w.machine.policy.strikes == 0 and w.machine.state is L.STARTING


def test_a_quarantine_fails_a_queued_reload_but_keeps_its_settings() -> None:
    """The settings a reload brings are the operator's: a quarantine that fails it before it reaches the head of
    the queue must not drop them, or the generation after the quarantine starts with the old ones."""
    w = World(standby=False)
    ready(w)
    w.do("submit", ("EMBED_BATCH",))  # open on generation 1: the reload queues behind the next one
    w.do("submit", ("EMBED_BATCH",))
    new = PlainSettings(("m", "n"), False)
    t, eff = w.machine.reload(w.now, new)
    w.tickets[t.id] = t
    w.apply(eff)
    w.do("fault", (1, "crash"))
    w.do("end", (1,))
    w.do("tick", (0.5,))
    w.do("fault", (2, "hang"))
    assert w.machine.state is L.QUARANTINED
    assert w.answers[t.id] == [(Outcome.QUARANTINED, None)]
    assert w.machine.settings == new


def test_reload_outside_a_quarantine_forgives_no_strike() -> None:
    """Only drained serving work clears strikes."""
    w = World(standby=False)
    ready(w)
    w.do("fault", (1, "crash"))
    w.do("end", (1,))
    w.do("tick", (0.5,))
    ready(w, 2)
    w.do("reload", ())
    assert w.machine.policy.strikes == 1
    w.do("reply", (2, True))  # the SHUTDOWN
    w.do("fault", (2, "ordered"))
    w.do("end", (2,))
    ready(w, 3)
    assert w.machine.policy.strikes == 1
    w.do("submit", ("RERANK",))
    w.do("reply", (3, True))
    assert w.machine.policy.strikes == 0


def test_close_serves_what_is_queued_then_stops() -> None:
    w = World(standby=True)
    ready(w)
    ready(w, 2)
    for _ in range(2):
        w.do("submit", ("EMBED_BATCH",))
    w.do("close", ())
    assert w.machine.state is L.DRAINING
    w.do("submit", ("EMBED_BATCH",))
    assert list(w.answers.values())[-1] == [(Outcome.SHUTTING_DOWN, None)]
    w.finish_everything()
    assert not w.unanswered()
    assert all(a[0][0] is not Outcome.CRASHED for a in w.answers.values())


def test_a_send_is_only_ever_to_a_live_generation() -> None:
    w = World(standby=False)
    ready(w)
    w.do("fault", (1, "crash"))
    w.do("submit", ("EMBED_BATCH",))
    assert not any(isinstance(e, Send) for e in w.machine.tick(w.now))  # queued, not sent to the dying one
    assert 1 not in w.sent


# --- every short sequence, and hypothesis over longer ones ---------------------------------------


def walk(w: World, picks: list[int]) -> None:
    for pick in picks:
        options = w.choices()
        name, args = options[pick % len(options)]
        w.do(name, args)
        w.check()
    w.finish_everything()
    w.check()
    assert not w.unanswered(), [t for t in w.unanswered()]


def sequences(depth: int, width: int) -> list[list[int]]:
    out: list[list[int]] = [[]]
    for _ in range(depth):
        out = [[*s, k] for s in out for k in range(width)]
    return out


@pytest.mark.parametrize("standby", [False, True])
def test_every_short_sequence_answers_every_request_once(standby: bool) -> None:
    """All sequences of 4 events over the first 12 choices the world offers at each step."""
    for picks in sequences(4, 12):
        walk(World(standby=standby), picks)


@settings(max_examples=400, deadline=None)
@given(picks=st.lists(st.integers(0, 40), max_size=40), standby=st.booleans(), strikes=st.integers(1, 3))
def test_random_sequences_answer_every_request_once(picks: list[int], standby: bool, strikes: int) -> None:
    walk(World(standby=standby, strikes=strikes), picks)
