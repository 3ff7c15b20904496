"""How a lane's worker runs: a seam between the supervision code and what actually runs the worker.

`ProcessLauncher` runs real worker processes on Unix sockets (docs/architecture.md, 'Socket and spawn'). Anything else
that gives a pid, a
byte stream speaking protocol v3 and an exit status can stand in: the deterministic simulation (tests/sim) runs
simulated workers in-process, under a mock clock, through this same seam and the same lane code.

A worker must never outlive its daemon, whatever kills the daemon (SIGKILL included): every worker inherits the
read end of one "lifeline" pipe whose write end only the daemon holds (close-on-exec, so no child inherits it).
When the daemon dies the kernel closes it, the worker reads EOF and kills its own process group, children and
all (trio_gpuworker/_lifeline.py). PR_SET_PDEATHSIG cannot do this: trio spawns from a worker thread, and the
signal would fire when that thread exits, not when the daemon does.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import trio

from .._lifeline import LIFELINE_ENV
from ._logring import LogRing
from ._spawn import bind_listener, kill_and_reap, peer_credentials, socket_path, spawn


@dataclass(frozen=True)
class WorkerSpec:
    lane_id: str
    generation: int
    argv: list[str]  # the engine's command line; the launcher appends --socket PATH --nonce HEX
    env: dict[str, str]
    nonce: str


class Launched(Protocol):
    """One started worker, until it is reaped."""

    pid: int
    returncode: int | None

    async def connect(self) -> trio.abc.Stream:
        """The worker's control connection; only the spawned worker may be it."""
        ...

    async def wait(self) -> int: ...

    async def kill(self, grace_s: float) -> int:
        """SIGTERM (and SIGCONT) to its group, `grace_s`, SIGKILL, always reap, never cancelled halfway."""
        ...

    def close(self) -> None:
        """Connected or not: nothing else may ever connect to this worker (listener and socket file gone)."""
        ...


class Launcher(Protocol):
    async def launch(self, spec: WorkerSpec, nursery: trio.Nursery, log: LogRing) -> Launched: ...


class WorkerProc:
    """A worker process: its listener (bound before the spawn, so the worker can never race us), its pid."""

    def __init__(self, proc: trio.Process, listener: trio.socket.SocketType, sock_path: Path, log: LogRing,
                 generation: int) -> None:
        self.proc = proc
        self.pid = proc.pid
        self._listener = listener
        self._sock_path = sock_path
        self._log = log
        self._generation = generation

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode

    async def connect(self) -> trio.abc.Stream:
        while True:
            sock, _ = await self._listener.accept()
            pid, uid, _gid = peer_credentials(sock)
            if pid == self.pid and uid == os.getuid():
                return trio.SocketStream(sock)
            sock.close()  # not our child: ignore it and keep waiting for the spawned pid
            self._log.feed("daemon", self._generation, f"rejected connection from pid {pid} uid {uid}\n".encode())

    async def wait(self) -> int:
        return await self.proc.wait()

    async def kill(self, grace_s: float) -> int:
        return await kill_and_reap(self.proc, grace_s)

    def close(self) -> None:
        self._listener.close()
        self._sock_path.unlink(missing_ok=True)


class ProcessLauncher:
    """Real worker processes: a 0700 runtime directory, a socket per generation, a new session per worker (so a
    kill reaches its whole process group), stdout/stderr into the lane's log ring, the arena fd and the
    lifeline inherited."""

    def __init__(self, runtime_dir: Path, pass_fds: tuple[int, ...] = ()) -> None:
        self.runtime_dir = runtime_dir
        self._lifeline_r, self._lifeline_w = os.pipe2(os.O_CLOEXEC)
        self.pass_fds = (*pass_fds, self._lifeline_r)

    def close(self) -> None:
        """Only at the daemon's end: workers still running read EOF on their lifeline and exit."""
        for fd in (self._lifeline_r, self._lifeline_w):
            os.close(fd)

    async def launch(self, spec: WorkerSpec, nursery: trio.Nursery, log: LogRing) -> Launched:
        path = socket_path(self.runtime_dir, f"{spec.lane_id}.{spec.generation}")
        listener = await bind_listener(path)
        try:
            argv = [*spec.argv, "--socket", os.fspath(path), "--nonce", spec.nonce]
            env = {**spec.env, LIFELINE_ENV: str(self._lifeline_r)}
            proc = await spawn(argv, env, self.pass_fds)
        except BaseException:
            listener.close()
            path.unlink(missing_ok=True)
            raise
        assert proc.stdout is not None and proc.stderr is not None
        nursery.start_soon(_pump, proc.stdout, "stdout", log, spec.generation)
        nursery.start_soon(_pump, proc.stderr, "stderr", log, spec.generation)
        return WorkerProc(proc, listener, path, log, spec.generation)


async def _pump(pipe: trio.abc.ReceiveStream, name: str, log: LogRing, generation: int) -> None:
    async with pipe:
        try:
            while data := await pipe.receive_some(65536):
                log.feed(name, generation, data)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
    log.flush(name, generation)


__all__ = ["Launched", "Launcher", "ProcessLauncher", "WorkerProc", "WorkerSpec"]
