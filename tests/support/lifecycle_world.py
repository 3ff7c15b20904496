"""A stand-in for the trio lane around the pure LaneLifecycle: it carries effects out the way supervisor/_lane.py
does (a Spawn starts a process, a Send opens a request, a Kill ends a generation in order, a Finish answers a
caller) and lists the events the world could feed next, so tests can walk every short sequence of them."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

from trio_gpuworker._proto import (
    Abort,
    Backoff,
    Crashed,
    Effect,
    Finish,
    GenState,
    Kill,
    LaneLifecycle,
    LaneState,
    Outcome,
    PlainSettings,
    Send,
    Spawn,
    StrikePolicy,
)
from trio_gpuworker._proto import LaneTicket as Ticket


@dataclass
class World:
    standby: bool = True
    strikes: int = 2
    models: tuple[str, ...] = ("m",)
    now: float = 0.0
    machine: LaneLifecycle = field(init=False)
    spawned: dict[int, str] = field(default_factory=dict)  # generation -> role, while its process runs
    sent: dict[int, Ticket] = field(default_factory=dict)  # generation -> ticket open on its connection
    killed: set[int] = field(default_factory=set)
    dying: set[int] = field(default_factory=set)  # faulted, not reaped
    answers: dict[int, list[tuple[Outcome, object]]] = field(default_factory=dict)  # ticket id -> Finishes
    tickets: dict[int, Ticket] = field(default_factory=dict)
    crashed: list[int] = field(default_factory=list)
    aborted: set[int] = field(default_factory=set)
    counter: itertools.count = field(default_factory=lambda: itertools.count(1))

    def __post_init__(self) -> None:
        self.machine = LaneLifecycle(PlainSettings(tuple(self.models), self.standby),
                                     policy=StrikePolicy(self.strikes, 600.0),
                                     new_generation=lambda: next(self.counter), backoff=Backoff(0.1, 2.0, 1.0))
        self.apply(self.machine.start(self.now))

    # --- carrying effects out ------------------------------------------------------------------

    def apply(self, effects: list[Effect]) -> None:
        for e in effects:
            if isinstance(e, Spawn):
                self.spawned[e.gen] = e.role.value
            elif isinstance(e, Send):
                assert e.gen not in self.sent, f"two requests open on generation {e.gen}"
                assert e.gen in self.spawned and e.gen not in self.dying and e.gen not in self.killed
                self.sent[e.gen] = e.ticket
            elif isinstance(e, Kill):
                self.killed.add(e.gen)
            elif isinstance(e, Abort):
                self.aborted.add(e.gen)
            elif isinstance(e, Finish):
                self.answers.setdefault(e.ticket.id, []).append((e.outcome, e.payload))
                self.tickets[e.ticket.id] = e.ticket
                if e.outcome is Outcome.REPLY and not e.ticket.internal:
                    assert e.payload == ("reply", e.ticket.gen, e.ticket.id), "answered by the wrong generation"
            elif isinstance(e, Crashed):
                self.crashed.append(e.gen)

    def feed(self, fn: Callable[..., list[Effect]], *args: object) -> None:
        self.apply(fn(*args))

    # --- what the world may do next ------------------------------------------------------------

    def choices(self) -> list[tuple[str, tuple[object, ...]]]:
        m = self.machine
        out: list[tuple[str, tuple[object, ...]]] = [("submit", ("EMBED_BATCH",)), ("reload", ()), ("abort", ()),
                                                     ("close", ()), ("tick", (0.5,)), ("lift", ())]
        for gen in sorted(self.spawned):
            g = m.gens.get(gen)
            if g is None:
                continue
            if gen in self.dying:
                out.append(("end", (gen,)))
                continue
            if gen in self.killed:
                out.append(("fault", (gen, "ordered")))
                continue
            if g.state is GenState.SPAWNING:
                out.append(("hello", (gen,)))
            if gen in self.sent:
                out += [("reply", (gen, True)), ("reply", (gen, False)), ("refuse", (gen,))]
            if gen in self.aborted:
                out.append(("said_stopped", (gen,)))
            out += [("fault", (gen, "crash")), ("fault", (gen, "hang"))]
        queued = [t for t in m.tickets.queue if t.kind != "__RELOAD__"]
        if queued:
            out.append(("abandon", (queued[0].id,)))
        out += [("ping", ()), ("apply", ()), ("roll_over", ()), ("stop_rolling", ())]
        return out

    def do(self, name: str, args: tuple[object, ...]) -> None:
        m, now = self.machine, self.now
        if name == "submit":
            t, eff = m.submit(str(args[0]), now)
            self.tickets[t.id] = t
            self.apply(eff)
        elif name == "reload":
            t, eff = m.reload(now)
            self.tickets[t.id] = t
            self.apply(eff)
        elif name == "abort":
            self.feed(m.abort, now)
        elif name == "close":
            self.feed(m.close, now)
        elif name == "roll_over":
            self.feed(m.roll_over, now)
        elif name == "stop_rolling":
            self.feed(m.stop_rolling, now)
        elif name == "lift":
            self.feed(m.lift_quarantine, now)
        elif name == "tick":
            self.now += float(args[0])  # type: ignore[arg-type]
            self.feed(m.tick, self.now)
        elif name == "hello":
            self.feed(m.hello, args[0], now)
        elif name in ("reply", "refuse"):
            gen = int(args[0])  # type: ignore[call-overload]
            t = self.sent.pop(gen)
            ok = name == "reply" and bool(args[1])
            payload = ("reply", gen, t.id) if name == "reply" else ("refused", gen, t.id)
            self.feed(lambda: m.replied(gen, t, payload, success=ok, now=now, refused=name == "refuse"))
        elif name == "said_stopped":
            self.feed(m.said_stopped, args[0], now)
        elif name == "fault":
            gen = int(args[0])  # type: ignore[call-overload]
            self.dying.add(gen)
            self.feed(m.fault, gen, args[1], now)
        elif name == "end":
            gen = int(args[0])  # type: ignore[call-overload]
            self.dying.discard(gen)
            self.spawned.pop(gen)
            t = self.sent.pop(gen, None)
            salvaged = ("reply", gen, t.id) if t is not None and t.id % 3 == 0 else None
            self.feed(m.ended, gen, salvaged, now)
        elif name == "abandon":
            t = self.tickets[int(args[0])]  # type: ignore[call-overload]
            self.feed(m.abandon, t, now)
        elif name == "ping":
            _, eff = m.ping(now)
            self.apply(eff)
        elif name == "apply":
            _, eff = m.apply_to_standby("LOAD", "m2", now)
            self.apply(eff)

    # --- invariants ----------------------------------------------------------------------------

    def check(self) -> None:
        m = self.machine
        for tid, answers in self.answers.items():
            assert len(answers) == 1, f"ticket {tid} answered {len(answers)} times: {answers}"
        for g in m.live():
            if g.open is not None:
                assert g.open.gen == g.number and not g.open.done
                assert self.sent.get(g.number) is g.open or g.number in self.dying
        a = m.active
        if m.state is LaneState.BUSY:
            assert a is not None and a.open is not None and not a.open.internal
        if m.state in (LaneState.READY, LaneState.BUSY):
            assert a is not None and a.state is GenState.READY
        if m.state in (LaneState.RESTARTING, LaneState.QUARANTINED, LaneState.STOPPED):
            assert a is None
        if m.state is LaneState.QUARANTINED:
            assert m.standby is None and not m.tickets.queue
        # one request of the lane's callers open at a time, on its active generation: a roll-over's old worker
        # and its successor never serve side by side
        user = [g for g in m.live() if g.open is not None and not g.open.internal and g.number not in self.dying]
        assert len(user) <= 1 and all(g is a for g in user), [g.number for g in user]
        assert len([g for g in m.live() if g.open is not None]) <= len(list(m.live()))

    def finish_everything(self, limit: int = 400) -> None:
        """Close the lane, then answer every effect as a well-behaved world would until it is STOPPED."""
        self.feed(self.machine.close, self.now)
        for _ in range(limit):
            if self.machine.state is LaneState.STOPPED:
                return
            self.check()
            for name, args in self.choices():
                if name in ("end", "hello") or (name == "fault" and args[1] == "ordered") or \
                        (name == "reply" and args[1]) or name == "said_stopped":
                    self.do(name, args)
                    break
            else:
                self.do("tick", (1.0,))
        raise AssertionError(f"the lane did not stop: {self.machine.state}")

    def unanswered(self) -> list[Ticket]:
        return [t for t in self.tickets.values() if not t.internal and t.id not in self.answers]
