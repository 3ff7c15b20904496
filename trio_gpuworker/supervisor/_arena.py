"""The daemon's arena (docs/architecture.md, 'Arena and leases'): one sealed memfd, mapped once, carved into ring
leases.

The memfd is created without CLOEXEC so workers inherit it (spawn passes `pass_fds` and `env()`),
truncated to a sparse ceiling that costs nothing until touched, and sealed against resizing so
no worker can shrink it under the daemon's mapping (a shrink would SIGBUS the daemon). Lease
policy lives in `_proto/_leases.py`; this shell adds the mapping and the waiting tasks.

Releasing needs a quiescence proof (`Quiesced`, `Reaped`, `NeverInstalled`). On release the ring
header is zeroed, so a stale reader sees no ring, and the whole pages of the freed range are
handed back to the kernel (MADV_REMOVE), so a released ring stops costing memory.
"""

from __future__ import annotations

import fcntl
import mmap
import os
from types import TracebackType

import trio

from cython_ring import Ring

from .._errors import (
    ArenaBusy,
    ArenaError,
    ClosedArenaError,
    InvalidLeaseRequest,
    LeaseRejected,
    LeaseStateError,
    QuiescenceUnproven,
)
from .._proto import (
    ALIGN,
    RING_HEADER_LEN,
    Lease,
    LeaseState,
    LeaseStats,
    LeaseTable,
    NeverInstalled,
    Proof,
    Quiesced,
    Reaped,
    Ticket,
)
from .._worker_env import ARENA_BYTES, ARENA_FD

__all__ = [
    "ALIGN",
    "DEFAULT_ARENA_BYTES",
    "ENV_ARENA_BYTES",
    "ENV_ARENA_FD",
    "RING_HEADER_LEN",
    "ArenaBusy",
    "ArenaError",
    "ArenaManager",
    "ClosedArenaError",
    "InvalidLeaseRequest",
    "Lease",
    "LeaseRejected",
    "LeaseState",
    "LeaseStateError",
    "LeaseStats",
    "NeverInstalled",
    "Proof",
    "Quiesced",
    "QuiescenceUnproven",
    "Reaped",
]

DEFAULT_ARENA_BYTES = 1 << 30  # sparse: only the pages rings touch are ever backed
ENV_ARENA_FD, ENV_ARENA_BYTES = ARENA_FD, ARENA_BYTES
MEMFD_NAME = "gpuworker-arena"
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


class ArenaManager:
    """One memfd arena per daemon and the leases carved from it.

    `lease()` waits (FIFO) while the ring does not fit yet; cancel the waiting task to give up.
    Use as a context manager, or call `close()` once every lease is released.
    """

    def __init__(self, size: int = DEFAULT_ARENA_BYTES, *, first_ring_id: int = 1, reclaim: bool = True) -> None:
        self._table = LeaseTable(size, first_ring_id=first_ring_id)
        self._reclaim = reclaim
        self._waiting: dict[Ticket, trio.Event] = {}
        # flags=0: no MFD_CLOEXEC (os.memfd_create's default), so workers can inherit the fd.
        fd = os.memfd_create(MEMFD_NAME, os.MFD_ALLOW_SEALING)
        try:
            os.set_inheritable(fd, True)
            os.ftruncate(fd, size)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
            self._mmap: mmap.mmap | None = mmap.mmap(fd, size, flags=mmap.MAP_SHARED,
                                                     prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd

    # --- the shared memory ----------------------------------------------------------------------

    @property
    def size(self) -> int:
        return self._table.size

    @property
    def fd(self) -> int:
        self._check_open()
        return self._fd

    @property
    def mmap(self) -> mmap.mmap:
        """The daemon's one mapping; ring code slices it. Release every view of it before close()."""
        self._check_open()
        assert self._mmap is not None
        return self._mmap

    @property
    def pass_fds(self) -> tuple[int, ...]:
        return (self.fd,)

    def env(self) -> dict[str, str]:
        """What a worker needs to map the arena (the fd keeps its number through pass_fds)."""
        return {ENV_ARENA_FD: str(self.fd), ENV_ARENA_BYTES: str(self.size)}

    @property
    def closed(self) -> bool:
        return self._mmap is None

    # --- leases --------------------------------------------------------------------------------

    async def lease(self, capacity: int, *, ring_id_hint: int | None = None) -> Lease:
        """A lease for a ring of `capacity` data bytes (a positive multiple of 64).

        Waits in FIFO order while no free range fits yet; raises LeaseRejected at once when the
        ring could never fit the arena. `ring_id_hint` asks for an id at least this large (ids stay
        monotonic and are never reused). A cancelled wait leaves the queue and leaks nothing.
        """
        await trio.lowlevel.checkpoint_if_cancelled()
        self._check_open()
        ticket = self._table.submit(capacity, ring_id_hint=ring_id_hint)
        if ticket.lease is not None:
            await trio.lowlevel.cancel_shielded_checkpoint()
            return ticket.lease
        event = self._waiting[ticket] = trio.Event()
        try:
            await event.wait()
        except BaseException:
            self._wake(self._table.withdraw(ticket))
            raise
        finally:
            del self._waiting[ticket]
        assert ticket.lease is not None
        return ticket.lease

    def init_ring(self, lease: Lease) -> Ring:
        """Write a fresh ring header (ABI v2) at the lease and return the daemon's Ring over it."""
        self._table.check_live(lease)
        return Ring.init(self.mmap, lease.offset, lease.ring_id, lease.capacity)

    def mark_installed(self, lease: Lease, pid: int) -> None:
        """Record the worker the ring goes to; call before INSTALL_RING is written."""
        self._table.mark_installed(lease, pid)

    def release(self, lease: Lease, proof: Proof) -> None:
        """Free the lease given a quiescence proof; wakes queued requests that now fit, in order.

        QuiescenceUnproven (lease kept) for a missing or wrong proof; LeaseStateError when the
        lease was released already or is not ours.
        """
        self._table.check_release(lease, proof)
        self._scrub(lease)  # before release(): a queued request may be granted this very range
        self._wake(self._table.release(lease, proof))

    def installed_on(self, pid: int) -> list[Lease]:
        """Live leases installed in worker `pid` (what a Reaped proof for it covers)."""
        return self._table.installed_on(pid)

    def live(self) -> list[Lease]:
        return self._table.live()

    def stats(self) -> LeaseStats:
        return self._table.stats()

    # --- closing ---------------------------------------------------------------------------------

    def close(self) -> None:
        """Unmap and close the memfd. ArenaBusy while a lease is live or the mapping is exported."""
        if self._mmap is None:
            return
        self._table.check_idle()
        try:
            self._mmap.close()
        except BufferError as exc:
            raise ArenaBusy("the arena mapping is still exported (a Ring or memoryview over it is alive)") from exc
        self._table.close()
        self._mmap = None
        os.close(self._fd)

    def __enter__(self) -> ArenaManager:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # --- internals --------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._mmap is None:
            raise ClosedArenaError("the arena is closed")

    def _wake(self, granted: list[Ticket]) -> None:
        for ticket in granted:
            self._waiting[ticket].set()

    def _scrub(self, lease: Lease) -> None:
        """Zero the released header, and give whole free pages around it back to the kernel."""
        assert self._mmap is not None, "a live lease keeps the arena open"
        self._mmap[lease.offset:lease.offset + RING_HEADER_LEN] = bytes(RING_HEADER_LEN)
        if not self._reclaim:
            return
        free = self._table.span_when_freed(lease)
        page = mmap.PAGESIZE
        start = max(free[0], lease.offset - lease.offset % page)
        start += -start % page
        end = min(free[1], lease.end + -lease.end % page)
        end -= end % page
        if end > start:
            self._mmap.madvise(mmap.MADV_REMOVE, start, end - start)
