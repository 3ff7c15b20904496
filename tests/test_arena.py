"""ArenaManager: the shared memfd, waiting leases under trio, quiescence proofs, and a real child process."""

from __future__ import annotations

import fcntl
import itertools
import json
import mmap
import os
import pathlib
import random
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import pytest
import trio
import trio.testing

from cython_ring import RING_HEADER_LEN, STATE_ACTIVE, Ring
from trio_gpuworker.supervisor._arena import (
    DEFAULT_ARENA_BYTES,
    ArenaBusy,
    ArenaManager,
    ClosedArenaError,
    InvalidLeaseRequest,
    Lease,
    LeaseRejected,
    LeaseState,
    LeaseStateError,
    NeverInstalled,
    Quiesced,
    QuiescenceUnproven,
    Reaped,
)

H = RING_HEADER_LEN
SLOT = H + 64  # the smallest lease
LEASE_WAIT_S = 5.0  # how long a test lets a queued request wait (mock clock)
CHILD_TIMEOUT_S = 30.0
REPO = pathlib.Path(__file__).resolve().parent.parent


def release_all(arena: ArenaManager) -> None:
    for lease in arena.live():
        if lease.state is LeaseState.INSTALLED:
            assert lease.worker_pid is not None
            arena.release(lease, Reaped(lease.worker_pid, 0, pump_stopped=True))
        else:
            arena.release(lease, gone(lease))


@pytest.fixture
def arena() -> Iterator[ArenaManager]:
    with ArenaManager(64 * 1024) as a:
        yield a
        release_all(a)


def gone(lease: Lease) -> NeverInstalled:
    return NeverInstalled(lease.ring_id)


async def test_memfd_is_sparse_inheritable_and_sealed() -> None:
    with ArenaManager() as arena:
        assert arena.size == DEFAULT_ARENA_BYTES
        st = os.fstat(arena.fd)
        assert st.st_size == DEFAULT_ARENA_BYTES and st.st_blocks == 0  # a ceiling, not an allocation
        assert os.get_inheritable(arena.fd)
        assert not fcntl.fcntl(arena.fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC
        seals = fcntl.fcntl(arena.fd, fcntl.F_GET_SEALS)
        assert seals & fcntl.F_SEAL_SHRINK and seals & fcntl.F_SEAL_GROW and seals & fcntl.F_SEAL_SEAL
        with pytest.raises(PermissionError):
            os.ftruncate(arena.fd, 0)
        assert arena.env() == {"GPUWORKER_ARENA_FD": str(arena.fd), "GPUWORKER_ARENA_BYTES": str(DEFAULT_ARENA_BYTES)}
        assert arena.pass_fds == (arena.fd,)
        assert len(arena.mmap) == DEFAULT_ARENA_BYTES
        fd = arena.fd
    assert arena.closed
    with pytest.raises(OSError):
        os.fstat(fd)
    with pytest.raises(ClosedArenaError):
        arena.env()
    with pytest.raises(ClosedArenaError):
        await arena.lease(64)
    arena.close()  # idempotent


async def test_first_fit_and_alignment(arena: ArenaManager) -> None:
    a, b, c = await arena.lease(64), await arena.lease(320), await arena.lease(64)
    assert [x.offset for x in (a, b, c)] == [0, SLOT, SLOT + H + 320]
    assert [x.ring_id for x in (a, b, c)] == [1, 2, 3]
    assert (b.length, b.capacity, b.data_offset) == (H + 320, 320, SLOT + H)
    arena.release(b, gone(b))
    d = await arena.lease(64)  # first fit: into b's hole
    e = await arena.lease(128)  # fits the rest of the hole exactly
    assert (d.offset, e.offset) == (b.offset, d.end)
    assert e.end == c.offset
    assert all(x.offset % 64 == 0 for x in (a, c, d, e))
    for bad in (0, 32, 100, -64):
        with pytest.raises(InvalidLeaseRequest):
            await arena.lease(bad)


async def test_random_leases_never_overlap(arena: ArenaManager) -> None:
    """A seeded random lease/release loop; every live ring's header and data stay intact."""
    rng = random.Random(20240607)
    view = arena.mmap
    live: dict[int, Lease] = {}
    last_id = 0
    for _ in range(400):
        if live and (rng.random() < 0.45 or arena.stats().largest_free < 4 * SLOT):
            lease = live.pop(rng.choice(sorted(live)))
            arena.release(lease, gone(lease))
            assert view[lease.offset:lease.offset + H] == bytes(H), "a released header is zeroed"
        else:
            capacity = 64 * rng.randint(1, 40)
            if H + capacity > arena.stats().largest_free:
                continue
            lease = await arena.lease(capacity)
            assert lease.ring_id > last_id and lease.offset % 64 == 0
            last_id = lease.ring_id
            with arena.init_ring(lease):
                pass
            view[lease.data_offset:lease.end] = bytes([lease.ring_id % 251]) * capacity
            live[lease.ring_id] = lease
        spans = sorted((x.offset, x.end) for x in live.values())
        assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))
        for x in live.values():
            with Ring.attach(view, x.offset, expected_ring_id=x.ring_id, expected_capacity=x.capacity):
                pass
            assert view[x.data_offset:x.end] == bytes([x.ring_id % 251]) * x.capacity
    for lease in live.values():
        arena.release(lease, gone(lease))
    assert arena.stats().bytes_leased == 0 and arena.stats().largest_free == arena.size


async def fill(arena: ArenaManager) -> list[Lease]:
    return [await arena.lease(64) for _ in range(arena.size // SLOT)]


async def test_fifo_queue_when_full() -> None:
    got: list[tuple[str, Lease]] = []

    async def want(name: str, capacity: int) -> None:
        got.append((name, await arena.lease(capacity)))

    with ArenaManager(8 * SLOT) as arena:
        held = await fill(arena)
        async with trio.open_nursery() as nursery:
            for name, capacity in (("big", H + 128), ("small", 64), ("late", 64)):
                nursery.start_soon(want, name, capacity)
                await trio.testing.wait_all_tasks_blocked()
            assert arena.stats().queued == 3 and not got
            # One slot frees: "small" would fit, but does not overtake "big".
            arena.release(held[5], gone(held[5]))
            await trio.testing.wait_all_tasks_blocked()
            assert not got and arena.stats().queued == 3
            arena.release(held[4], gone(held[4]))  # now two adjacent slots: big first
            await trio.testing.wait_all_tasks_blocked()
            assert [n for n, _ in got] == ["big"] and got[0][1].offset == held[4].offset
            arena.release(held[0], gone(held[0]))
            arena.release(held[7], gone(held[7]))
        got.sort(key=lambda item: item[1].ring_id)  # tasks wake in any order; ids record the grant order
        assert [(n, x.ring_id) for n, x in got] == [("big", 9), ("small", 10), ("late", 11)]
        assert [x.offset for _, x in got[1:]] == [0, held[7].offset]
        release_all(arena)


async def test_never_fits_is_rejected_not_queued(arena: ArenaManager) -> None:
    with pytest.raises(LeaseRejected):
        await arena.lease(arena.size)
    held = await arena.lease(arena.size - H)  # the whole arena
    with trio.fail_after(LEASE_WAIT_S):
        with pytest.raises(LeaseRejected):
            await arena.lease(arena.size - H + 64)
    assert arena.stats().queued == 0
    arena.release(held, gone(held))


async def test_cancelled_wait_leaves_queue_and_leaks_nothing(autojump_clock: trio.testing.MockClock) -> None:
    with ArenaManager(4 * SLOT) as arena:
        held = await fill(arena)
        with trio.move_on_after(LEASE_WAIT_S) as scope:
            await arena.lease(64)
        assert scope.cancelled_caught
        assert trio.current_time() == pytest.approx(LEASE_WAIT_S)
        assert arena.stats().queued == 0
        for lease in held:
            arena.release(lease, gone(lease))
        assert arena.stats().bytes_leased == 0 and arena.stats().largest_free == arena.size

        # Cancelling the queue head lets the request behind it in at once.
        held = await fill(arena)
        got: list[Lease] = []
        async with trio.open_nursery() as nursery:
            head = trio.CancelScope()

            async def big() -> None:
                with head:
                    await arena.lease(H + 128)

            async def small() -> None:
                got.append(await arena.lease(64))

            nursery.start_soon(big)
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(small)
            await trio.testing.wait_all_tasks_blocked()
            arena.release(held[1], gone(held[1]))
            await trio.testing.wait_all_tasks_blocked()
            assert not got and arena.stats().queued == 2
            head.cancel()
        assert [x.offset for x in got] == [held[1].offset]
        assert arena.stats().queued == 0
        release_all(arena)

        # Already cancelled on entry: nothing is leased.
        with trio.CancelScope() as scope:
            scope.cancel()
            await arena.lease(64)
        assert arena.stats().live_leases == 0 and arena.stats().next_ring_id == 10


async def test_cancel_after_grant_still_hands_the_lease_over() -> None:
    """A grant and a cancel in the same tick: the waiter gets its lease (owned, not leaked)."""
    got: list[Lease] = []
    with ArenaManager(SLOT) as arena:
        held = await arena.lease(64)
        scope = trio.CancelScope()

        async def waiter() -> None:
            with scope:
                got.append(await arena.lease(64))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(waiter)
            await trio.testing.wait_all_tasks_blocked()
            arena.release(held, gone(held))
            scope.cancel()
        assert [x.ring_id for x in got] == [2] and arena.live() == got
        release_all(arena)


async def test_ring_ids_never_reused(arena: ArenaManager) -> None:
    ids = []
    for _ in range(20):
        lease = await arena.lease(64)
        ids.append(lease.ring_id)
        arena.release(lease, gone(lease))
    assert ids == list(range(1, 21))
    assert (await arena.lease(64, ring_id_hint=50)).ring_id == 50
    assert (await arena.lease(64, ring_id_hint=7)).ring_id == 51  # a hint never goes backwards
    with ArenaManager(64 * 1024, first_ring_id=1000) as later:  # e.g. above a previous daemon's ids
        lease = await later.lease(64)
        assert lease.ring_id == 1000
        later.release(lease, gone(lease))


async def test_release_requires_quiescence_proof(arena: ArenaManager) -> None:
    lease, other = await arena.lease(64), await arena.lease(64)
    arena.init_ring(lease).release()
    arena.mark_installed(lease, 4242)
    assert arena.installed_on(4242) == [lease]
    rid = lease.ring_id
    for bad in (
        None,
        NeverInstalled(rid),
        Quiesced(other.ring_id, pump_stopped=True),
        Quiesced(rid, pump_stopped=False),
        Reaped(4243, 0, pump_stopped=True),
        Reaped(4242, 0, pump_stopped=False),
    ):
        with pytest.raises(QuiescenceUnproven):
            arena.release(lease, bad)  # type: ignore[arg-type]
        assert lease.state is LeaseState.INSTALLED and lease in arena.live()
        with Ring.attach(arena.mmap, lease.offset, expected_ring_id=rid) as ring:  # header untouched
            assert ring.state == STATE_ACTIVE
    arena.release(lease, Reaped(4242, -9, pump_stopped=True))
    assert lease.state is LeaseState.RELEASED and arena.installed_on(4242) == []
    with pytest.raises(LeaseStateError):
        arena.release(lease, Reaped(4242, -9, pump_stopped=True))
    with pytest.raises(LeaseStateError):
        arena.init_ring(lease)
    arena.mark_installed(other, 99)
    arena.release(other, Quiesced(other.ring_id, pump_stopped=True))


async def test_release_reclaims_pages(arena: ArenaManager) -> None:
    lease = await arena.lease(8 * mmap.PAGESIZE - H)
    arena.mmap[lease.offset:lease.end] = b"\xa5" * lease.length
    assert os.fstat(arena.fd).st_blocks > 0
    arena.release(lease, gone(lease))
    assert os.fstat(arena.fd).st_blocks == 0
    assert arena.mmap[lease.offset:lease.end] == bytes(lease.length)


async def test_close_refuses_while_busy() -> None:
    arena = ArenaManager(64 * 1024)
    lease = await arena.lease(64)
    with pytest.raises(ArenaBusy):
        arena.close()
    ring = arena.init_ring(lease)
    arena.release(lease, gone(lease))
    with pytest.raises(ArenaBusy, match="exported"):  # the daemon's Ring still views the mapping
        arena.close()
    assert not arena.closed and (await arena.lease(64)).ring_id == 2
    arena.release(arena.live()[0], gone(arena.live()[0]))
    ring.release()
    arena.close()
    assert arena.closed


CHILD = textwrap.dedent(
    """
    import json, mmap, os, sys
    from cython_ring import Ring

    fd, size = int(os.environ["GPUWORKER_ARENA_FD"]), int(os.environ["GPUWORKER_ARENA_BYTES"])
    offset, ring_id, capacity, marker_at = map(int, sys.argv[1:5])
    arena = mmap.mmap(fd, size)  # MAP_SHARED, read/write
    with Ring.attach(arena, offset, expected_ring_id=ring_id, expected_capacity=capacity) as ring:
        seen = {"ring_id": ring.ring_id, "capacity": ring.capacity, "state": ring.state,
                "data": arena[offset + 128:offset + 128 + 11].decode()}
    try:
        os.ftruncate(fd, 0)
        seen["shrunk"] = True
    except PermissionError:
        seen["shrunk"] = False
    arena[marker_at:marker_at + 5] = b"child"
    print(json.dumps(seen))
    """
)


async def test_child_maps_the_same_memfd(arena: ArenaManager) -> None:
    await arena.lease(64)  # so the ring under test does not start at offset 0
    lease = await arena.lease(4096)
    arena.init_ring(lease).release()
    arena.mmap[lease.data_offset:lease.data_offset + 11] = b"from daemon"
    marker_at = lease.end - 64
    env = {**os.environ, **arena.env()}
    argv = [sys.executable, "-c", CHILD, *map(str, (lease.offset, lease.ring_id, lease.capacity, marker_at))]
    with trio.fail_after(CHILD_TIMEOUT_S):
        proc = await trio.lowlevel.open_process(argv, env=env, pass_fds=arena.pass_fds, cwd=REPO,
                                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        arena.mark_installed(lease, proc.pid)
        assert proc.stdout is not None
        async with proc.stdout:
            out = b"".join([chunk async for chunk in proc.stdout])
        await proc.wait()
    assert proc.returncode == 0, out.decode()
    seen = json.loads(out.splitlines()[-1])
    assert seen == {"ring_id": lease.ring_id, "capacity": 4096, "state": STATE_ACTIVE, "data": "from daemon",
                    "shrunk": False}
    assert arena.mmap[marker_at:marker_at + 5] == b"child"  # and the child's writes reach the daemon
    arena.release(lease, Reaped(proc.pid, proc.returncode, pump_stopped=True))
