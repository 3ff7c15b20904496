"""Worker ingress: one native drain per wake hint, and completions batched per drain (OBJECTS_LOADED). On CPU
the drain takes device allocations from a per-ring pool refilled between calls and writes its completions into a
native batch, so this module's Python runs once per drain call; elsewhere a resolver stages each object. Also the
per-ring slot and device-object records."""

from __future__ import annotations

import collections
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from operator import itemgetter
from typing import Any

import numpy as np
import trio

from cython_ring import Completions, DestPool, ObjectSpec, Ring, RingCorrupt, drain_batch, drain_ingress

from .._errors import CodedError
from .._proto import (  # HANDLE_ID, OBJECT_ID, SEQUENCE: the columns of a LoadedRow kept as a list
    HANDLE_ID,
    OBJECT_ID,
    SEQUENCE,
    LoadedBlock,
    ObjectFailed,
    ObjectsLoaded,
    RingFault,
    RingWritable,
    WireMessage,
)
from ._objects import DeviceObject, DeviceObjects, LoadedRun

# ObjectFailure codes that also leave the ring unusable, mapped to RingFaultReason names
# objects per native drain call: a long burst goes back in parts, so the daemon resolves (and refills the
# ring) while the rest is drained (512 4 KiB objects: a daemon burst's worth on an 8 MiB ring)
DRAIN_CHUNK = 512
# chunks one compute-thread call drains while the ring stays full: each chunk's completions are posted as it ends
# (the event loop writes them while the next chunk drains), so a burst pays one thread hand-off, not one a chunk;
# then the call returns and other work on the compute thread gets its turn
DRAIN_CALL_CHUNKS = 8
# A CPU drain runs on the event loop itself while the compute thread is idle (WorkerServer._drainer): no thread
# hand-off each way (4 KiB ingress about 1.2x, bench/ring.py). It holds the loop, so it is kept short: only rings of
# at most this many bytes, and it stops, with more to do, once it has copied this many (a producer refilling the ring
# as fast as it drains would otherwise hold the loop for a whole chunk of objects).
LOOP_DRAIN_BYTES = 8 << 20
# queues one control message for the control socket: WorkerServer.post
Emit = Callable[[WireMessage], None]
STREAM_WINDOW = 4 << 20  # bytes of host memory a large ingress object streams through off CPU
_RING_REASON = {"sequence_violation": "sequence_violation", "device_allocation_failed": "device_out_of_memory",
                "device_copy_failed": "device_copy_failed"}


@dataclass
class RingSlot:
    ring_id: int
    edge_id: str
    port_id: str
    direction: str
    spec: ObjectSpec
    ring: Ring
    state: Any  # IngressState | EgressState
    writable: trio.Event = field(default_factory=trio.Event)  # RING_WRITABLE: a step waiting for space goes on
    # allocations handed to the resolver drain (not CPU), oldest first: one drain call may start and finish several
    # objects before its events are read. Each is (device allocation, host staging or None for a streamed object).
    pending: collections.deque[tuple[Any, np.ndarray | None]] = field(default_factory=collections.deque)
    shapes: dict[int, tuple[int, ...]] = field(default_factory=dict)  # extent -> shape, a bounded cache
    more: bool = False  # the last drain stopped at DRAIN_CHUNK objects: drain again without a hint
    window: np.ndarray | None = None  # the host window large objects stream through on non-CPU devices
    closed: bool = False  # uninstalled (or the worker is stopping): a step writing to it gives up
    close_reason: str = "invalid_output_ring"  # the StepFailure of a step that finds it closed
    faulted: bool = False  # the worker faulted it (a device copy failed): later drains report nothing
    # CPU: the destinations the drain takes, oldest first
    pool: DestPool = field(default_factory=lambda: DestPool(exact=True))
    dests: list[Any] = field(default_factory=list)  # CPU: the buffers behind the pool's destinations, in order
    dest_bytes: int = 0  # ... each of this size
    batch: Completions = field(default_factory=Completions)  # the drain's completion records, reused
    block: bool = False  # installed with loaded_block: completions go as LOADED_BLOCK (extension), not CBOR rows


def _committed(ring: Ring) -> bool:
    """Whether committed bytes wait in the ring; corrupt cursors say yes, so the next drain reports the fault."""
    try:
        return bool(ring.readable)
    except RingCorrupt:
        return True


class DataPlaneError(CodedError):
    """A step failed; `code` is the StepFailure name."""


def shape_for(spec: ObjectSpec, extent: int) -> tuple[int, ...]:
    """The spec's shape; an empty shape means 1-D of whatever length the extent implies."""
    item = np.dtype(spec.dtype).itemsize
    shape = tuple(int(d) for d in spec.shape) or (-1,)
    known = math.prod(d for d in shape if d != -1)
    if shape.count(-1) == 1 and known and extent % (known * item) == 0:
        shape = tuple(extent // (known * item) if d == -1 else d for d in shape)
    if math.prod(shape) * item != extent:
        raise DataPlaneError("header_malformed", f"extent {extent} does not fit shape {spec.shape} of {spec.dtype}")
    return shape



class IngressPlane:
    """The ingress half of WorkerDataPlane (a mixin: the plane holds the rings, objects and bridge)."""

    generation: int
    rings: dict[int, RingSlot]
    objects: DeviceObjects
    stream_window: int
    _next_handle: int
    bridge: Any
    _bridge: Any  # the bridge once made (None before): `bridge` makes it
    emit: Emit  # thread-safe: queues a message for the control socket

    def more(self, ring_id: int) -> bool:
        """Whether the last drain of this ring stopped early with objects possibly left to drain."""
        slot = self.rings.get(ring_id)
        return slot is not None and slot.more

    @property
    def host_bridge(self) -> bool:
        """The bridge exists and its memory is host memory (CPU): work on its buffers needs no device call, so the
        event loop may do it. Asking never makes the bridge: that opens tinygrad's device, which belongs on the
        compute thread."""
        return self._bridge is not None and self._bridge.direct

    def drains_on_loop(self, ring_id: int) -> bool:
        """Whether this ring's drain may run on the event loop (when the compute thread is idle): a host bridge
        (the drain is native copies into pooled host buffers) and a small ring."""
        slot = self.rings.get(ring_id)
        return slot is not None and self.host_bridge and slot.ring.capacity <= LOOP_DRAIN_BYTES

    def drain(self, ring_id: int, on_loop: bool = False) -> list[WireMessage] | None:
        """RING_READABLE: one native drain of an ingress ring (compute thread; `on_loop`: on the event loop, one
        chunk of at most about LOOP_DRAIN_BYTES). None once the ring is gone."""
        slot = self.rings.get(ring_id)
        if slot is None:
            return None
        if slot.direction != "ingress" or slot.faulted:
            return []
        if on_loop:
            return self._drain_pooled(slot, LOOP_DRAIN_BYTES)
        for _ in range(DRAIN_CALL_CHUNKS - 1):
            notices = self._drain(slot)
            if not slot.more or slot.faulted:
                return notices
            for notice in notices:  # a full chunk: its completions go out now, while the next one drains
                self.emit(notice)
        return self._drain(slot)

    def _drain(self, slot: RingSlot) -> list[WireMessage]:
        return self._drain_pooled(slot) if self.bridge.direct else self._drain_staged(slot)

    def _drain_pooled(self, slot: RingSlot, budget: int | None = None) -> list[WireMessage]:
        """Host-addressable device memory (CPU): the drain copies straight into pooled allocations. Each native
        call runs until the ring is empty, the chunk is full or the pool has nothing of the next object's size;
        then the pool is refilled for that size and the drain goes on, unless it has copied `budget` bytes."""
        out: list[WireMessage] = []
        parts: list[Any] = []  # per native call: its OBJECTS_LOADED rows, or its LOADED_BLOCK bytes
        batch, pool, failed = slot.batch, slot.pool, None
        writable, loaded, copied, spent = False, 0, 0, False
        while True:
            drain_batch(slot.ring, slot.state, slot.spec, pool, batch, DRAIN_CHUNK - loaded)
            writable |= batch.writable
            if batch.loaded:
                loaded += batch.loaded
                copied += batch.loaded_bytes
                parts.append(self._loaded_batch(slot, batch))
            need = batch.need
            if need is None or batch.more or loaded == DRAIN_CHUNK:
                break
            if budget is not None and copied >= budget:
                spent = True  # the next object waits for the pool: the drainer comes back for it
                break
            failed = self._refill(slot, need.extent)
            if failed is not None:
                break
        # committed objects may be left, and no hint will come for them
        slot.more = loaded == DRAIN_CHUNK or spent
        ids = {"ring_id": slot.ring_id, "edge_id": slot.edge_id, "port_id": slot.port_id}
        end = batch.end
        if loaded:
            self.bridge.synchronize()  # nothing is compute-visible before every copy completed
            out.append(self._loaded_notice(slot, [], b"".join(parts)) if slot.block else
                       self._loaded_notice(slot, [row for part in parts for row in part]))
        if failed is not None:  # no memory for the next object: the stream cannot go on past it
            assert need is not None
            self._drop_pending(slot)
            slot.ring.fault()
            slot.faulted = True
            text = f"object {need.object_id} seq {need.sequence}: {type(failed).__name__}: {failed}"
            out.append(ObjectFailed(**ids, reason="device_allocation_failed", msg=text, object_id=need.object_id,
                                    sequence=need.sequence))
            out.append(RingFault(**ids, reason=_RING_REASON["device_allocation_failed"], msg=text))
        elif end is not None and end.kind != "closed":
            self._drop_pending(slot)
            if end.kind == "failed":
                out.append(ObjectFailed(**ids, reason=end.code, msg=end.message, object_id=end.object_id,
                                        sequence=end.sequence))
            if end.kind == "ring_fault" or end.code != "eof_mid_object":
                out.append(RingFault(**ids, msg=end.message, reason=end.code if end.kind == "ring_fault"
                                     else _RING_REASON.get(end.code, "header_malformed")))
        elif loaded and not slot.more:
            # A producer short of space hears RING_WRITABLE now, not after this call's return and the loop's send;
            # then one more look: what it committed meanwhile is drained at once, without waiting for its hint.
            # (The READABLE bit is not touched: a commit after the drain's clear has set it and sent a hint.)
            if writable:
                self.emit(RingWritable(ring_id=slot.ring_id))
            slot.more = _committed(slot.ring)
        elif writable:
            out.append(RingWritable(ring_id=slot.ring_id))
        return out

    def _refill(self, slot: RingSlot, extent: int) -> BaseException | None:
        """Give the pool allocations of `extent` bytes for the object waiting on it and those after it: about as
        many as the ring holds at once (one for an object larger than the ring), since objects of a ring mostly
        share an extent. Free ones of another size go back first. Returns the error when not even one fits."""
        from ._bridge import DeviceError

        pool = slot.pool
        if pool.next_size is not None and pool.next_size != extent:  # (no object is half-copied when one waits)
            for _ in range(pool.clear()):
                self.bridge.free_device(self.bridge.adopt(slot.dest_bytes, slot.dests.pop()))
        want = max(1, min(DRAIN_CHUNK, slot.ring.capacity // (extent + 40) + 1) - len(pool))
        # (the bridge hands out recycled buffers only while it holds any: topping each refill up with fresh ones
        # would allocate a few every lap, at ~20 us each, until the pool had grown a chunk's worth of slack)
        try:
            buffers, addresses = self.bridge.alloc_mapped_many(extent, want)
        except DeviceError as exc:
            try:
                buffers, addresses = self.bridge.alloc_mapped_many(extent, 1)  # the one it waits for, at least
            except DeviceError:
                return exc
        slot.dests += buffers
        slot.dest_bytes = extent
        pool.put_many(addresses, extent)
        return None

    def _loaded_notice(self, slot: RingSlot, rows: list[list[int]], block: bytes | None = None
                       ) -> ObjectsLoaded | LoadedBlock:
        """The message reporting `rows`: LOADED_BLOCK with `block` (the rows as little-endian u64s) on a ring
        installed with loaded_block, else OBJECTS_LOADED."""
        if not slot.block:
            return ObjectsLoaded(ring_id=slot.ring_id, edge_id=slot.edge_id, port_id=slot.port_id,
                                 worker_generation=self.generation, objects=rows)
        return LoadedBlock(ring_id=slot.ring_id, edge_id=slot.edge_id, port_id=slot.port_id,
                           worker_generation=self.generation,
                           raw=block if block is not None else np.asarray(rows, "<u8").tobytes())

    def _loaded_batch(self, slot: RingSlot, batch: Completions) -> list[list[int]] | bytes:
        """The batch's completions (LOADED_BLOCK bytes on a ring installed with loaded_block, else OBJECTS_LOADED's
        rows). Its objects go into `objects` as one run over their pooled buffers: each one's record and
        allocation are made when a step or a release first reads it, so no Python runs per object here."""
        n, dests = batch.loaded, slot.dests
        first, self._next_handle = self._next_handle, self._next_handle + n
        out: list[list[int]] | bytes
        if slot.block:
            out = batch.block(first)
            object_ids = np.frombuffer(out, "<u8")[OBJECT_ID::4].tolist()
        else:
            out = batch.rows(first)
            object_ids = list(map(itemgetter(OBJECT_ID), out))
        self.objects.add_run(LoadedRun(first, dests[:n], object_ids, slot.dest_bytes, slot.spec.dtype,
                                       self._shape(slot, slot.dest_bytes), slot.ring_id, self.bridge.adopt))
        del dests[:n]
        return out

    def _drain_staged(self, slot: RingSlot) -> list[WireMessage]:
        """Every object this burst finished goes into one OBJECTS_LOADED (stream order), ahead of any failure."""
        from ._bridge import DeviceError

        out: list[WireMessage] = []
        loaded: list[list[int]] = []
        rid = slot.ring_id
        ids = {"ring_id": rid, "edge_id": slot.edge_id, "port_id": slot.port_id}
        events = drain_ingress(slot.ring, slot.state, slot.spec, lambda o, s, n: self._resolve(slot, n),
                               lambda off, n: self._flush_window(slot, off, n), DRAIN_CHUNK)
        # a full chunk may have left committed objects behind, and no hint will come for them
        slot.more = sum(1 for ev in events if ev[0] == "loaded") == DRAIN_CHUNK
        copying: tuple[int, int] | None = None  # the object whose device copy is running
        try:
            # drain_ingress's events, by their first item (cython_ring/_stream.pyx): ("loaded", object_id,
            # sequence, extent, flags), ("failed", code, text, object_id, sequence), ("ring_fault", code, text),
            # ("writable",); the others ("header", "closed") need nothing here
            for ev in events:
                kind = ev[0]
                if kind == "loaded":
                    _, object_id, sequence, extent, _flags = ev
                    copying = (object_id, sequence)
                    loaded.append(self._loaded(slot, object_id, sequence, extent))
                    copying = None
                elif kind == "failed":
                    _, code, text, object_id, sequence = ev
                    self._drop_pending(slot)
                    self._flush(slot, loaded, out)
                    out.append(ObjectFailed(**ids, reason=code, msg=text, object_id=object_id, sequence=sequence))
                    if code != "eof_mid_object":
                        out.append(RingFault(**ids, msg=text, reason=_RING_REASON.get(code, "header_malformed")))
                elif kind == "ring_fault":
                    self._drop_pending(slot)
                    self._flush(slot, loaded, out)
                    _, code, text = ev
                    out.append(RingFault(**ids, reason=code, msg=text))
                elif kind == "writable":
                    self._flush(slot, loaded, out)
                    out.append(RingWritable(ring_id=rid))
            self._flush(slot, loaded, out)
        except DeviceError as exc:
            # the failed object's bytes left the ring but never reached the device: the stream cannot go on
            self._drop_pending(slot)
            if copying is not None:  # its own copy failed; the objects before it were copied synchronously
                failed = {"object_id": copying[0], "sequence": copying[1]}
            else:  # the synchronize before reporting failed: none of these objects is known to be complete
                failed = {"object_id": loaded[0][OBJECT_ID], "sequence": loaded[0][SEQUENCE]} if loaded else {}
                for row in loaded:
                    self.bridge.free_device(self.objects.pop(row[HANDLE_ID]).alloc)
                loaded.clear()
            slot.ring.fault()
            slot.faulted = True
            self._flush(slot, loaded, out, synchronize=False)
            out = [m for m in out if not isinstance(m, RingWritable)]
            text = str(exc)
            out.append(ObjectFailed(**ids, reason="device_copy_failed", msg=text, **failed))
            out.append(RingFault(**ids, reason="device_copy_failed", msg=text))
        return out

    def _flush(self, slot: RingSlot, loaded: list[list[int]], out: list[WireMessage],
               synchronize: bool = True) -> None:
        if loaded:
            if synchronize:
                self.bridge.synchronize()  # nothing is compute-visible before every copy completed
            out.append(self._loaded_notice(slot, loaded[:]))
            loaded.clear()

    def _resolve(self, slot: RingSlot, extent: int) -> tuple[int, int]:
        alloc = self.bridge.alloc_device(extent)
        if extent > self.stream_window:
            # a device without host-addressable memory: the object streams through one bounded host window,
            # copied into the device buffer as it fills (_flush_window), so it never needs its own size in RAM
            if slot.window is None:
                slot.window = np.empty(self.stream_window, dtype=np.uint8)
            slot.pending.append((alloc, None))
            return slot.window.ctypes.data, slot.window.nbytes
        staging = np.empty(max(extent, 1), dtype=np.uint8)
        slot.pending.append((alloc, staging))
        return staging.ctypes.data, extent

    def _flush_window(self, slot: RingSlot, offset: int, n: int) -> None:
        assert slot.window is not None
        self.bridge.host_to_device(slot.pending[-1][0], offset, memoryview(slot.window)[:n], n)

    def _loaded(self, slot: RingSlot, object_id: int, sequence: int, extent: int) -> list[int]:
        """The LoadedRow, as a list, of an object whose every byte is on the device."""
        alloc, staging = slot.pending[0]
        if staging is not None:
            self.bridge.host_to_device(alloc, 0, memoryview(staging), extent)
        slot.pending.popleft()
        handle_id, self._next_handle = self._next_handle, self._next_handle + 1
        self.objects[handle_id] = DeviceObject(alloc, slot.spec.dtype, self._shape(slot, extent), slot.ring_id,
                                               object_id)
        return [object_id, sequence, extent, handle_id]

    @staticmethod
    def _shape(slot: RingSlot, extent: int) -> tuple[int, ...]:
        shape = slot.shapes.get(extent)
        if shape is None:  # objects of a ring mostly share one extent: work the shape out once per extent
            try:
                shape = shape_for(slot.spec, extent)
            except DataPlaneError:
                shape = (extent // np.dtype(slot.spec.dtype).itemsize,)
            if len(slot.shapes) < 64:
                slot.shapes[extent] = shape
        return shape

    def _drop_dests(self, slot: RingSlot) -> None:
        """The pool's destinations not used go back to the bridge."""
        slot.pool.clear()
        while slot.dests:
            self.bridge.free_device(self.bridge.adopt(slot.dest_bytes, slot.dests.pop()))

    def _drop_pending(self, slot: RingSlot) -> None:
        self._drop_dests(slot)
        while slot.pending:
            self.bridge.free_device(slot.pending.popleft()[0])
