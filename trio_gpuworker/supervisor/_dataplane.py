"""Daemon side of the data plane: install rings on a lane, push objects into ingress rings, read objects from
egress rings, pump files; crash fan-out (roles, steps and handles: _steps.py). Backpressure is the absence of ring
space: a producer waits for the consumer's wake hint, it never buffers. Wake hints are coalesced through the
ring's wake bits (cython_ring does the atomics)."""

from __future__ import annotations

import contextlib
import math
import mmap
import os
from pathlib import Path
from typing import Any

import numpy as np
import trio

from cython_ring import (
    EgressState,
    IngressState,
    ObjectSpec,
    buffer_records,
    drain_ingress,
    write_egress,
    write_egress_batch,
)

from .._errors import (
    ArenaError,
    BrokenWorkerError,
    DeadlineExceeded,
    GpuWorkerError,
    ObjectFailed,
    RingFault,
    WorkerError,
)
from .._proto import Message
from ._arena import ArenaManager, NeverInstalled, Quiesced, Reaped
from ._lane import Lane
from ._ringend import RingEnd
from ._steps import Steps

STALL_BYTES = 64  # less free space than this in an egress ring: a producer is waiting for its consumer


class DataPlane:
    def __init__(self, lanes: dict[str, Lane], arena: ArenaManager, bus: Any) -> None:
        self.lanes, self.arena, self.bus = lanes, arena, bus
        self.ends: dict[int, RingEnd] = {}
        self.bytes_moved = {"ingress": 0, "egress": 0}  # payload bytes through rings, exported as a metric
        self._nursery: trio.Nursery | None = None
        self.steps = Steps()
        for lane in lanes.values():
            self.attach(lane)

    def attach(self, lane: Lane) -> None:
        """Follow a lane's worker events and reaps, and tell it when a step of its waits on an unpulled ring."""
        lane.hooks.append(self.on_lane_event)
        lane.step_waits.append(lambda: self._step_waits_on_us(lane))

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Background work of the data plane: uninstalling rings whose installer gave up waiting."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            await trio.sleep_forever()

    def _step_waits_on_us(self, lane: Lane) -> bool:
        """A step of `lane` is blocked on one of its egress rings because nobody pulls it: no hang of its own."""
        return any(e.lane is lane and e.steps and not e.released and e.ring.writable < STALL_BYTES
                   for e in self.ends.values())

    def _lane(self, lane_id: str) -> Lane:
        lane = self.lanes.get(lane_id)
        if lane is None:
            raise WorkerError("invalid_request", f"no lane {lane_id!r}")
        return lane

    # --- rings -----------------------------------------------------------------------------------

    async def install_ring(self, lane_id: str, *, direction: str, capacity: int, object_spec: dict[str, Any],
                           edge_id: str = "edge", port_id: str = "port", timeout: float | None = None) -> RingEnd:
        lane = self._lane(lane_id)
        spec = ObjectSpec.from_wire(object_spec)
        lease = await self.arena.lease(capacity)
        ring = self.arena.init_ring(lease)
        generation, pid = lane.generation, lane.pid
        if pid is None:
            ring.release()
            self.arena.release(lease, NeverInstalled(lease.ring_id))
            raise RingFault("worker_process_exited", f"lane {lane_id} has no running worker")
        self.arena.mark_installed(lease, pid)
        end = RingEnd(lane, generation, lease, ring, direction, spec, edge_id, port_id,
                      EgressState(spec) if direction == "ingress" else IngressState())
        self.ends[lease.ring_id] = end
        layout = {"offset": lease.offset, "header_len": 128, "capacity": lease.capacity}
        waiting, early = [True], []

        def answered(reply: Message | None, error: BaseException | None) -> None:
            if waiting[0]:  # its caller may be leaving right now (see DeadlineExceeded below)
                return early.append((reply, error))
            self._orphan_answered(end, reply, error)

        try:
            # if the worker dies meanwhile, the reaped-worker hook releases the lease
            reply = await lane.call("INSTALL_RING", {"ring_id": lease.ring_id, "edge_id": edge_id,
                                                     "port_id": port_id, "direction": direction, "layout": layout,
                                                     "object_spec": spec.to_wire()}, timeout=timeout,
                                    on_result=answered, generation=generation)
        except DeadlineExceeded:
            waiting[0] = False
            for answer in early:  # settled as its caller left (dropped from the queue): undo it now
                self._orphan_answered(end, *answer)
            raise
        except BrokenWorkerError as exc:  # its worker ended first: the reaped-worker hook released the lease
            raise RingFault("worker_process_exited", str(exc)) from exc
        except WorkerError as exc:  # ERR: the worker refused it, nothing was installed
            self._release(end, Quiesced(lease.ring_id, pump_stopped=True), RingFault(exc.code, exc.message))
            raise
        if reply.t == "RING_FAULT":
            fault = RingFault(reply["reason"], reply.get("msg", "the worker refused the ring"))
            self._release(end, Quiesced(lease.ring_id, pump_stopped=True), fault)
            raise fault
        return end

    def _orphan_answered(self, end: RingEnd, reply: Message | None, error: BaseException | None) -> None:
        """Its installer gave up waiting: an installed ring is uninstalled, a refused one released at once (if its
        worker died instead, the reaped-worker hook releases it)."""
        if end.released:
            return
        if reply is not None and reply.t == "RING_INSTALLED":
            if self._nursery is not None:
                self._nursery.start_soon(self._uninstall_quietly, end)
        elif reply is not None or error is None or isinstance(error, WorkerError):  # refused, or never sent
            self._release(end, Quiesced(end.ring_id, pump_stopped=True),
                          RingFault("worker_internal", "the ring was refused or never sent: its installer left"))

    async def _uninstall_quietly(self, end: RingEnd) -> None:
        with contextlib.suppress(GpuWorkerError):
            await self.uninstall_ring(end, timeout=end.lane.windows.control_s)

    async def uninstall_ring(self, end: RingEnd, reason: str = "edge_stopped", timeout: float | None = None) -> None:
        """Stop our pump, then UNINSTALL_RING; the lease is released on RING_QUIESCED (or when the worker is reaped)."""
        end.fail(RingFault("worker_shutting_down", "ring uninstalled"))
        if end.released:
            return
        fields = {"ring_id": end.ring_id, "reason": reason}
        if end.steps:
            # a step blocked on this ring's space holds the lane: the notification form reaches the worker
            # past it, the step fails invalid_output_ring, and RING_QUIESCED comes back without req_id
            await self._notify_fields(end, "UNINSTALL_RING", fields)
            with trio.move_on_after(math.inf if timeout is None else timeout):
                await end.quiesced.wait()
            if not end.released:
                raise DeadlineExceeded(f"ring {end.ring_id} was not quiesced within {timeout:g} s")
            return
        reply = await end.lane.call("UNINSTALL_RING", fields, timeout=timeout, generation=end.generation)
        if reply.t == "RING_QUIESCED" and not end.released:
            self._release(end, Quiesced(end.ring_id, pump_stopped=True), end.fault)

    def _release(self, end: RingEnd, proof: Any, fault: RingFault) -> None:
        """The ring is gone on the worker's side: every waiter wakes with a typed RingFault, and so does any later
        push, pull or load on it; then the lease is released on the proof."""
        end.fail(fault)
        if end.released:
            return
        end.ring.release()
        self.arena.release(end.lease, proof)  # raises (lease kept, not marked released) on a bad proof
        end.released = True
        end.quiesced.set()
        self.ends.pop(end.ring_id, None)

    # --- producing into an ingress ring -------------------------------------------------------------

    async def push(self, end: RingEnd, data: Any, *, object_id: int, sequence: int, flags: int = 0) -> None:
        """Write one object (header + every payload byte) into an ingress ring, waiting for space."""
        assert end.direction == "ingress", "the daemon produces only into ingress rings"
        src = np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8) if not isinstance(data, np.ndarray) else \
            np.ascontiguousarray(data).view(np.uint8).reshape(-1)
        extent = src.size
        addr = src.ctypes.data if extent else 0
        while True:
            end.raise_if_faulted()
            end.hint = trio.Event()
            n, notify = write_egress(end.ring, end.state, object_id, sequence, addr, extent, flags)
            self._moved(end, "ingress", n)
            if notify:
                await self._notify(end, "RING_READABLE")
            if not end.state.busy:
                return
            await end.hint.wait()  # RING_WRITABLE from the worker, or a fault

    async def push_many(self, end: RingEnd, objects: list[Any], *, first_object_id: int, first_sequence: int,
                        flags: int = 0) -> None:
        """Write many objects (consecutive ids and sequences) into an ingress ring: each burst is one native call
        that writes every record that fits, with one wake hint; ring space is the only backpressure. The
        buffers must stay alive and unchanged until this returns (it holds `objects`)."""
        assert end.direction == "ingress", "the daemon produces only into ingress rings"
        records = buffer_records(objects, first_object_id, first_sequence, flags)
        i = 0
        while i < len(objects):
            end.raise_if_faulted()
            end.hint = trio.Event()
            i, n, notify = write_egress_batch(end.ring, end.state, records, i)
            self._moved(end, "ingress", n)
            if notify:
                await self._notify(end, "RING_READABLE")
            if i < len(objects) and not n:
                await end.hint.wait()

    def _moved(self, end: RingEnd, direction: str, n: int) -> None:
        end.bytes_moved += n
        self.bytes_moved[direction] += n

    async def next_event(self, end: RingEnd) -> Message:
        """The next OBJECT_LOADED (or OBJECT_FAILED / RING_FAULT, raised) for an ingress ring."""
        row = await self._next_row(end)
        return Message("OBJECT_LOADED", {"ring_id": end.ring_id, "edge_id": end.edge_id, "port_id": end.port_id,
                                         "object_id": row[1], "sequence": row[2], "extent": row[3],
                                         "device_handle": {"worker_generation": end.generation, "id": row[4]}})

    async def _next_row(self, end: RingEnd) -> tuple[str, int, int, int, int]:
        while not end.events:
            end.raise_if_faulted()
            end.event_ready = trio.Event()
            await end.event_ready.wait()
        ev = end.events.popleft()
        if isinstance(ev, tuple):
            return ev
        if ev.t == "OBJECT_FAILED":
            raise ObjectFailed(ev["reason"], ev.get("msg", ""))
        raise RingFault(ev["reason"], ev.get("msg", ""))

    async def load(self, end: RingEnd, data: Any, *, object_id: int, sequence: int, flags: int = 0) -> dict[str, Any]:
        """push + wait for its OBJECT_LOADED; returns the device handle."""
        end.raise_if_faulted()  # one typed error (else the push and the wait would each raise it)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: self.push(end, data, object_id=object_id, sequence=sequence, flags=flags))
            msg = await self.next_event(end)
        if msg["object_id"] != object_id:
            raise ObjectFailed("sequence_violation", f"loaded object {msg['object_id']}, expected {object_id}")
        return msg["device_handle"]

    async def load_many(self, end: RingEnd, objects: list[Any], *, first_object_id: int, first_sequence: int,
                        flags: int = 0) -> list[dict[str, int]]:
        """push_many + wait until every object is loaded; returns their device handles, in order. Completions
        arrive in batches (one OBJECTS_LOADED per worker drain), so many callers wake from one message."""
        handles: list[dict[str, int]] = []
        end.raise_if_faulted()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: self.push_many(end, objects, first_object_id=first_object_id,
                                                      first_sequence=first_sequence, flags=flags))
            gen = end.generation
            for k in range(len(objects)):
                row = await self._next_row(end)
                if row[1] != first_object_id + k:
                    raise ObjectFailed("sequence_violation", f"loaded object {row[1]}, "
                                                             f"expected {first_object_id + k}")
                handles.append({"worker_generation": gen, "id": row[4]})
        return handles

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
        """One native drain of an egress ring; waits for a wake hint only when it found no whole object."""
        assert end.direction == "egress", "the daemon consumes only egress rings"
        end.raise_if_faulted()
        end.hint = trio.Event()
        landing = end.landing

        def resolve(object_id: int, sequence: int, extent: int) -> tuple[int, int]:
            buf = np.empty(max(extent, 1), dtype=np.uint8)
            landing.append(buf)
            return buf.ctypes.data, extent

        got = len(end.received)
        events = drain_ingress(end.ring, end.state, end.spec, resolve)
        for ev in events:
            if ev[0] == "loaded":
                end.received.append((ev[1], ev[2], landing.popleft()[: ev[3]]))
                self._moved(end, "egress", ev[3])
            elif ev[0] == "writable":
                await self._notify(end, "RING_WRITABLE")
            elif ev[0] in ("failed", "ring_fault"):
                # the daemon found the fault itself: no wake hint will follow, so raise rather than wait
                end.fault = end.fault or RingFault(ev[1], ev[2])
        if len(end.received) == got:
            end.raise_if_faulted()
            await end.hint.wait()

    async def _notify(self, end: RingEnd, t: str) -> None:
        await self._notify_fields(end, t, {"ring_id": end.ring_id})

    async def _notify_fields(self, end: RingEnd, t: str, fields: dict[str, Any]) -> None:
        try:
            await end.lane.notify(end.generation, t, fields)
        except GpuWorkerError as exc:
            end.fault = end.fault or RingFault("worker_process_exited", str(exc))
            raise end.fault from exc

    # --- roles and steps (_steps.Steps) -----------------------------------------------------------

    async def configure_role(self, lane_id: str, role_id: str, config: dict[str, Any]) -> None:
        await self.steps.configure_role(self._lane(lane_id), role_id, config)

    async def execute_step(self, lane_id: str, role_id: str, step_id: int, inputs: list[dict[str, Any]],
                           outputs: list[dict[str, Any]], runtime: dict[str, Any] | None = None,
                           release_inputs_after: bool = False, timeout: float | None = None) -> list[dict[str, Any]]:
        """Run one step; returns the OBJECT_PRODUCED fields, one per output. The outputs' egress rings must be
        drained concurrently (pull) or a large output blocks the step on ring space."""
        ends = [e for o in outputs if (e := self.ends.get(o["ring_id"])) is not None]
        return await self.steps.execute(self._lane(lane_id), role_id, step_id, inputs, outputs, ends,
                                        runtime=runtime, release_inputs_after=release_inputs_after, timeout=timeout)

    async def release_handle(self, lane_id: str, handle: dict[str, int]) -> None:
        await self.steps.release(self._lane(lane_id), handle)

    # --- events from lanes -----------------------------------------------------------------------

    def on_lane_event(self, lane: Lane, generation: int, msg: Message | None) -> None:
        if msg is None:
            self._generation_gone(lane, generation)
            return
        end = self.ends.get(msg.get("ring_id", -1))
        if end is None or end.lane is not lane or end.generation != generation:
            return
        if msg.t in ("RING_READABLE", "RING_WRITABLE"):
            end.hint.set()
            return
        if msg.t == "OBJECTS_LOADED":
            end.events.extend(("loaded", *row) for row in msg["objects"])
            self.steps.handles.minted(lane, generation, (row[3] for row in msg["objects"]))
            end.event_ready.set()
            return
        if msg.t == "OBJECT_LOADED":  # the per-object form: a batch of one
            handle_id = msg["device_handle"]["id"]
            end.events.append(("loaded", msg["object_id"], msg["sequence"], msg["extent"], handle_id))
            self.steps.handles.minted(lane, generation, (handle_id,))
            end.event_ready.set()
            return
        if msg.t == "RING_QUIESCED":  # an out-of-band UNINSTALL_RING's answer, or its worker stopping in order
            with contextlib.suppress(ArenaError):  # a refused proof keeps the lease until the worker is reaped
                self._release(end, Quiesced(end.ring_id, pump_stopped=True),
                              RingFault("worker_shutting_down", f"ring {end.ring_id} was quiesced"))
            return
        if msg.t == "RING_FAULT":
            end.fail(RingFault(msg["reason"], msg.get("msg", "")))
        end.events.append(msg)
        end.event_ready.set()

    def _generation_gone(self, lane: Lane, generation: int) -> None:
        """The worker is reaped: its handles are void; fault every ring it had, tell subscribers, release leases."""
        self.steps.handles.generation_gone(lane, generation)
        pid, rc, gone = *lane.last_reaped, f"worker of lane {lane.id} generation {generation} exited"
        for end in [e for e in self.ends.values() if e.lane is lane and e.generation == generation]:
            fault = {"ring_id": end.ring_id, "edge_id": end.edge_id, "port_id": end.port_id,
                     "reason": "worker_process_exited"}
            end.events.append(Message("RING_FAULT", fault))
            self.bus.publish({"t": "RING_FAULT", **fault, "lane_id": lane.id, "generation": generation,
                              "synthetic": True})
            self._release(end, Reaped(pid, rc, pump_stopped=True), RingFault("worker_process_exited", gone))


__all__ = ["DataPlane", "ObjectFailed", "RingEnd", "RingFault"]
