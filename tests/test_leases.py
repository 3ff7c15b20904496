"""LeaseTable: first fit, strict FIFO, rejection, withdrawal, ring ids and quiescence proofs; sans-I/O."""

from __future__ import annotations

import ast
import itertools
import pathlib

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from cython_ring import RING_HEADER_LEN as NATIVE_HEADER_LEN
from trio_gpuworker._errors import (
    ArenaBusy,
    ArenaError,
    ClosedArenaError,
    GpuWorkerError,
    InvalidLeaseRequest,
    LeaseRejected,
    LeaseStateError,
    QuiescenceUnproven,
)
from trio_gpuworker._proto import (
    ALIGN,
    RING_HEADER_LEN,
    Lease,
    LeaseState,
    LeaseTable,
    NeverInstalled,
    Quiesced,
    Reaped,
    _leases,
)

H = RING_HEADER_LEN


def grant(table: LeaseTable, capacity: int, **kw: int) -> Lease:
    ticket = table.submit(capacity, **kw)
    assert ticket.lease is not None, "expected an immediate grant"
    return ticket.lease


def test_module_is_sans_io() -> None:
    tree = ast.parse(pathlib.Path(_leases.__file__).read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom) and node.module}
    assert imported <= {"__future__", "bisect", "collections", "dataclasses", "enum", "trio_gpuworker", "_errors"}
    assert RING_HEADER_LEN == NATIVE_HEADER_LEN


def test_errors_are_typed() -> None:
    for cls in (InvalidLeaseRequest, LeaseRejected, QuiescenceUnproven, LeaseStateError, ArenaBusy,
                ClosedArenaError):
        assert issubclass(cls, ArenaError) and issubclass(cls, GpuWorkerError)
    assert issubclass(InvalidLeaseRequest, ValueError)


@pytest.mark.parametrize("size", [0, 64, H, H + 32, H + 100, 4096 + 1, True, 4096.0])
def test_bad_arena_size(size: object) -> None:
    with pytest.raises(InvalidLeaseRequest):
        LeaseTable(size)  # type: ignore[arg-type]


@pytest.mark.parametrize("capacity", [0, -64, 1, 63, 65, 100, True, 64.0, "64", None])
def test_bad_capacity(capacity: object) -> None:
    table = LeaseTable(4096)
    with pytest.raises(InvalidLeaseRequest):
        table.submit(capacity)  # type: ignore[arg-type]
    assert table.stats().live_leases == 0


def test_first_fit_and_alignment() -> None:
    table = LeaseTable(4096)
    a, b, c = grant(table, 64), grant(table, 128), grant(table, 64)
    assert (a.offset, b.offset, c.offset) == (0, H + 64, 2 * H + 192)
    assert (a.length, b.length, c.length) == (H + 64, H + 128, H + 64)
    assert (a.data_offset, a.end) == (H, H + 64)
    assert all(x.offset % ALIGN == 0 for x in (a, b, c))
    table.release(b, NeverInstalled(b.ring_id))
    d = grant(table, 64)  # first fit: the hole b left, not the tail
    assert d.offset == b.offset
    e = grant(table, 128)  # the hole's 64-byte remainder is too small: the tail
    assert e.offset == c.end
    assert table.free_ranges() == [(d.end, b.end), (e.end, 4096)]


def test_coalescing_restores_one_range() -> None:
    table = LeaseTable(8192)
    leases = [grant(table, 64 * (i + 1)) for i in range(5)]
    for lease in (leases[1], leases[3], leases[2], leases[0], leases[4]):
        table.release(lease, NeverInstalled(lease.ring_id))
    assert table.free_ranges() == [(0, 8192)]
    assert table.stats().bytes_leased == 0


def test_never_fits_is_rejected_at_once() -> None:
    table = LeaseTable(4096)
    with pytest.raises(LeaseRejected):
        table.submit(4096 - H + 64)
    whole = grant(table, 4096 - H)  # exactly the arena
    with pytest.raises(LeaseRejected):  # rejected even while full, never queued
        table.submit(4096)
    assert table.stats().queued == 0
    assert (whole.offset, whole.end) == (0, 4096)


def test_strict_fifo() -> None:
    table = LeaseTable(4 * (H + 64))
    held = [grant(table, 64) for _ in range(4)]
    big = table.submit(H + 128)  # needs two slots
    small = table.submit(64)
    assert big.lease is None and small.lease is None
    # One slot frees: small would fit, but it does not overtake the big one ahead of it.
    assert table.release(held[3], NeverInstalled(held[3].ring_id)) == []
    late = table.submit(64)
    assert late.lease is None, "a request behind a waiting one queues even if it fits"
    assert table.stats().queued == 3
    assert table.release(held[2], NeverInstalled(held[2].ring_id)) == [big]
    assert big.lease is not None and big.lease.offset == held[2].offset
    assert table.release(held[0], NeverInstalled(held[0].ring_id)) == [small]
    assert table.release(held[1], NeverInstalled(held[1].ring_id)) == [late]
    assert [t.lease.ring_id for t in (big, small, late) if t.lease] == [5, 6, 7]


def test_withdraw_queued_head_lets_the_next_in() -> None:
    table = LeaseTable(2 * (H + 64))
    a, _b = grant(table, 64), grant(table, 64)
    table.release(a, NeverInstalled(a.ring_id))
    big = table.submit(H + 128)
    small = table.submit(64)
    assert big.lease is None and small.lease is None
    assert table.withdraw(big) == [small]
    assert small.lease is not None and small.lease.offset == 0
    assert table.withdraw(big) == []  # idempotent
    assert table.stats().queued == 0


def test_withdraw_granted_lease_returns_range_and_burns_id() -> None:
    table = LeaseTable(H + 64)
    first = grant(table, 64)
    ticket = table.submit(64)
    table.release(first, NeverInstalled(first.ring_id))
    assert ticket.lease is not None and ticket.lease.ring_id == 2
    assert table.withdraw(ticket) == []
    assert ticket.lease.state is LeaseState.RELEASED
    assert table.free_ranges() == [(0, H + 64)]
    again = table.submit(64)
    assert again.lease is not None and again.lease.ring_id == 3
    table.mark_installed(again.lease, 10)
    with pytest.raises(LeaseStateError):  # once handed to a worker it needs a proof
        table.withdraw(again)
    assert again.lease.state is LeaseState.INSTALLED


def test_ring_ids_monotonic_never_reused_and_hints() -> None:
    table = LeaseTable(4096, first_ring_id=5)
    ids = []
    for _ in range(10):
        lease = grant(table, 64)
        ids.append(lease.ring_id)
        table.release(lease, NeverInstalled(lease.ring_id))
    assert ids == list(range(5, 15))
    assert grant(table, 64, ring_id_hint=100).ring_id == 100
    assert grant(table, 64, ring_id_hint=3).ring_id == 101  # a hint never goes backwards
    assert grant(table, 64).ring_id == 102
    with pytest.raises(InvalidLeaseRequest):
        table.submit(64, ring_id_hint=0)


def test_release_requires_a_valid_proof() -> None:
    table = LeaseTable(4096)
    lease = grant(table, 64)
    other = grant(table, 64)
    rid = lease.ring_id
    # Not yet installed: only NeverInstalled for this ring proves it.
    for bad in (None, "quiesced", rid, Quiesced(rid, pump_stopped=True), Reaped(77, 0, pump_stopped=True),
                NeverInstalled(other.ring_id)):
        with pytest.raises(QuiescenceUnproven):
            table.release(lease, bad)
        assert lease.state is LeaseState.LEASED and lease in table.live()
    table.mark_installed(lease, 77)
    assert table.installed_on(77) == [lease]
    bad_proofs = [
        None,
        NeverInstalled(rid),  # it was installed
        Quiesced(other.ring_id, pump_stopped=True),  # wrong ring
        Quiesced(rid, pump_stopped=False),  # pump still running
        Quiesced(rid, pump_stopped=1),  # type: ignore[arg-type]  # only True proves it
        Reaped(78, 0, pump_stopped=True),  # another worker
        Reaped(77, 0, pump_stopped=False),
        Reaped(77, None, pump_stopped=True),  # type: ignore[arg-type]  # not reaped
    ]
    before = table.stats()
    for bad in bad_proofs:
        with pytest.raises(QuiescenceUnproven, match=f"ring {rid} kept"):
            table.release(lease, bad)
        assert lease.state is LeaseState.INSTALLED and lease in table.live()
    assert table.stats() == before
    table.release(lease, Quiesced(rid, pump_stopped=True))
    assert lease.state is LeaseState.RELEASED
    with pytest.raises(LeaseStateError, match="released already"):
        table.release(lease, Quiesced(rid, pump_stopped=True))
    table.mark_installed(other, 5)
    table.release(other, Reaped(5, -9, pump_stopped=True))


def test_foreign_and_misused_leases() -> None:
    one, two = LeaseTable(4096), LeaseTable(4096)
    lease = grant(one, 64)
    twin = grant(two, 64)  # same id and offset, another arena
    with pytest.raises(LeaseStateError, match="not a lease of this arena"):
        one.release(twin, NeverInstalled(twin.ring_id))
    with pytest.raises(LeaseStateError):
        one.release("lease", NeverInstalled(1))  # type: ignore[arg-type]
    with pytest.raises(InvalidLeaseRequest):
        one.mark_installed(lease, 0)
    one.mark_installed(lease, 42)
    with pytest.raises(LeaseStateError, match="installed in worker 42"):
        one.mark_installed(lease, 43)


def test_close() -> None:
    table = LeaseTable(4096)
    lease = grant(table, 64)
    with pytest.raises(ArenaBusy):
        table.close()
    table.release(lease, NeverInstalled(lease.ring_id))
    table.close()
    with pytest.raises(ClosedArenaError):
        table.submit(64)


def test_stats() -> None:
    table = LeaseTable(2 * (H + 64))
    a = grant(table, 64)
    table.submit(H + 64 + 64)
    s = table.stats()
    assert (s.size, s.bytes_leased, s.live_leases, s.queued, s.queued_bytes) == (2 * (H + 64), H + 64, 1, 1,
                                                                                 2 * H + 128)
    assert (s.largest_free, s.next_ring_id) == (H + 64, 2)
    table.release(a, NeverInstalled(a.ring_id))
    s = table.stats()
    assert (s.bytes_leased, s.live_leases, s.queued, s.largest_free) == (2 * H + 128, 1, 0, 0)


class LeaseMachine(RuleBasedStateMachine):
    """Random submit / release / withdraw; the table must stay consistent and strictly FIFO."""

    SIZE = 16 * 1024

    def __init__(self) -> None:
        super().__init__()
        self.table = LeaseTable(self.SIZE)
        self.queued: list[_leases.Ticket] = []
        self.seen_ids: list[int] = []

    def _granted(self, tickets: list[_leases.Ticket]) -> None:
        assert tickets == self.queued[: len(tickets)], "grants leave the queue from its head, in order"
        del self.queued[: len(tickets)]
        for t in tickets:
            assert t.lease is not None
            self.seen_ids.append(t.lease.ring_id)

    @rule(units=st.integers(1, 80))
    def submit(self, units: int) -> None:
        capacity = units * ALIGN
        if H + capacity > self.SIZE:
            with pytest.raises(LeaseRejected):
                self.table.submit(capacity)
            return
        ticket = self.table.submit(capacity)
        if ticket.lease is None:
            self.queued.append(ticket)
        else:
            assert not self.queued, "nothing overtakes a waiting request"
            self.seen_ids.append(ticket.lease.ring_id)

    @precondition(lambda self: self.table.live())
    @rule(data=st.data(), install=st.booleans())
    def release(self, data: st.DataObject, install: bool) -> None:
        lease = data.draw(st.sampled_from(self.table.live()))
        if install and lease.state is LeaseState.LEASED:
            self.table.mark_installed(lease, 1000 + lease.ring_id)
        if lease.state is LeaseState.INSTALLED:
            with pytest.raises(QuiescenceUnproven):
                self.table.release(lease, Quiesced(lease.ring_id, pump_stopped=False))
            proof: _leases.Proof = data.draw(st.sampled_from([Quiesced(lease.ring_id, pump_stopped=True),
                                                              Reaped(lease.worker_pid or 0, 0, pump_stopped=True)]))
        else:
            proof = NeverInstalled(lease.ring_id)
        self._granted(self.table.release(lease, proof))

    @precondition(lambda self: self.queued)
    @rule(data=st.data())
    def withdraw(self, data: st.DataObject) -> None:
        ticket = data.draw(st.sampled_from(self.queued))
        self.queued.remove(ticket)
        self._granted(self.table.withdraw(ticket))

    @invariant()
    def consistent(self) -> None:
        live = self.table.live()
        free = self.table.free_ranges()
        spans = sorted([(x.offset, x.end) for x in live] + free)
        pos = 0
        for start, end in spans:  # leases and free ranges tile the arena exactly: no overlap, no leak
            assert start == pos and end > start and start % ALIGN == 0
            pos = end
        assert pos == self.SIZE
        assert all(b[0] > a[1] for a, b in itertools.pairwise(free)), "free ranges are coalesced"
        assert self.seen_ids == sorted(set(self.seen_ids)), "ids strictly increase, never reused"
        stats = self.table.stats()
        assert stats.bytes_leased == sum(x.length for x in live)
        assert stats.queued == len(self.queued)
        if self.queued:  # the head waits only because it does not fit anywhere
            assert self.queued[0].length > stats.largest_free
            assert live, "with no live leases every admissible request fits"


TestLeaseMachine = LeaseMachine.TestCase
TestLeaseMachine.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
