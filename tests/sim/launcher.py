"""The simulation's Launcher: each worker "process" is a SimWorker task in the simulation's own nursery (not the
lane's: a worker outlives nothing of the daemon's, and the daemon can only reach it through its socket and its
pid), connected by an in-memory pipe. kill() is SIGTERM, a grace period, SIGKILL, as for a process."""

from __future__ import annotations

import itertools
import signal
from collections.abc import Callable

import trio

from tests.sim.pipe import pipe_pair
from tests.sim.worker import Fate, SimWorker
from trio_gpuworker.supervisor import LogRing, WorkerSpec

SPAWN_S = 0.05  # from spawn to the worker's connect


class SimProc:
    def __init__(self, spec: WorkerSpec, pid: int, fate: Fate, on_misbehave: Callable[[int, str], None]) -> None:
        self.spec, self.pid, self.fate = spec, pid, fate
        self.returncode: int | None = None
        self.exited = trio.Event()
        daemon_end, worker_end = pipe_pair()
        self._daemon_end = daemon_end
        self.worker = SimWorker(worker_end, nonce=spec.nonce, pid=pid, env=spec.env, fate=fate,
                                on_misbehave=on_misbehave)
        self._scope = trio.CancelScope()

    async def run(self) -> None:
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
        return self._daemon_end

    async def wait(self) -> int:
        await self.exited.wait()
        assert self.returncode is not None
        return self.returncode

    async def kill(self, grace_s: float) -> int:
        with trio.CancelScope(shield=True):
            if not self.exited.is_set():
                if self.fate.ignore_sigterm:
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
        """kill -9 from outside (the schedule's doing)."""
        if not self.exited.is_set():
            self.returncode = code
            self._scope.cancel()

    def close(self) -> None:
        pass


class SimLauncher:
    """Hands each new generation its Fate (what the schedule wants it to do) and keeps every SimProc it started."""

    def __init__(self, nursery: trio.Nursery, fate: Callable[[WorkerSpec], Fate],
                 on_misbehave: Callable[[int, str], None]) -> None:
        self.nursery, self.fate, self.on_misbehave = nursery, fate, on_misbehave
        self.procs: dict[tuple[str, int], SimProc] = {}  # (lane, generation) -> its process
        self._pids = itertools.count(40_000)

    async def launch(self, spec: WorkerSpec, nursery: trio.Nursery, log: LogRing) -> SimProc:
        proc = SimProc(spec, next(self._pids), self.fate(spec), self.on_misbehave)
        self.procs[(spec.lane_id, spec.generation)] = proc
        self.nursery.start_soon(proc.run)
        return proc

    def running(self) -> list[SimProc]:
        return [p for p in self.procs.values() if not p.exited.is_set()]
