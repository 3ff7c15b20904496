"""Arena lease policy (docs/architecture.md, 'Arena and leases'), sans-I/O.

`LeaseTable` owns the arithmetic of one arena: a sorted, coalesced free list, first-fit
placement, a strict FIFO queue of requests that cannot be placed yet, monotonically increasing
ring ids, and the rule that a lease goes back to the free list only with a quiescence proof.
It never touches memory, a clock or a task; the trio shell (`supervisor/_arena.py`) maps the
memfd and turns queued `Ticket`s into waiting tasks.

A lease covers the 128-byte ring header plus `capacity` data bytes. Every length is a multiple
of 64 and every offset is a sum of such lengths, so every lease starts 64-byte aligned.

Queueing is strict FIFO: while any request waits, a new one queues behind it even if it would
fit now, and a release serves the queue head first and stops at the first request that does not
fit. A large request can therefore not be starved by a stream of small ones; the price is
head-of-line blocking, which is bounded because a request that could never fit is rejected at
once (and with no live leases any admissible request fits, so the queue is then empty).
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field
from enum import Enum

from .._errors import (
    ArenaBusy,
    ClosedArenaError,
    InvalidLeaseRequest,
    LeaseRejected,
    LeaseStateError,
    QuiescenceUnproven,
)

ALIGN = 64
RING_HEADER_LEN = 128  # cython_ring.RING_HEADER_LEN; _proto imports no native code


# --- proofs ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Quiesced:
    """The worker answered RING_QUIESCED for `ring_id`, and the daemon's pump for it is stopped."""

    ring_id: int
    pump_stopped: bool = field(kw_only=True)


@dataclass(frozen=True)
class Reaped:
    """The worker `pid` the ring was installed in was reaped with `returncode`, and the pump is stopped."""

    pid: int
    returncode: int
    pump_stopped: bool = field(kw_only=True)


@dataclass(frozen=True)
class NeverInstalled:
    """No worker was ever given this ring (INSTALL_RING was never sent), so no process can touch it."""

    ring_id: int


Proof = Quiesced | Reaped | NeverInstalled


# --- leases ---------------------------------------------------------------------------------


class LeaseState(Enum):
    LEASED = "leased"  # minted; no worker has been told about it
    INSTALLED = "installed"  # its layout was (or is being) sent to worker `worker_pid`
    RELEASED = "released"  # back on the free list; the range has no users


@dataclass(eq=False, slots=True)
class Lease:
    """One ring's range of the arena: header at `offset`, data at `data_offset`, `length` in all."""

    ring_id: int
    offset: int
    length: int
    capacity: int
    state: LeaseState = LeaseState.LEASED
    worker_pid: int | None = None

    @property
    def data_offset(self) -> int:
        return self.offset + RING_HEADER_LEN

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass(eq=False, slots=True)
class Ticket:
    """One lease request: granted at once (`lease` set) or waiting in the FIFO queue."""

    capacity: int
    length: int
    ring_id_hint: int | None
    lease: Lease | None = None


@dataclass(frozen=True)
class LeaseStats:
    size: int
    bytes_leased: int
    live_leases: int
    queued: int
    queued_bytes: int
    largest_free: int
    next_ring_id: int


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class LeaseTable:
    """First-fit lease allocator over `[0, size)` with a strict FIFO wait queue."""

    def __init__(self, size: int, *, first_ring_id: int = 1) -> None:
        if not _is_int(size) or size < RING_HEADER_LEN + ALIGN or size % ALIGN:
            raise InvalidLeaseRequest(f"arena size {size!r} must be a multiple of {ALIGN} and at least "
                                      f"{RING_HEADER_LEN + ALIGN} bytes")
        if not _is_int(first_ring_id) or first_ring_id < 1:
            raise InvalidLeaseRequest(f"first_ring_id {first_ring_id!r} must be an int >= 1")
        self.size = size
        self._starts: list[int] = [0]  # free ranges, sorted, never adjacent (always coalesced)
        self._ends: list[int] = [size]
        self._queue: deque[Ticket] = deque()
        self._live: dict[int, Lease] = {}
        self._next_id = first_ring_id
        self._bytes_leased = 0
        self.closed = False

    # --- requests ---------------------------------------------------------------------------

    def submit(self, capacity: int, *, ring_id_hint: int | None = None) -> Ticket:
        """Grant a lease now if the queue is empty and a range fits; else queue the request.

        Raises InvalidLeaseRequest for a bad capacity or hint, LeaseRejected when the ring could
        never fit, ClosedArenaError after close().
        """
        if self.closed:
            raise ClosedArenaError("the arena is closed")
        if not _is_int(capacity) or capacity <= 0 or capacity % ALIGN:
            raise InvalidLeaseRequest(f"ring capacity {capacity!r} must be a positive multiple of {ALIGN}")
        if ring_id_hint is not None and (not _is_int(ring_id_hint) or ring_id_hint < 1):
            raise InvalidLeaseRequest(f"ring_id_hint {ring_id_hint!r} must be an int >= 1")
        length = RING_HEADER_LEN + capacity
        if length > self.size:
            raise LeaseRejected(f"a ring of capacity {capacity} needs {length} bytes; the arena has {self.size}")
        ticket = Ticket(capacity, length, ring_id_hint)
        if not self._queue and self._place(ticket):
            return ticket
        self._queue.append(ticket)
        return ticket

    def withdraw(self, ticket: Ticket) -> list[Ticket]:
        """The requester gave up (cancelled): drop it from the queue, or return its unclaimed lease.

        Returns the tickets this granted (the queue may move once its head is gone). The ring id
        of a withdrawn lease is burned, never reused.
        """
        if ticket.lease is None:
            try:
                self._queue.remove(ticket)
            except ValueError:
                return []
        else:
            lease = ticket.lease
            if lease.state is not LeaseState.LEASED or self._live.get(lease.ring_id) is not lease:
                raise LeaseStateError(f"ring {lease.ring_id} is {lease.state.value}; only an unclaimed lease "
                                      "can be withdrawn")
            self._free(lease)
        return self._drain()

    # --- lifecycle ----------------------------------------------------------------------------

    def mark_installed(self, lease: Lease, pid: int) -> None:
        """Record that the lease's layout goes to worker `pid`; call before INSTALL_RING is written."""
        self.check_live(lease)
        if not _is_int(pid) or pid <= 0:
            raise InvalidLeaseRequest(f"worker pid {pid!r} must be a positive int")
        if lease.state is not LeaseState.LEASED:
            raise LeaseStateError(f"ring {lease.ring_id} is installed in worker {lease.worker_pid} already")
        lease.state = LeaseState.INSTALLED
        lease.worker_pid = pid

    def release(self, lease: Lease, proof: object) -> list[Ticket]:
        """Return the lease's range to the free list if `proof` shows nobody can touch it.

        A bad proof raises QuiescenceUnproven and keeps the lease; a released or foreign lease
        raises LeaseStateError. Returns the queued tickets this granted, in FIFO order.
        """
        self.check_release(lease, proof)
        self._free(lease)
        return self._drain()

    def check_release(self, lease: Lease, proof: object) -> None:
        """Raise exactly what release() would, without releasing."""
        self.check_live(lease)
        reason = self._refute(lease, proof)
        if reason is not None:
            raise QuiescenceUnproven(f"ring {lease.ring_id} kept: {reason}")

    def close(self) -> None:
        """Stop minting. Raises ArenaBusy while any lease is live (then no request can be queued)."""
        self.check_idle()
        self.closed = True

    def check_idle(self) -> None:
        """Raise ArenaBusy unless every lease is released."""
        if self._live:
            raise ArenaBusy(f"{len(self._live)} arena lease(s) still live: rings {sorted(self._live)}")
        assert not self._queue, "a queued request always waits on a live lease"

    # --- queries ------------------------------------------------------------------------------

    def live(self) -> list[Lease]:
        return sorted(self._live.values(), key=lambda lease: lease.offset)

    def installed_on(self, pid: int) -> list[Lease]:
        return [lease for lease in self.live() if lease.worker_pid == pid]

    def free_ranges(self) -> list[tuple[int, int]]:
        return list(zip(self._starts, self._ends, strict=True))

    def span_when_freed(self, lease: Lease) -> tuple[int, int]:
        """The free range the lease's range will be part of once released (it coalesces with neighbours)."""
        i = bisect.bisect_left(self._starts, lease.offset)
        start = self._starts[i - 1] if i > 0 and self._ends[i - 1] == lease.offset else lease.offset
        end = self._ends[i] if i < len(self._starts) and self._starts[i] == lease.end else lease.end
        return start, end

    def stats(self) -> LeaseStats:
        largest = max((e - s for s, e in zip(self._starts, self._ends, strict=True)), default=0)
        return LeaseStats(size=self.size, bytes_leased=self._bytes_leased, live_leases=len(self._live),
                          queued=len(self._queue), queued_bytes=sum(t.length for t in self._queue),
                          largest_free=largest, next_ring_id=self._next_id)

    # --- internals ----------------------------------------------------------------------------

    def check_live(self, lease: object) -> None:
        if not isinstance(lease, Lease):
            raise LeaseStateError(f"not a Lease: {lease!r}")
        if self._live.get(lease.ring_id) is not lease:
            if lease.state is LeaseState.RELEASED:
                raise LeaseStateError(f"ring {lease.ring_id} was released already")
            raise LeaseStateError(f"ring {lease.ring_id} is not a lease of this arena")

    @staticmethod
    def _refute(lease: Lease, proof: object) -> str | None:
        """Why `proof` does not show the lease quiescent, or None if it does."""
        if isinstance(proof, NeverInstalled):
            if proof.ring_id != lease.ring_id:
                return f"proof names ring {proof.ring_id}"
            if lease.state is not LeaseState.LEASED:
                return f"it was installed in worker {lease.worker_pid}"
            return None
        if isinstance(proof, Quiesced):
            if proof.ring_id != lease.ring_id:
                return f"RING_QUIESCED names ring {proof.ring_id}"
            if proof.pump_stopped is not True:
                return "its pump is not stopped"
            if lease.state is not LeaseState.INSTALLED:
                return "it was never installed, so no RING_QUIESCED can be for it (prove NeverInstalled)"
            return None
        if isinstance(proof, Reaped):
            if not _is_int(proof.pid) or not _is_int(proof.returncode):
                return f"{proof!r} is not a reaped process (pid and returncode must be ints)"
            if proof.pump_stopped is not True:
                return "its pump is not stopped"
            if lease.state is not LeaseState.INSTALLED:
                return "it was never installed, so no worker reap covers it (prove NeverInstalled)"
            if proof.pid != lease.worker_pid:
                return f"it is installed in worker {lease.worker_pid}, not the reaped {proof.pid}"
            return None
        return f"{proof!r} is not a quiescence proof (Quiesced, Reaped or NeverInstalled)"

    def _place(self, ticket: Ticket) -> bool:
        """First fit: the lowest free range that holds the ticket's length."""
        for i, start in enumerate(self._starts):
            end = self._ends[i]
            if end - start >= ticket.length:
                break
        else:
            return False
        if end - start == ticket.length:
            del self._starts[i], self._ends[i]
        else:
            self._starts[i] = start + ticket.length
        ring_id = self._next_id if ticket.ring_id_hint is None else max(self._next_id, ticket.ring_id_hint)
        self._next_id = ring_id + 1
        assert start % ALIGN == 0
        lease = Lease(ring_id, start, ticket.length, ticket.capacity)
        self._live[ring_id] = lease
        self._bytes_leased += lease.length
        ticket.lease = lease
        return True

    def _drain(self) -> list[Ticket]:
        granted: list[Ticket] = []
        while self._queue and self._place(self._queue[0]):
            granted.append(self._queue.popleft())
        return granted

    def _free(self, lease: Lease) -> None:
        del self._live[lease.ring_id]
        self._bytes_leased -= lease.length
        lease.state = LeaseState.RELEASED
        start, end = lease.offset, lease.end
        i = bisect.bisect_left(self._starts, start)
        assert i == len(self._starts) or self._starts[i] >= end, "freeing an overlapping range"
        assert i == 0 or self._ends[i - 1] <= start, "freeing an overlapping range"
        if i < len(self._starts) and self._starts[i] == end:  # coalesce with the next range
            end = self._ends[i]
            del self._starts[i], self._ends[i]
        if i > 0 and self._ends[i - 1] == start:  # and with the previous one
            self._ends[i - 1] = end
        else:
            self._starts.insert(i, start)
            self._ends.insert(i, end)
