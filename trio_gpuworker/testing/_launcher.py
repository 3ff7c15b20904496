"""In-process fake engines for a Supervisor (docs/testing.md, 'In-process, under a mock clock'): a Launcher whose
each worker "process" is a SimWorker task in the launcher's own nursery (not the lane's: a worker outlives nothing
of the daemon's, and the daemon can only reach it through its socket and its pid), connected by an in-memory pipe.
kill() is SIGTERM, a grace period, SIGKILL, as for a process."""

from __future__ import annotations

import itertools
import signal
from collections.abc import Callable

import trio

from ..supervisor import LogRing, WorkerSpec
from ._pipe import pipe_pair
from ._plan import FaultPlan
from ._sim_worker import SimWorker

SPAWN_S = 0.05  # from spawn to the worker's connect


class SimProc:
    """One in-process worker "process": its pid, its exit code once it ended, and the SimWorker that runs it."""

    def __init__(self, spec: WorkerSpec, pid: int, plan: FaultPlan, on_misbehave: Callable[[int, str], None],
                 log: LogRing | None = None) -> None:
        self.spec, self.pid, self.plan = spec, pid, plan
        self.returncode: int | None = None
        self.exited = trio.Event()
        daemon_end, worker_end = pipe_pair()
        self._daemon_end = daemon_end
        output = (lambda stream, data: log.feed(stream, spec.generation, data)) if log is not None else None
        self.worker = SimWorker(worker_end, nonce=spec.nonce, pid=pid, env=spec.env, plan=plan,
                                on_misbehave=on_misbehave, generation=spec.generation, output=output)
        self._scope = trio.CancelScope()

    async def run(self) -> None:
        """The process's life: spawned, connected, served, exited (its exit code in `returncode`)."""
        rc = -signal.SIGKILL
        try:
            with self._scope:
                await trio.sleep(SPAWN_S)
                rc = await self.worker.main()
        finally:
            with trio.CancelScope(shield=True):
                await self.worker.stream.aclose()  # its socket closes with it
            self.returncode = self.returncode if self.returncode is not None else rc
            self.exited.set()

    async def connect(self) -> trio.abc.Stream:
        """The daemon's end of its socket."""
        return self._daemon_end

    async def wait(self) -> int:
        """Its exit code, once it exited (negative: the signal that ended it)."""
        await self.exited.wait()
        assert self.returncode is not None
        return self.returncode

    async def kill(self, grace_s: float) -> int:
        """SIGTERM, then SIGKILL after `grace_s` if the plan ignores SIGTERM; its exit code."""
        with trio.CancelScope(shield=True):
            if not self.exited.is_set():
                if self.plan.ignore_sigterm:
                    with trio.move_on_after(grace_s):
                        await self.exited.wait()
                    self.returncode = -signal.SIGKILL
                else:
                    self.returncode = -signal.SIGTERM
                self._scope.cancel()
                await self.exited.wait()
        assert self.returncode is not None
        return self.returncode

    def crash(self, code: int = -signal.SIGKILL) -> None:
        """kill -9 from outside (a test's or a schedule's doing)."""
        if not self.exited.is_set():
            self.returncode = code
            self._scope.cancel()

    def close(self) -> None:
        """Nothing to release: it has no pipes or file descriptors of its own."""


class SimLauncher:
    """A Supervisor's launcher (`Supervisor(config, launcher=...)`) whose workers are in-process fake engines in
    `nursery`: each generation follows `plan` (one FaultPlan, or the plan for a WorkerSpec). `on_misbehave` hears of
    each fault as it happens (generation, fault). Every SimProc it started stays in `procs`."""

    def __init__(self, nursery: trio.Nursery, plan: FaultPlan | Callable[[WorkerSpec], FaultPlan] | None = None,
                 on_misbehave: Callable[[int, str], None] = lambda generation, fault: None) -> None:
        self.nursery, self.on_misbehave = nursery, on_misbehave
        if plan is None or isinstance(plan, FaultPlan):
            fixed = plan or FaultPlan()
            self.plan: Callable[[WorkerSpec], FaultPlan] = lambda spec: fixed.for_generation(spec.generation)
        else:
            self.plan = plan
        self.procs: dict[tuple[str, int], SimProc] = {}  # (lane, generation) -> its process
        self._pids = itertools.count(40_000)

    async def launch(self, spec: WorkerSpec, nursery: trio.Nursery, log: LogRing) -> SimProc:
        """Start generation `spec.generation` of lane `spec.lane_id` (the Launcher protocol)."""
        proc = SimProc(spec, next(self._pids), self.plan(spec), self.on_misbehave, log)
        self.procs[(spec.lane_id, spec.generation)] = proc
        self.nursery.start_soon(proc.run)
        return proc

    def running(self) -> list[SimProc]:
        """The workers still running."""
        return [p for p in self.procs.values() if not p.exited.is_set()]


__all__ = ["SimLauncher", "SimProc"]
