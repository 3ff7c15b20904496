"""Daemon side of the data plane: install rings on a lane, push objects into ingress rings, read
objects from egress rings, execute steps, release handles, pump files; crash fan-out.

Backpressure is the absence of ring space: a producer waits for the consumer's wake hint, it never
buffers. Wake hints are coalesced through the ring's wake bits (cython_ring does the atomics).
"""

from __future__ import annotations

import collections
import mmap
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import trio

from cython_ring import EgressState, IngressState, ObjectSpec, Ring, drain_ingress, write_egress

from .._errors import GpuWorkerError, WorkerError
from .._proto import Message
from ._arena import ArenaManager, Lease, NeverInstalled, Quiesced, Reaped
from ._lane import Lane


class RingFault(GpuWorkerError):
    """A ring is unusable; `code` is the RingFaultReason (worker_process_exited, header_malformed, ...)."""

    def __init__(self, code: str, msg: str) -> None:
        super().__init__(msg)
        self.code = code


class ObjectFailed(GpuWorkerError):
    """The worker refused an ingress object; `code` is the ObjectFailure name."""

    def __init__(self, code: str, msg: str) -> None:
        super().__init__(msg)
        self.code = code


class StepFailed(GpuWorkerError):
    def __init__(self, code: str, msg: str) -> None:
        super().__init__(msg)
        self.code = code


class StaleHandle(GpuWorkerError):
    code = "invalid_input_handle"


@dataclass(eq=False)
class RingEnd:
    """The daemon's end of one ring installed on one worker generation."""

    lane: Lane
    generation: int
    lease: Lease
    ring: Ring
    direction: str  # the worker's view: on an "ingress" ring the daemon produces
    spec: ObjectSpec
    edge_id: str
    port_id: str
    state: Any  # EgressState when the daemon produces, IngressState when it consumes
    hint: trio.Event = field(default_factory=trio.Event)
    fault: RingFault | None = None
    events: collections.deque[Message] = field(default_factory=collections.deque)  # OBJECT_LOADED / FAILED
    event_ready: trio.Event = field(default_factory=trio.Event)
    received: collections.deque[tuple[int, int, np.ndarray]] = field(default_factory=collections.deque)
    released: bool = False
    bytes_moved: int = 0

    @property
    def ring_id(self) -> int:
        return self.lease.ring_id

    def raise_if_faulted(self) -> None:
        if self.fault is not None:
            raise self.fault


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
        if end.released:
            return
        reply = await end.lane.call("UNINSTALL_RING", {"ring_id": end.ring_id, "reason": reason}, timeout=timeout)
        if reply.t == "RING_QUIESCED" and not end.released:
            self._release(end, Quiesced(end.ring_id, pump_stopped=True))

    def _release(self, end: RingEnd, proof: Any) -> None:
        if end.released:
            return
        end.ring.release()
        self.arena.release(end.lease, proof)  # raises (lease kept, not marked released) on a bad proof
        end.released = True
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
            end.bytes_moved += n
            self.bytes_moved["ingress"] += n
            if notify:
                await self._notify(end, "RING_READABLE")
            if not end.state.busy:
                return
            await end.hint.wait()  # RING_WRITABLE from the worker, or a fault

    async def next_event(self, end: RingEnd) -> Message:
        """The next OBJECT_LOADED (or OBJECT_FAILED / RING_FAULT, raised) for an ingress ring."""
        while not end.events:
            end.raise_if_faulted()
            end.event_ready = trio.Event()
            await end.event_ready.wait()
        msg = end.events.popleft()
        if msg.t == "OBJECT_FAILED":
            raise ObjectFailed(msg["reason"], msg.get("msg", ""))
        if msg.t == "RING_FAULT":
            raise RingFault(msg["reason"], msg.get("msg", ""))
        return msg

    async def load(self, end: RingEnd, data: Any, *, object_id: int, sequence: int, flags: int = 0) -> dict[str, Any]:
        """push + wait for its OBJECT_LOADED; returns the device handle."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: self.push(end, data, object_id=object_id, sequence=sequence, flags=flags))
            msg = await self.next_event(end)
        if msg["object_id"] != object_id:
            raise ObjectFailed("sequence_violation", f"loaded object {msg['object_id']}, expected {object_id}")
        return msg["device_handle"]

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
        assert end.direction == "egress", "the daemon consumes only egress rings"
        pending: dict[str, Any] = {}

        def resolve(object_id: int, sequence: int, extent: int) -> tuple[int, int]:
            pending["buf"] = buf = np.empty(max(extent, 1), dtype=np.uint8)
            return buf.ctypes.data, extent

        while not end.received:
            end.raise_if_faulted()
            end.hint = trio.Event()
            for ev in drain_ingress(end.ring, end.state, end.spec, resolve):
                if ev[0] == "loaded":
                    end.received.append((ev[1], ev[2], pending.pop("buf")[: ev[3]]))
                    end.bytes_moved += ev[3]
                    self.bytes_moved["egress"] += ev[3]
                elif ev[0] == "writable":
                    await self._notify(end, "RING_WRITABLE")
                elif ev[0] in ("failed", "ring_fault"):
                    end.fault = RingFault(ev[1], ev[2])
            if not end.received:
                await end.hint.wait()
        return end.received.popleft()

    async def _notify(self, end: RingEnd, t: str) -> None:
        try:
            await end.lane.notify(end.generation, t, {"ring_id": end.ring_id})
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
        reply = await lane.call("EXECUTE_STEP", {"role_id": role_id, "step_id": step_id, "inputs": inputs,
                                                 "outputs": [{"flags": 0, **o} for o in outputs],
                                                 "runtime": runtime or {},
                                                 "release_inputs_after": release_inputs_after}, timeout=timeout)
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
