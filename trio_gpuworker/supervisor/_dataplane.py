"""Daemon side of the data plane: install rings on a lane, push objects into ingress rings, read objects from
egress rings, pump files (the byte moves: _ringio.py); crash fan-out (roles, steps and handles: _steps.py).
Backpressure is the absence of ring space: a producer waits for the consumer's wake hint, it never buffers. Wake
hints are coalesced through the ring's wake bits (cython_ring does the atomics)."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable
from operator import itemgetter
from typing import Any

import numpy as np
import trio

from cython_ring import EgressState, IngressState, ObjectSpec

from .. import _proto as wire  # its RingFault and ObjectFailed are the messages; _errors' the exceptions
from .._errors import (
    ArenaError,
    BrokenWorkerError,
    DeadlineExceeded,
    GpuWorkerError,
    MalformedMessage,
    ObjectFailed,
    RingFault,
    WorkerError,
)
from .._proto import (
    EXT_LOADED_BLOCK,
    HANDLE_ID,
    LOADED_ROW_BYTES,
    InstallRing,
    LoadedBlock,
    LoadedRow,
    ObjectLoaded,
    ObjectsLoaded,
    RingInstalled,
    RingQuiesced,
    RingReadable,
    RingWritable,
    UninstallRing,
    WireMessage,
    advertised,
)
from ._arena import ArenaManager, Lease, NeverInstalled, Quiesced, Reaped
from ._lane import Lane
from ._ringend import RingEnd
from ._ringio import RingIO
from ._steps import Steps

STALL_BYTES = 64  # less free space than this in an egress ring: a producer is waiting for its consumer


class DataPlane(RingIO):
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
        """A step of `lane` is blocked on a full egress ring nobody pulls: no hang of its own. Its puller is woken
        (a worker that hung before its RING_READABLE left it parked): drained, the next window sees the hang. A
        ring we have faulted or are uninstalling waits on nobody: its step must fail and the ring quiesce, and a
        worker that does neither within the window is hung."""
        stalled = False
        for e in self.ends.values():
            if e.lane is lane and e.steps and not e.released and e.fault is None and e.ring.writable < STALL_BYTES:
                e.hint.set()
                stalled = True
        return stalled

    def _lane(self, lane_id: str) -> Lane:
        lane = self.lanes.get(lane_id)
        if lane is None:
            raise WorkerError("invalid_request", f"no lane {lane_id!r}")
        return lane

    # --- rings -----------------------------------------------------------------------------------

    async def install_ring(self, lane_id: str, *, direction: str, capacity: int, object_spec: dict[str, Any],
                           edge_id: str = "edge", port_id: str = "port", timeout: float | None = None) -> RingEnd:
        """Lease arena space and install a ring on the lane's worker; `timeout` bounds the whole call (the wait for
        arena space included). Left before it completed (timeout, cancellation, an error), what was done is undone:
        a ring installed meanwhile is uninstalled, a lease released."""
        lane = self._lane(lane_id)
        spec = ObjectSpec.from_wire(object_spec)
        deadline = trio.current_time() + (math.inf if timeout is None else timeout)
        lease = None
        with trio.move_on_at(deadline):  # a wait for space that is left leaves the arena's queue holding nothing
            lease = await self.arena.lease(capacity)
        if lease is None:
            raise DeadlineExceeded(f"no arena space for a ring of {capacity} bytes within {timeout:g} s")
        return await self._install(lane, lease, direction, spec, edge_id, port_id, deadline)

    async def _install(self, lane: Lane, lease: Lease, direction: str, spec: ObjectSpec, edge_id: str, port_id: str,
                       deadline: float) -> RingEnd:
        ring = self.arena.init_ring(lease)
        generation, pid = lane.generation, lane.pid
        if pid is None:
            ring.release()
            self.arena.release(lease, NeverInstalled(lease.ring_id))
            raise RingFault("worker_process_exited", f"lane {lane.id} has no running worker")
        self.arena.mark_installed(lease, pid)
        end = RingEnd(lane, generation, lease, ring, direction, spec, edge_id, port_id,
                      EgressState(spec) if direction == "ingress" else IngressState())
        self.ends[lease.ring_id] = end
        layout = {"offset": lease.offset, "header_len": 128, "capacity": lease.capacity}
        # a worker that can report completions as a binary block is asked to (a plain v3 worker keeps CBOR rows)
        gen = lane.gens.get(generation)
        block = direction == "ingress" and gen is not None and EXT_LOADED_BLOCK in advertised(gen.wp.hello)
        request = InstallRing(ring_id=lease.ring_id, edge_id=edge_id, port_id=port_id, direction=direction,
                              layout=layout, object_spec=spec.to_wire(), loaded_block=True if block else None)
        waiting, early, sent = [True], [], [False]

        def answered(reply: WireMessage | None, error: BaseException | None) -> None:
            if waiting[0]:  # its caller may be leaving right now (see BaseException below)
                return early.append((reply, error))
            self._orphan_answered(end, reply, error, sent=sent[0])

        remaining = None if math.isinf(deadline) else max(0.0, deadline - trio.current_time())
        try:
            # if the worker dies meanwhile, the reaped-worker hook releases the lease
            reply = await lane.call(request, timeout=remaining, on_result=answered, generation=generation,
                                    on_started=lambda: sent.__setitem__(0, True))
        except BrokenWorkerError as exc:  # its worker ended first: the reaped-worker hook released the lease
            raise RingFault("worker_process_exited", str(exc)) from exc
        except WorkerError as exc:  # ERR: the worker refused it, nothing was installed
            self._release(end, Quiesced(lease.ring_id, pump_stopped=True), RingFault(exc.code, exc.message))
            raise
        except BaseException:  # its deadline, a cancellation, any error: undone once (or as) its answer is in
            waiting[0] = False
            for answer in early:  # settled as its caller left (dropped from the queue): undo it now
                self._orphan_answered(end, *answer, sent=sent[0])
            raise
        if isinstance(reply, wire.RingFault):
            fault = RingFault(reply.reason, reply.msg or "the worker refused the ring")
            self._release(end, Quiesced(lease.ring_id, pump_stopped=True), fault)
            raise fault
        return end

    def _orphan_answered(self, end: RingEnd, reply: WireMessage | None, error: BaseException | None, *,
                         sent: bool) -> None:
        """Its installer gave up waiting: an installed ring is uninstalled, a refused one, or one never sent (dropped
        from the queue, refused by a quarantined lane), released at once (if its worker died after it was sent, the
        reaped-worker hook releases it)."""
        if end.released:
            return
        if isinstance(reply, RingInstalled):
            if self._nursery is not None:
                self._nursery.start_soon(self._uninstall_quietly, end)
        elif reply is not None or not sent or error is None or isinstance(error, WorkerError):
            self._release(end, Quiesced(end.ring_id, pump_stopped=True),
                          RingFault("worker_internal", "the ring was refused or never sent: its installer left"))

    async def _uninstall_quietly(self, end: RingEnd) -> None:
        with contextlib.suppress(GpuWorkerError):
            await self.uninstall_ring(end, timeout=end.lane.windows.control_s)

    async def uninstall_ring(self, end: RingEnd, reason: str = "edge_stopped", timeout: float | None = None) -> None:
        """Stop our pump, then UNINSTALL_RING; the lease is released on RING_QUIESCED (or when the worker is reaped)."""
        await self._uninstall(end, reason, timeout, requeue=True)

    async def _uninstall(self, end: RingEnd, reason: str, timeout: float | None, *, requeue: bool) -> None:
        end.fail(RingFault("worker_shutting_down", "ring uninstalled"))
        if end.released:
            return
        uninstall = UninstallRing(ring_id=end.ring_id, reason=reason)
        if end.steps:
            # a step blocked on this ring's space holds the lane: the notification form reaches the worker
            # past it, the step fails invalid_output_ring, and RING_QUIESCED comes back without req_id
            await self._notify_message(end, uninstall)
            with trio.move_on_after(math.inf if timeout is None else timeout):
                await end.quiesced.wait()
            if not end.released:
                raise DeadlineExceeded(f"ring {end.ring_id} was not quiesced within {timeout:g} s")
            return
        sent = False

        def started() -> None:
            nonlocal sent
            sent = True

        def answered(reply: WireMessage | None, error: BaseException | None) -> None:
            if isinstance(reply, RingQuiesced):  # released on its answer, whether or not its caller still waits
                self._quiesced(end, end.fault or RingFault("worker_shutting_down", "ring uninstalled"))

        try:
            await end.lane.call(uninstall, timeout=timeout, generation=end.generation, on_result=answered,
                                on_started=started)
        except (trio.Cancelled, DeadlineExceeded):
            if requeue and not sent and not end.released and self._nursery is not None:
                # its caller left while it was queued (behind a step, say), and a queued request is dropped: it
                # waits in the queue in the background instead, until it is sent or its worker ends
                self._nursery.start_soon(self._uninstall_queued, end, reason)
            raise

    async def _uninstall_queued(self, end: RingEnd, reason: str) -> None:
        with contextlib.suppress(GpuWorkerError):
            if not end.released:
                await self._uninstall(end, reason, None, requeue=False)

    def _quiesced(self, end: RingEnd, fault: RingFault) -> None:
        with contextlib.suppress(ArenaError):  # a refused proof keeps the lease until the worker is reaped
            self._release(end, Quiesced(end.ring_id, pump_stopped=True), fault)

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

    def _release_orphans(self, end: RingEnd, handles: list[int]) -> None:
        """Device handles of objects whose loader left: released in the background (a worker that is gone took them
        with it)."""
        if handles and self._nursery is not None:
            self._nursery.start_soon(self._release_quietly, end, handles)

    async def _release_quietly(self, end: RingEnd, handles: list[int]) -> None:
        for handle_id in handles:
            with contextlib.suppress(GpuWorkerError):
                await self.steps.release(end.lane, {"worker_generation": end.generation, "id": handle_id},
                                         timeout=end.lane.windows.control_s)

    # --- events from lanes -----------------------------------------------------------------------

    def on_lane_event(self, lane: Lane, generation: int, msg: WireMessage | None) -> None:
        if msg is None:
            self._generation_gone(lane, generation)
            return
        end = self.ends.get(getattr(msg, "ring_id", -1))
        if end is None or end.lane is not lane or end.generation != generation:
            return
        match msg:
            case RingReadable() | RingWritable():
                end.hint.set()
            case ObjectsLoaded(objects=rows):
                if rows:
                    self._loaded(end, rows, map(itemgetter(HANDLE_ID), rows))
                end.event_ready.set()
            case LoadedBlock(raw=raw):  # the same rows as one array: no Python step per row
                if len(raw) % LOADED_ROW_BYTES:
                    raise MalformedMessage(f"LOADED_BLOCK of {len(raw)} bytes is not whole rows")
                block = np.frombuffer(raw, "<u8").reshape(-1, 4)
                if len(block):
                    self._loaded(end, block, block[:, HANDLE_ID].tolist())
                end.event_ready.set()
            case ObjectLoaded():  # the per-object form: a batch of one
                handle_id = msg.device_handle["id"]
                self._loaded(end, [list(LoadedRow(msg.object_id, msg.sequence, msg.extent, handle_id))], (handle_id,))
                end.event_ready.set()
            case RingQuiesced():  # an out-of-band UNINSTALL_RING's answer, or its worker stopping in order
                self._quiesced(end, RingFault("worker_shutting_down", f"ring {end.ring_id} was quiesced"))
            case wire.RingFault() | wire.ObjectFailed():
                if isinstance(msg, wire.RingFault):
                    end.fail(RingFault(msg.reason, msg.msg or ""))
                end.events.append(msg)
                end.event_ready.set()

    def _loaded(self, end: RingEnd, rows: Any, handles: Iterable[int]) -> None:
        """A batch of completions: its handles are live; those of objects whose loader left are released."""
        end.events.append(rows)
        self.steps.handles.minted(end.lane, end.generation, handles)
        if end.orphans:
            self._release_orphans(end, end.disown())

    def _generation_gone(self, lane: Lane, generation: int) -> None:
        """The worker is reaped: its handles are void; fault every ring it had, tell subscribers, release leases."""
        self.steps.handles.generation_gone(lane, generation)
        pid, rc, gone = *lane.last_reaped, f"worker of lane {lane.id} generation {generation} exited"
        for end in [e for e in self.ends.values() if e.lane is lane and e.generation == generation]:
            fault = wire.RingFault(ring_id=end.ring_id, edge_id=end.edge_id, port_id=end.port_id,
                                   reason="worker_process_exited")
            end.events.append(fault)
            self.bus.publish({"t": fault.T, **fault.to_fields(), "lane_id": lane.id, "generation": generation,
                              "synthetic": True})
            self._release(end, Reaped(pid, rc, pump_stopped=True), RingFault("worker_process_exited", gone))


__all__ = ["DataPlane", "ObjectFailed", "RingEnd", "RingFault"]
