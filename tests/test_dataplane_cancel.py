"""The data plane's calls left at any await (an outer cancel scope, a failing sibling, the call's own timeout) leave
nothing held, against a real worker and an arena that holds two rings: no lease, no ring end, and a later call's
timeout still holds when the arena is full."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import trio
import trio.testing

from tests.support.config import dataplane_config
from tests.support.helpers import wait_until
from tests.support.supervision import SPEC
from trio_gpuworker import DeadlineExceeded, Supervisor
from trio_gpuworker.supervisor import DataPlane, RingEnd

RING = 1 << 20  # two fit the arena below (each lease also holds its header), a third waits for space
ARENA = 3 << 20
SETTLE_S = 5.0  # an orphaned install is undone within one worker round trip; far less than this
TIMEOUT_S = 0.5
LATE_S = 2.0  # a call bounded by TIMEOUT_S that has not ended by then ignores its timeout


class SiblingFailed(Exception):
    pass


async def install(dp: DataPlane, direction: str = "egress", timeout: float | None = None) -> RingEnd:
    return await dp.install_ring("dp", direction=direction, capacity=RING, object_spec=SPEC, port_id="p",
                                 timeout=timeout)


async def held_after_settling(sup: Supervisor) -> tuple[list[int], list[int]]:
    """The live leases and ring ends once the orphan path had time to run (at once when nothing is held)."""
    dp = sup.dataplane
    with trio.move_on_after(SETTLE_S):
        await wait_until(lambda: not sup.arena.live() and not dp.ends, within_s=SETTLE_S)
    return [le.ring_id for le in sup.arena.live()], sorted(dp.ends)


async def cancel_by_outer_scope(dp: DataPlane) -> None:
    """An install whose task's enclosing cancel scope is cancelled while it waits on its worker."""
    scope = trio.CancelScope()

    async def installer() -> None:
        with scope:
            await install(dp)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(installer)
        await trio.testing.wait_all_tasks_blocked()  # its lease is taken, INSTALL_RING queued or sent
        scope.cancel()
    assert scope.cancelled_caught


async def cancel_by_failing_sibling(dp: DataPlane) -> None:
    """An install cancelled because a sibling in its nursery failed while it waited on its worker."""
    async def sibling() -> None:
        await trio.testing.wait_all_tasks_blocked()
        raise SiblingFailed

    with pytest.RaisesGroup(SiblingFailed):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(install, dp)
            nursery.start_soon(sibling)


@pytest.mark.parametrize("cancel", [cancel_by_outer_scope, cancel_by_failing_sibling])
async def test_a_cancelled_install_leaves_no_lease_or_ring(tmp_path: Path, cancel) -> None:
    async with Supervisor(dataplane_config(tmp_path, arena_bytes=ARENA)) as sup:
        dp = sup.dataplane
        for _ in range(3):  # more than the arena holds: a leak would also block the install below
            await cancel(dp)
        assert await held_after_settling(sup) == ([], [])
        with trio.fail_after(LATE_S):
            end = await install(dp, timeout=TIMEOUT_S)
        assert [le.ring_id for le in sup.arena.live()] == [end.ring_id]
        assert sup.lanes["dp"].generation == 1  # the worker stayed healthy: nothing was released by its death


async def test_the_arena_wait_honours_the_timeout(tmp_path: Path) -> None:
    async with Supervisor(dataplane_config(tmp_path, arena_bytes=ARENA)) as sup:
        dp = sup.dataplane
        held = [await install(dp), await install(dp)]  # the arena is full
        start = trio.current_time()
        with trio.fail_after(LATE_S), pytest.raises(DeadlineExceeded):
            await install(dp, timeout=TIMEOUT_S)
        assert TIMEOUT_S <= trio.current_time() - start < LATE_S
        assert sorted(le.ring_id for le in sup.arena.live()) == sorted(e.ring_id for e in held)
        await dp.uninstall_ring(held[0])
        with trio.fail_after(LATE_S):
            await install(dp, timeout=TIMEOUT_S)  # the space freed is granted, not kept by the one that left


async def test_a_cancelled_uninstall_still_releases_the_lease(tmp_path: Path) -> None:
    async with Supervisor(dataplane_config(tmp_path, arena_bytes=ARENA)) as sup:
        dp = sup.dataplane
        end = await install(dp)
        scope = trio.CancelScope()

        async def uninstaller() -> None:
            with scope:
                await dp.uninstall_ring(end)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(uninstaller)
            await trio.testing.wait_all_tasks_blocked()  # UNINSTALL_RING queued or sent
            scope.cancel()
        assert await held_after_settling(sup) == ([], [])
        assert end.released


async def test_a_cancelled_load_leaves_the_ring_usable_in_order(tmp_path: Path) -> None:
    async with Supervisor(dataplane_config(tmp_path, arena_bytes=ARENA)) as sup:
        dp = sup.dataplane
        ingress = await install(dp, "ingress")
        scope = trio.CancelScope()

        async def loader() -> None:
            with scope:
                await dp.load(ingress, np.ones(8, np.float32), object_id=1, sequence=0)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(loader)
            await trio.testing.wait_all_tasks_blocked()  # pushed, its OBJECT_LOADED not yet taken
            scope.cancel()
        with trio.fail_after(LATE_S):
            handle = await dp.load(ingress, np.full(8, 2, np.float32), object_id=2, sequence=1)
        assert handle["worker_generation"] == ingress.generation
        # the orphaned object was released, not kept
        await wait_until(lambda: dp.steps.handles.count() == 1, within_s=10.0)
