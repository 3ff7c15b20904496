"""One worker process for its whole life, as a lane runs it: spawn, HELLO, LOAD of the lane's models, then
up until it faults or is stopped in order (SHUTDOWN), then kill and reap. The lane runs the active worker
and, with `standby = true`, a second one kept loaded and idle, each as a `Generation`."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import trio

from .._config import Windows
from .._errors import BrokenWorkerError, InvalidRequest
from .._proto import Message, RequestTracker
from ._exchange import exchange
from ._jobs import Job, LoadSpec
from ._worker import WorkerProcess


class Generation:
    """A worker and what the lane knows of it. `ready` is set once it has loaded its models or failed
    before that (check `wp.fault`); `reaped` once the process is gone and `rc` holds its exit status."""

    def __init__(self, wp: WorkerProcess, *, standby: bool = False) -> None:
        self.wp = wp
        self.standby = standby
        self.promoted = False  # a standby the lane took over as its active worker
        self.served = False  # drained at least one successful serving reply
        self.requests = RequestTracker()  # req_ids and the open request of this connection
        self.models: list[str] = []
        self.load_errors: dict[str, str] = {}
        self.ready = trio.Event()
        self.stop_requested = trio.Event()
        self.released = trio.Event()  # a standby was promoted, or it is gone
        self.reaped = trio.Event()
        self.rc: int | None = None
        self.lock = trio.Lock()  # one exchange at a time from tasks other than the serving loop

    @property
    def number(self) -> int:
        return self.wp.generation

    @property
    def alive(self) -> bool:
        return self.wp.fault is None and not self.reaped.is_set()

    @property
    def faulted(self) -> bool:
        """Ended by a genuine fault (a strike), not by a stop we ordered."""
        return self.wp.fault is not None and self.wp.fault.cause != "ordered"

    def describe(self) -> dict[str, object]:
        state = "reaped" if self.reaped.is_set() else "failed" if self.wp.fault else \
            "ready" if self.ready.is_set() else "starting"
        return {"generation": self.number, "pid": self.wp.pid, "state": state, "models": list(self.models)}

    async def call(self, job: Job, windows: Windows) -> Message:
        """One request from a task outside this generation's nursery (an admin LOAD on a standby).
        BrokenWorkerError if the worker faults meanwhile: its replacement loads the lane's models anyway."""
        async with self.lock:
            with trio.CancelScope() as scope:
                self.wp.cancel_on_fault(scope)
                if self.wp.fault is None:
                    return await exchange(self.wp, job, self.requests, windows)
        raise BrokenWorkerError(f"worker generation {self.number} failed during {job.t}")


async def host(gen: Generation, windows: Windows, loads: Callable[[], Iterable[LoadSpec]],
               on_reaped: Callable[[Generation], None]) -> None:
    """Run `gen` from spawn to reap. Stops in order once `gen.stop_requested` is set; a fault ends it early."""
    wp = gen.wp
    try:
        async with trio.open_nursery() as nursery:
            await wp.start(nursery, windows.setup_s)
            if wp.fault is None:
                await load_all(gen, windows, loads())
            gen.ready.set()
            await gen.stop_requested.wait()
            await shutdown(gen, windows)
            nursery.cancel_scope.cancel()
    finally:
        gen.ready.set()
        gen.rc = await wp.close(patience(wp, windows))
        gen.released.set()
        try:
            on_reaped(gen)
        finally:
            gen.reaped.set()


async def load_all(gen: Generation, windows: Windows, specs: Iterable[LoadSpec]) -> None:
    """LOAD each of the lane's models; a model that fails to load is recorded, the others still load."""
    async with gen.lock:
        for spec in list(specs):
            try:
                reply = await exchange(gen.wp, Job("LOAD", spec.load_fields(), None), gen.requests, windows)
            except InvalidRequest as exc:
                gen.load_errors[spec.model_ref] = f"{exc.code}: {exc}"
                continue
            if reply.t == "ERR":
                gen.load_errors[spec.model_ref] = f"{reply['code']}: {reply['msg']}"
            else:
                gen.load_errors.pop(spec.model_ref, None)
                gen.models.append(reply["model_ref"])


async def shutdown(gen: Generation, windows: Windows) -> None:
    """Ordered stop: SHUTDOWN, then the kill path reaps whatever is left (no strike)."""
    gen.wp.ordered_stop = True
    with trio.move_on_after(windows.shutdown_s):
        async with gen.lock:
            try:
                await exchange(gen.wp, Job("SHUTDOWN", {"mode": "graceful"}, None), gen.requests, windows)
            except (trio.BrokenResourceError, OSError, InvalidRequest):
                return


def patience(wp: WorkerProcess, windows: Windows) -> float:
    """How long a dying worker may take to exit by itself before the kill path."""
    if wp.ordered_stop:
        return windows.shutdown_s
    if wp.fault is not None and wp.fault.cause == "crash":
        return windows.exit_status_s  # an EOF usually means it is exiting: keep its real status
    return 0.0

