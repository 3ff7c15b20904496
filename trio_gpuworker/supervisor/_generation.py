"""One worker generation as the trio lane runs it: its WorkerProcess, the RequestTracker of its connection, what
it loaded, and `host`, the task that runs it from launch to reap. Which requests it gets and when it stops are the
lane lifecycle's decisions (_proto/_lifecycle.py); this only carries them out and reports what happened."""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Callable, Mapping

import trio

from .._config import Windows
from .._errors import EngineCrashed
from .._proto import (
    MESSAGES,
    Err,
    Load,
    Loaded,
    Ping,
    Reply,
    ReplyKind,
    Shutdown,
    Unload,
    WireMessage,
)
from ._jobs import LoadSpec
from ._worker import WorkerProcess


def numbering() -> Callable[[], int]:
    """One supervisor's generation numbers: shared by all of its lanes, so a device handle, ring or role of one
    generation can never resolve on another lane's worker (docs/architecture.md, 'Identity'). Handles of another
    supervisor (an earlier one in the same process) are refused by the data plane's registry of live handles."""
    return itertools.count(1).__next__


class Generation:
    def __init__(self, number: int, role: str, wp: WorkerProcess) -> None:
        self.number = number
        self.role = role  # "active" or "standby" when spawned (a standby may be promoted later)
        self.wp = wp
        self.models: list[str] = []
        self.beams: dict[str, int] = {}  # the BEAM width each of its models loads with (its settings at spawn)
        self.load_errors: dict[str, str] = {}
        self.nursery: trio.Nursery | None = None
        self.rc: int | None = None
        self.error: EngineCrashed | None = None  # how its end reads to callers, once reaped after a fault
        self.reaped = trio.Event()

    def describe(self, state: str) -> dict[str, object]:
        return {"generation": self.number, "pid": self.wp.pid, "state": state, "models": list(self.models)}

    def loaded(self, model: str, reply: WireMessage) -> None:
        """A LOAD's answer: what it loaded, or why it could not (recorded, not fatal: the others still load)."""
        match reply:
            case Err(code=code, msg=msg):
                self.load_errors[model] = f"{code}: {msg}"
            case Loaded(model_ref=ref):
                self.load_errors.pop(model, None)
                if ref not in self.models:
                    self.models.append(ref)


def own_request(kind: str, model: str | None, loads: Mapping[str, LoadSpec]) -> WireMessage:
    """A request the lane makes itself: its models' LOADs, standby applies, PING, SHUTDOWN (the lifecycle names
    its kind)."""
    if kind == Load.T and model in loads:
        return loads[model].request()
    own: dict[str, Callable[[], WireMessage]] = {
        Unload.T: lambda: Unload(model_ref=model), Ping.T: Ping, Shutdown.T: lambda: Shutdown(mode="graceful")}
    if (make := own.get(kind)) is not None:
        return make()
    # a LOAD of a model the lane no longer has, or a kind the lane never makes: its fields are all missing, so
    # it is refused (InvalidRequest) before a byte is written, and the lane goes on
    return MESSAGES[kind].from_fields(defaultdict(type(None)))


async def host(gen: Generation, windows: Windows, on_hello: Callable[[], None],
               on_reaped: Callable[[Reply | None], None]) -> None:
    """Run `gen` from launch to reap. It runs until a fault or an ordered end (WorkerProcess.stop_now) cancels
    it; `on_reaped` gets a complete reply salvaged from a worker that exited right after writing it."""
    wp = gen.wp
    try:
        async with trio.open_nursery() as nursery:
            gen.nursery = nursery
            await wp.start(nursery, windows.setup_s)
            if wp.fault is None:
                on_hello()
                await trio.sleep_forever()
    finally:
        if wp.fault is None:  # cancelled from outside (the lane task itself): an ordered end, known at once
            wp.stop_now("the lane stopped")
        with trio.CancelScope(shield=True):
            gen.rc = await wp.close(patience(wp, windows))
        salvaged = salvage(wp) if wp.fault is not None and wp.fault.cause in ("crash", "ordered") \
            else None  # after a protocol fault or a hang nothing the worker sent is trusted
        try:
            on_reaped(salvaged)
        finally:
            gen.reaped.set()


def patience(wp: WorkerProcess, windows: Windows) -> float:
    """How long a dying worker may take to exit by itself before the kill path."""
    if wp.ordered_stop:
        return windows.shutdown_s
    if wp.fault is not None and wp.fault.cause == "crash":
        return windows.exit_status_s  # an EOF usually means it is exiting: keep its real status
    return 0.0


def salvage(wp: WorkerProcess) -> Reply | None:
    """A worker may write its whole reply and exit before the exchange, cancelled with the generation, reads it:
    a complete terminal reply (or ERR) already received still goes to its caller."""
    extras: list[WireMessage] = []
    while True:
        try:
            msg, verdict = wp.replies.get_nowait()
        except trio.WouldBlock:
            return None
        kind = verdict.kind
        if kind is ReplyKind.INTERMEDIATE:
            extras.append(msg)
        elif kind in (ReplyKind.ERROR, ReplyKind.TERMINAL):
            return Reply(msg, tuple(extras))
