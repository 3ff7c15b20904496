"""Daemon side of the data plane: install rings on a lane, push objects into ingress rings, read
objects from egress rings, execute steps, release handles, pump files; crash fan-out.

Backpressure is the absence of ring space: a producer waits for the consumer's wake hint, it never
buffers. Wake hints are coalesced through the ring's wake bits (cython_ring does the atomics).
"""

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
    DeadlineExceeded,
    GpuWorkerError,
    ObjectFailed,
    RingFault,
    StaleHandle,
    StepFailed,
    WorkerError,
    native_errors,
)
from .._proto import Message
from ._arena import ArenaManager, NeverInstalled, Quiesced, Reaped
from ._lane import Lane
from ._ringend import RingEnd


class DataPlane:
    def __init__(self, lanes: dict[str, Lane], arena: ArenaManager, bus: Any) -> None:
        self.lanes = lanes
        self.arena = arena
        self.bus = bus
        self.ends: dict[int, RingEnd] = {}
        self.bytes_moved = {"ingress": 0, "egress": 0}  # payload bytes through rings, exported as a metric
        for lane in lanes.values():
            lane.hooks.append(self.on_lane_event)

    def _lane(self, lane_id: str) -> Lane:
        lane = self.lanes.get(lane_id)
        if lane is None:
            raise WorkerError("invalid_request", f"no lane {lane_id!r}")
        return lane

    # --- rings -----------------------------------------------------------------------------------

    async def install_ring(self, lane_id: str, *, direction: str, capacity: int, object_spec: dict[str, Any],
                           edge_id: str = "edge", port_id: str = "port", timeout: float | None = None) -> RingEnd:
        lane = self._lane(lane_id)
        with native_errors():
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
        # if the call fails because the worker died, the reaped-worker hook releases the lease
        reply = await lane.call("INSTALL_RING", {"ring_id": lease.ring_id, "edge_id": edge_id, "port_id": port_id,
                                                 "direction": direction, "layout": layout,
                                                 "object_spec": spec.to_wire()}, timeout=timeout)
        if reply.t == "RING_FAULT":
            self._release(end, Quiesced(lease.ring_id, pump_stopped=True))
            raise RingFault(reply["reason"], reply.get("msg", "the worker refused the ring"))
        return end

    async def uninstall_ring(self, end: RingEnd, reason: str = "edge_stopped", timeout: float | None = None) -> None:
        """Stop our pump, then UNINSTALL_RING; the lease is released on RING_QUIESCED (or when the worker is reaped)."""
        end.fault = end.fault or RingFault("worker_shutting_down", "ring uninstalled")
        end.hint.set()
        end.event_ready.set()
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
        reply = await end.lane.call("UNINSTALL_RING", fields, timeout=timeout)
        if reply.t == "RING_QUIESCED" and not end.released:
            self._release(end, Quiesced(end.ring_id, pump_stopped=True))

    def _release(self, end: RingEnd, proof: Any) -> None:
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
            with native_errors():
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
        with native_errors():
            records = buffer_records(objects, first_object_id, first_sequence, flags)
        i = 0
        while i < len(objects):
            end.raise_if_faulted()
            end.hint = trio.Event()
            with native_errors():
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
        with native_errors():
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

    # --- roles and steps -------------------------------------------------------------------------

    async def configure_role(self, lane_id: str, role_id: str, config: dict[str, Any]) -> None:
        reply = await self._lane(lane_id).call("CONFIGURE_ROLE", {"role_id": role_id, "config": config})
        if reply.t == "ROLE_FAILED":
            raise StepFailed(reply["reason"], reply.get("msg", "role refused"))

    async def execute_step(self, lane_id: str, role_id: str, step_id: int, inputs: list[dict[str, Any]],
                           outputs: list[dict[str, Any]], runtime: dict[str, Any] | None = None,
                           release_inputs_after: bool = False, timeout: float | None = None) -> list[dict[str, Any]]:
        """Run one step; returns the OBJECT_PRODUCED fields, one per output. The outputs' egress rings must be
        drained concurrently (pull) or a large output blocks the step on ring space."""
        lane = self._lane(lane_id)
        for binding in inputs:
            if binding["device_handle"]["worker_generation"] != lane.generation:
                raise StaleHandle(f"device handle {binding['device_handle']} is from another worker generation "
                                  f"(lane {lane_id} runs generation {lane.generation})")
        ends = [e for o in outputs if (e := self.ends.get(o["ring_id"])) is not None]
        for end in ends:
            end.steps += 1
        try:
            reply = await lane.call("EXECUTE_STEP", {"role_id": role_id, "step_id": step_id, "inputs": inputs,
                                                     "outputs": [{"flags": 0, **o} for o in outputs],
                                                     "runtime": runtime or {},
                                                     "release_inputs_after": release_inputs_after}, timeout=timeout)
        finally:
            for end in ends:
                end.steps -= 1
        if reply.t == "STEP_FAILED":
            raise StepFailed(reply["reason"], reply.get("msg", "step failed"))
        return [dict(m.fields) for m in reply.extras]

    async def release_handle(self, lane_id: str, handle: dict[str, int]) -> None:
        lane = self._lane(lane_id)
        if handle["worker_generation"] != lane.generation:
            raise StaleHandle(f"device handle {handle} is from another worker generation")
        reply = await lane.call("RELEASE_DEVICE_OBJECT", {"device_handle": handle})
        if reply.t == "RELEASE_FAILED":
            raise StepFailed(reply["reason"], reply.get("msg", "release failed"))

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
            end.event_ready.set()
            return
        if msg.t == "OBJECT_LOADED":  # the per-object form: a batch of one
            end.events.append(("loaded", msg["object_id"], msg["sequence"], msg["extent"], msg["device_handle"]["id"]))
            end.event_ready.set()
            return
        if msg.t == "RING_QUIESCED":  # the answer to an out-of-band UNINSTALL_RING
            with contextlib.suppress(ArenaError):  # a refused proof keeps the lease until the worker is reaped
                self._release(end, Quiesced(end.ring_id, pump_stopped=True))
            return
        if msg.t == "RING_FAULT":
            end.fault = RingFault(msg["reason"], msg.get("msg", ""))
            end.hint.set()
        end.events.append(msg)
        end.event_ready.set()

    def _generation_gone(self, lane: Lane, generation: int) -> None:
        """The worker is reaped: fault every ring it had, tell subscribers, release the leases."""
        pid, rc = lane.last_reaped
        for end in [e for e in self.ends.values() if e.lane is lane and e.generation == generation]:
            end.fault = end.fault or RingFault("worker_process_exited",
                                               f"worker of lane {lane.id} generation {generation} exited")
            end.hint.set()
            end.events.append(Message("RING_FAULT", {"ring_id": end.ring_id, "reason": "worker_process_exited"}))
            end.event_ready.set()
            self.bus.publish({"t": "RING_FAULT", "ring_id": end.ring_id, "reason": "worker_process_exited",
                              "lane_id": lane.id, "generation": generation, "synthetic": True})
            self._release(end, Reaped(pid, rc, pump_stopped=True))


def arena_env(arena: ArenaManager | None) -> tuple[dict[str, str], tuple[int, ...]]:
    if arena is None:
        return {}, ()
    return arena.env(), arena.pass_fds


__all__ = ["DataPlane", "ObjectFailed", "RingEnd", "RingFault", "StaleHandle", "StepFailed", "arena_env"]
