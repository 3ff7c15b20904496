"""Runtime directory, listening socket, spawn into a new process group, kill and reap."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import struct
import subprocess
import sys
from pathlib import Path

import trio

from .. import _worker_env as wenv
from .._config import LaneConfig
from .._errors import ConfigError

SUN_PATH_MAX = 107  # sockaddr_un.sun_path is 108 bytes including the NUL
_PEERCRED = struct.Struct("3i")


def default_runtime_dir(configured: Path | None, state_dir: Path) -> Path:
    """$RUNTIME_DIRECTORY (systemd), else $XDG_RUNTIME_DIR, else the configured path, else state_dir/run.

    The daemon's config layer resolves this once; a SupervisorConfig.runtime_dir is taken as given.
    """
    env = os.environ.get("RUNTIME_DIRECTORY", "").split(":")[0] or os.environ.get("XDG_RUNTIME_DIR")
    return Path(env) if env else Path(configured or state_dir / "run")


def workers_dir(runtime_dir: Path) -> Path:
    """<runtime_dir>/gpuworker/workers, created 0700 (and re-tightened if it already existed)."""
    d = runtime_dir / "gpuworker" / "workers"
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    for p in (d.parent, d):
        os.chmod(p, 0o700)
    return d


def socket_path(runtime_dir: Path, worker_id: str) -> Path:
    path = workers_dir(runtime_dir) / f"{worker_id}.sock"
    if len(os.fsencode(path)) > SUN_PATH_MAX:
        raise ConfigError(f"runtime_dir: socket path {path} is longer than the kernel's {SUN_PATH_MAX}-byte limit")
    return path


async def bind_listener(path: Path) -> trio.socket.SocketType:
    """Bind before spawn so the worker can never race us; a stale socket file is removed first."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        await sock.bind(os.fspath(path))
        os.chmod(path, 0o600)
        sock.listen(1)
    except BaseException:
        sock.close()
        raise
    return sock


def peer_credentials(sock: trio.socket.SocketType) -> tuple[int, int, int]:
    """(pid, uid, gid) of the connected peer, from the kernel."""
    return _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))


async def spawn(argv: list[str], env: dict[str, str], pass_fds: tuple[int, ...] = ()) -> trio.Process:
    """Start the worker in its own session (and so its own process group) with piped stdout/stderr."""
    return await trio.lowlevel.open_process(
        argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        start_new_session=True, pass_fds=pass_fds, close_fds=True,
    )


def worker_argv(cfg: LaneConfig) -> list[str]:
    """The lane's configured engine, or the built-in tinygrad worker; the lane appends --socket and --nonce."""
    return list(cfg.worker_command or (sys.executable, "-m", "trio_gpuworker.worker"))


def worker_env(cfg: LaneConfig, state_dir: Path, generation: int, arena_env: dict[str, str]) -> dict[str, str]:
    """tinygrad's device, its kernel cache and the workers' captured-JIT cache (both under the state directory,
    and keyed inside: worker/_jitcache.py), worker identity, the arena fd, the node's core ledger (_cores.py)."""
    cache = state_dir / "cache"
    cache.mkdir(parents=True, exist_ok=True)
    return {**os.environ, wenv.DEVICE: cfg.device, wenv.KERNEL_CACHE: str(cache / "tinygrad.db"),
            "PYTHONUNBUFFERED": "1", wenv.JIT_CACHE: str(cache / "jit"),
            wenv.WORKER_ID: f"{cfg.id}.{generation}", wenv.LANE_ID: cfg.id, wenv.CORES: str(cache / "cores"),
            **arena_env, **cfg.env}


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


async def kill_and_reap(proc: trio.Process, grace_s: float) -> int:
    """SIGTERM the process group, wait `grace_s`, SIGKILL, and always reap. Never cancelled halfway."""
    with trio.CancelScope(shield=True):
        if proc.returncode is None:
            _signal_group(proc.pid, signal.SIGTERM)
            _signal_group(proc.pid, signal.SIGCONT)  # a stopped worker must run to see SIGTERM
            with trio.move_on_after(grace_s):
                await proc.wait()
        # the leader may be gone while children of its group linger: SIGKILL the group regardless
        _signal_group(proc.pid, signal.SIGKILL)
        await proc.wait()
        return proc.returncode
