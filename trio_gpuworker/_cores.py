"""The node's cores, shared by its workers step by step (docs/configuration.md, 'threads'): a work-conserving share.

A fused kernel splits a step over `threads` cores, bit for bit as one thread computes it. A fixed count either wastes
an idle node (one core for a lone client) or oversubscribes a busy one (every lane's threads on the same cores). So
by default each step asks the ledger: the cores of this worker's CPU set divided among the workers busy right now,
itself included, at least one. A lone request on an idle node gets every core; with every lane busy each gets one.
It is re-asked every step, so a lane that becomes busy takes its core back within one step of the others.

The ledger is one small file in the daemon's state directory, mapped by every worker the daemon starts:
- a worker claims a slot for its life by an open-file-description lock on the slot's byte (F_OFD_SETLK), which the
  kernel drops when the process ends, however it ends;
- it raises the busy byte of its slot while its compute thread runs a job, and lowers it after (one writer per
  byte: no read-modify-write, no lock);
- counting reads the busy bytes and skips a slot whose claim lock is gone (a worker killed mid-job), so a crash
  leaves no phantom load behind; a new claimant clears the slot it takes.
A background worker (niced, as the tuner is) neither counts nor is counted: it yields its core anyway.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import struct
from pathlib import Path

import numpy as np

from ._kinds import AUTO_THREADS, MAX_THREADS

SLOTS = 256  # workers of one daemon at most in the ledger; a worker that finds none free runs with fixed threads
LINE = 64  # one cache line per slot's busy byte: no false sharing between workers' writes
_BUSY_AT = SLOTS  # the busy bytes follow the slots' lock bytes
_SIZE = _BUSY_AT + SLOTS * LINE
_FLOCK = "hhqqi4x"  # struct flock on x86-64 and aarch64 Linux: type, whence, start, len, pid (0 for OFD locks)


def _lock(fd: int, slot: int, kind: int, *, probe: bool = False) -> int:
    """F_OFD_SETLK (or F_OFD_GETLK with `probe`) on the slot's lock byte; the lock type the call answers."""
    arg = struct.pack(_FLOCK, kind, os.SEEK_SET, slot, 1, 0)
    res = fcntl.fcntl(fd, fcntl.F_OFD_GETLK if probe else fcntl.F_OFD_SETLK, arg)
    return int(struct.unpack(_FLOCK, res)[0])


class CoreLedger:
    """One worker's claim in the node's ledger at `path`: its busy flag, and its share of `cores`."""

    def __init__(self, path: Path, cores: int) -> None:
        self.cores = max(1, cores)
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            if os.fstat(self._fd).st_size < _SIZE:
                os.ftruncate(self._fd, _SIZE)
            self._map = mmap.mmap(self._fd, _SIZE)
            self._flags = np.ndarray((SLOTS,), np.uint8, self._map, _BUSY_AT, (LINE,))
            self.slot = self._claim()
        except BaseException:
            os.close(self._fd)
            raise

    def _claim(self) -> int:
        for slot in range(SLOTS):
            try:
                _lock(self._fd, slot, fcntl.F_WRLCK)
            except OSError:
                continue  # another worker's
            self._flags[slot] = 0  # what a worker killed mid-job left raised
            return slot
        raise OSError("the core ledger has no free slot")

    def busy(self, on: bool) -> None:
        """This worker's compute thread starts (True) or ends (False) a job."""
        self._flags[self.slot] = on

    def share(self) -> int:
        """The cores for this worker's next step: its CPU set divided among the busy workers, itself included."""
        others = 0
        for slot in np.flatnonzero(self._flags):
            if slot != self.slot and _lock(self._fd, int(slot), fcntl.F_WRLCK, probe=True) != fcntl.F_UNLCK:
                others += 1
        return max(1, min(MAX_THREADS, self.cores // (others + 1)))

    def close(self) -> None:
        """Give the slot back (the process's end does the same)."""
        if self._fd < 0:
            return
        self._flags[self.slot] = 0
        del self._flags
        self._map.close()
        os.close(self._fd)
        self._fd = -1


_LEDGER: list[CoreLedger | None] = []


def ledger() -> CoreLedger | None:
    """This process's claim, opened at first use from the daemon's GPUWORKER_CORES (None outside a daemon's worker,
    in a background worker, or when the ledger cannot be opened: fixed threads then)."""
    if not _LEDGER:
        from ._worker_env import CORES, NICE

        path, cl = os.environ.get(CORES), None
        if path and not os.environ.get(NICE):
            try:
                cl = CoreLedger(Path(path), len(os.sched_getaffinity(0)))
            except OSError:
                cl = None
        _LEDGER.append(cl)
    return _LEDGER[0]


def step_threads(threads: int) -> int:
    """The threads of a fused kernel's next step: `threads` as configured, or for AUTO_THREADS this worker's share
    of the node's cores now (one outside a daemon's worker)."""
    if threads != AUTO_THREADS:
        return threads
    cl = ledger()
    return cl.share() if cl is not None else 1


__all__ = ["SLOTS", "CoreLedger", "ledger", "step_threads"]
