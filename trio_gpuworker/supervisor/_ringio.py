"""The daemon's byte moves on its rings (a mixin of DataPlane): producing into ingress rings (one native batch
write per burst, completions taken a whole OBJECTS_LOADED batch at a time) and consuming egress rings (one native
drain into a pool of preallocated destinations per wake-up). Backpressure is the absence of ring space."""

from __future__ import annotations

import contextlib
import mmap
import os
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, overload

import numpy as np
import trio

from cython_ring import RingCorrupt, buffer_records, drain_batch, write_egress, write_egress_batch

from .._errors import GpuWorkerError, ObjectFailed, RingFault
from .._proto import HANDLE_ID, OBJECT_ID, LoadedRow, ObjectLoaded, RingReadable, RingWritable, WireMessage
from ._ringend import RingEnd

POOL_OBJECTS = 64  # egress destinations made at once for one extent (fewer when fewer fit the ring)
SLAB_BYTES = 1 << 20  # ... and at most this much memory, which lives while any object pulled from it does
# A burst writes at most this share of the ring before it commits, so the worker drains one part while the daemon
# writes the next instead of waiting for one commit of a whole ring's worth
BURST_SHARE = 4
# ... and the first one this share of that, so the worker starts draining (and reporting) while the rest is written
FIRST_BURST_SHARE = 8
BURST_ROWS = 4096  # ... and at most this many objects (tiny ones: the ring holds their headers too)
# A producer short of space looks at the consume cursor again for up to this long (sched_yield, then an event-loop
# checkpoint, between looks) before it waits for RING_WRITABLE: a worker that is draining frees space sooner than
# its RING_WRITABLE crosses the socket (README "fourth pass")
SPACE_POLL_S = 200e-6


def _refill(end: RingEnd, extent: int) -> None:
    """Destinations for the object the drain waits on and those after it, as views of one fresh slab: objects of a
    ring mostly share an extent, so one allocation serves a burst. Free ones of another size are dropped first."""
    pool, landing = end.pool, end.landing
    if pool.next_size is not None and pool.next_size != extent:
        for _ in range(pool.clear()):
            landing.pop()
    k = max(1, min(POOL_OBJECTS, end.ring.capacity // (extent + 40) + 1, SLAB_BYTES // max(extent, 1)))
    slab = np.empty((k, extent), np.uint8)
    base, row = slab.ctypes.data, extent
    pool.put_many(np.arange(base, base + k * row, row, dtype=np.uint64) if extent else np.zeros(k, np.uint64), extent)
    landing.extend(slab)


class DeviceHandles(Sequence[dict[str, int]]):
    """load_many's device handles, in order: one worker generation and the handle ids as an array. Each handle's
    dict is made when it is read, so a burst of small objects costs no Python object per handle until used."""

    __slots__ = ("generation", "ids")

    def __init__(self, generation: int, ids: np.ndarray) -> None:
        self.generation, self.ids = generation, ids

    def __len__(self) -> int:
        return len(self.ids)

    @overload
    def __getitem__(self, i: int) -> dict[str, int]: ...
    @overload
    def __getitem__(self, i: slice) -> list[dict[str, int]]: ...
    def __getitem__(self, i: int | slice) -> dict[str, int] | list[dict[str, int]]:
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        return {"worker_generation": self.generation, "id": int(self.ids[i])}

    def __iter__(self) -> Iterator[dict[str, int]]:
        gen = self.generation
        return ({"worker_generation": gen, "id": h} for h in self.ids.tolist())

    def __repr__(self) -> str:
        return f"<DeviceHandles of generation {self.generation}: {len(self)}>"


class RingIO:
    """Pushes, loads and pulls; DataPlane supplies the lanes and the byte counters."""

    bytes_moved: dict[str, int]
    _release_orphans: Callable[[RingEnd, list[int]], None]  # DataPlane's: frees device handles nobody will take

    # --- producing into an ingress ring -------------------------------------------------------------

    async def push(self, end: RingEnd, data: Any, *, object_id: int, sequence: int, flags: int = 0) -> None:
        """Write one object (header + every payload byte) into an ingress ring, waiting for space."""
        assert end.direction == "ingress", "the daemon produces only into ingress rings"
        src = np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8) if not isinstance(data, np.ndarray) else \
            np.ascontiguousarray(data).view(np.uint8).reshape(-1)
        extent = src.size
        addr = src.ctypes.data if extent else 0
        with self._abandoned_when_left(end):
            while True:
                end.raise_if_faulted()
                end.hint = trio.Event()
                n, notify = write_egress(end.ring, end.state, object_id, sequence, addr, extent, flags)
                self._moved(end, "ingress", n)
                if notify:
                    await self._notify(end, RingReadable)
                if not end.state.busy:
                    return
                await end.hint.wait()  # RING_WRITABLE from the worker, or a fault

    @staticmethod
    @contextlib.contextmanager
    def _abandoned_when_left(end: RingEnd) -> Iterator[None]:
        """A producer that leaves (cancelled, or an error) mid-object cannot take back what it wrote: the ring is
        faulted, so the worker and every later push on it see a typed fault rather than a torn object."""
        try:
            yield
        except BaseException:
            if end.state.busy and not end.released and end.state.abandon(end.ring):
                end.fail(RingFault("ring_state_invalid", f"ring {end.ring_id}: its producer left mid-object"))
            raise

    async def push_many(self, end: RingEnd, objects: list[Any], *, first_object_id: int, first_sequence: int,
                        flags: int = 0, written: list[int] | None = None) -> None:
        """Write many objects (consecutive ids and sequences) into an ingress ring: each burst is one native call
        that writes every record that fits, with one wake hint; ring space is the only backpressure. The
        buffers must stay alive and unchanged until this returns (it holds `objects`). `written[0]` follows how
        many objects are written whole."""
        written = [0] if written is None else written
        assert end.direction == "ingress", "the daemon produces only into ingress rings"
        records = buffer_records(objects, first_object_id, first_sequence, flags)
        ends = np.cumsum(records[:, 3])  # where each object's bytes end, counted from the first
        burst = max(1, end.ring.capacity // BURST_SHARE)
        i = 0
        with self._abandoned_when_left(end):
            while i < len(objects):
                end.raise_if_faulted()
                end.hint = trio.Event()
                # at most `burst` bytes and BURST_ROWS rows (at least one: a larger object streams through)
                start = int(ends[i - 1]) if i else 0
                size = burst if i else max(1, burst // FIRST_BURST_SHARE)
                stop = max(i + 1, min(i + BURST_ROWS, int(np.searchsorted(ends, start + size, "right"))))
                i, n, notify = write_egress_batch(end.ring, end.state, records[:stop], i)
                written[0] = i
                self._moved(end, "ingress", n)
                if notify:
                    await self._notify(end, RingReadable)
                if i < len(objects) and not n and not await self._space(end, burst):
                    await end.hint.wait()

    @staticmethod
    async def _space(end: RingEnd, want: int) -> bool:
        """Whether `want` bytes of ring space (or the wake hint) turned up within SPACE_POLL_S: bounded, and the
        CPU and the event loop are yielded between looks, so a busy machine loses no more than that."""
        deadline = time.perf_counter() + SPACE_POLL_S
        while not end.hint.is_set():
            try:
                if end.ring.writable >= want:
                    return True
            except RingCorrupt:
                return True  # the next write finds the cursors corrupt and raises it typed
            if time.perf_counter() > deadline:
                return False
            os.sched_yield()
            await trio.lowlevel.checkpoint()
        return True

    def _moved(self, end: RingEnd, direction: str, n: int) -> None:
        end.bytes_moved += n
        self.bytes_moved[direction] += n

    async def next_event(self, end: RingEnd) -> ObjectLoaded:
        """The next OBJECT_LOADED (or OBJECT_FAILED / RING_FAULT, raised) for an ingress ring."""
        row = LoadedRow(*map(int, (await self._rows(end, 1))[0]))
        return ObjectLoaded(ring_id=end.ring_id, edge_id=end.edge_id, port_id=end.port_id, object_id=row.object_id,
                            sequence=row.sequence, extent=row.extent,
                            device_handle={"worker_generation": end.generation, "id": row.handle_id})

    async def _rows(self, end: RingEnd, limit: int) -> list[list[int]] | np.ndarray:
        """Up to `limit` completed rows [object_id, sequence, extent, handle id], waiting for at least one."""
        while not len(rows := end.take_rows(limit)):
            end.raise_if_faulted()
            end.event_ready = trio.Event()
            await end.event_ready.wait()
        return rows

    async def load(self, end: RingEnd, data: Any, *, object_id: int, sequence: int, flags: int = 0) -> dict[str, Any]:
        """push + wait for its OBJECT_LOADED; returns the device handle."""
        end.raise_if_faulted()  # one typed error (else the push and the wait would each raise it)
        pushed = [False]

        async def push() -> None:
            await self.push(end, data, object_id=object_id, sequence=sequence, flags=flags)
            pushed[0] = True

        with self._disowned_when_left(end, lambda: [(object_id, sequence)] if pushed[0] else []):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(push)
                msg = await self.next_event(end)
        if msg.object_id != object_id:
            raise ObjectFailed("sequence_violation", f"loaded object {msg.object_id}, expected {object_id}")
        return msg.device_handle

    async def load_many(self, end: RingEnd, objects: list[Any], *, first_object_id: int, first_sequence: int,
                        flags: int = 0) -> DeviceHandles:
        """push_many + wait until every object is loaded; returns their device handles, in order. Completions
        arrive in batches (one OBJECTS_LOADED or LOADED_BLOCK per worker drain), so many callers wake from one
        message, and each batch is checked and recorded with array operations, not Python per object."""
        ids = np.empty(len(objects), np.uint64)
        done, written = 0, [0]
        end.raise_if_faulted()

        def left() -> list[tuple[int, int]]:  # written whole and not yet taken
            return [(first_object_id + k, first_sequence + k) for k in range(done, written[0])]

        with self._disowned_when_left(end, left):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(lambda: self.push_many(end, objects, first_object_id=first_object_id,
                                                          first_sequence=first_sequence, flags=flags, written=written))
                gen = end.generation
                while done < len(objects):
                    done = await self._take_loaded(end, ids, done, first_object_id)
        return DeviceHandles(gen, ids)

    async def _take_loaded(self, end: RingEnd, ids: np.ndarray, done: int, first_object_id: int) -> int:
        """The next batch of load_many's completions (checked in order) into `ids` from `done` on; returns how many
        are taken in all."""
        rows = await self._rows(end, len(ids) - done)  # a whole batch at a time
        table = rows if isinstance(rows, np.ndarray) else np.array(rows, np.uint64).reshape(-1, 4)
        got = table[:, OBJECT_ID]
        want = np.arange(first_object_id + done, first_object_id + done + len(table), dtype=np.uint64)
        if not np.array_equal(got, want):
            k = int(np.flatnonzero(got != want)[0])
            raise ObjectFailed("sequence_violation", f"loaded object {int(got[k])}, expected {int(want[k])}")
        ids[done:done + len(table)] = table[:, HANDLE_ID]
        return done + len(table)

    @contextlib.contextmanager
    def _disowned_when_left(self, end: RingEnd, objects: Callable[[], list[tuple[int, int]]]) -> Iterator[None]:
        """A loader that leaves (cancelled, or an error) before taking its completions disowns the objects it wrote
        whole: their rows never reach a later loader, their device handles are released (by the data plane)."""
        try:
            yield
        except BaseException:
            self._release_orphans(end, end.disown(objects()))
            raise

    async def pump_file(self, end: RingEnd, path: Path, *, object_id: int, sequence: int, flags: int = 0) -> None:
        """Disk -> ring as one object of the file's size. The file is mapped read-only and copied from the
        page cache straight into ring space as the consumer frees it: no staging buffer, no Python per chunk."""
        with path.open("rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size == 0:
                await self.push(end, b"", object_id=object_id, sequence=sequence, flags=flags)
                return
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                view = np.frombuffer(mm, dtype=np.uint8)
                try:
                    await self.push(end, view, object_id=object_id, sequence=sequence, flags=flags)
                finally:
                    del view  # the mapping closes only once no array exports it

    # --- consuming an egress ring ----------------------------------------------------------------

    async def pull(self, end: RingEnd) -> tuple[int, int, np.ndarray]:
        """The next whole object from an egress ring: (object_id, sequence, bytes as uint8 array)."""
        while not end.received:
            await self._drain_egress(end)
        return end.received.popleft()

    async def pull_many(self, end: RingEnd) -> list[tuple[int, int, np.ndarray]]:
        """Every whole object available (at least one), from one native drain per wake-up."""
        while not end.received:
            await self._drain_egress(end)
        out = list(end.received)
        end.received.clear()
        return out

    async def _drain_egress(self, end: RingEnd) -> None:
        """One native drain of an egress ring into pooled destinations; waits for a wake hint only when it found no
        whole object. The drain calls no Python per object: it stops only to have the pool refilled."""
        assert end.direction == "egress", "the daemon consumes only egress rings"
        end.raise_if_faulted()
        end.hint = trio.Event()
        got, batch, writable = len(end.received), end.batch, False
        while True:
            drain_batch(end.ring, end.state, end.spec, end.pool, batch)
            writable |= batch.writable
            if batch.loaded:
                landing = end.landing
                end.received.extend([(rec.object_id, rec.sequence, landing.popleft()) for rec in batch.records()])
                self._moved(end, "egress", batch.loaded_bytes)
            if batch.need is None:
                break
            _refill(end, batch.need.extent)
        if batch.end is not None and batch.end.kind != "closed":
            # the daemon found the fault itself: no wake hint will follow, so raise rather than wait
            end.fault = end.fault or RingFault(batch.end.code, batch.end.message)
        elif writable:
            await self._notify(end, RingWritable)
        if len(end.received) == got:
            end.raise_if_faulted()
            await end.hint.wait()

    async def _notify(self, end: RingEnd, hint: type[RingReadable | RingWritable]) -> None:
        await self._notify_message(end, hint(ring_id=end.ring_id))

    async def _notify_message(self, end: RingEnd, msg: WireMessage) -> None:
        try:
            await end.lane.notify(end.generation, msg)
        except GpuWorkerError as exc:
            end.fault = end.fault or RingFault("worker_process_exited", str(exc))
            raise end.fault from exc
