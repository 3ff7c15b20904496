"""Worker side of the data plane: the arena mapping, per-ring ingress/egress state, device handles,
roles and EXECUTE_STEP. Cursor atomics, header parsing and copies are cython_ring's; tinygrad is
reached only through the DeviceBridge and the roles.
"""

from __future__ import annotations

import functools
import gc
import mmap
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import trio

from cython_ring import EgressState, IngressState, ObjectSpec, Ring, write_egress

from .. import _proto as wire  # its RingFault and StepFailed are the replies; _errors' are the exceptions
from .._errors import ArenaMapFailed, GpuWorkerError, ObjectHeaderError, RingError, StepFailed
from .._proto import (
    ConfigureRole,
    DeviceObjectReleased,
    ExecuteStep,
    InstallRing,
    ReleaseDeviceObject,
    ReleaseFailed,
    RingInstalled,
    RingQuiesced,
    RoleConfigured,
    RoleFailed,
    StepCompleted,
    UninstallRing,
)
from .._worker_env import ARENA_BYTES, ARENA_FD
from ._ingress import STREAM_WINDOW, DataPlaneError, Emit, IngressPlane, RingSlot, shape_for
from ._objects import DeviceObject, DeviceObjects
from ._roles import EchoRole


@dataclass(eq=False)
class _Output:
    """One output of a step, readable from host memory at `src` until the step is over."""

    binding: dict[str, Any]
    slot: RingSlot
    src: int
    owned: Any  # the device allocation the step made for it (freed after the step), or None for an input's own
    staging: np.ndarray | None = None  # keeps a device's host copy alive
GC_GEN0_THRESHOLD = 20_000  # allocations between young collections in a worker (CPython's default is 700)
def map_arena() -> mmap.mmap | None:
    """The arena the daemon handed over (GPUWORKER_ARENA_FD/BYTES), or None when it handed none."""
    fd, size = os.environ.get(ARENA_FD), os.environ.get(ARENA_BYTES, "0")
    if not fd:
        return None
    try:
        nbytes = int(size)
        return mmap.mmap(int(fd), nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE) if nbytes else None
    except (OSError, ValueError, OverflowError) as exc:
        raise ArenaMapFailed(f"cannot map arena fd {fd!r} of {size!r} bytes: {exc}") from exc


def _quietly(release: Callable[[Any], None], what: Any) -> None:
    """A release nobody waits for: on shutdown one failure must not keep the rest (the process exits next), and a
    host echo's consumed input is freed on the compute thread while its step answers. Log it and go on."""
    try:
        release(what)
    except GpuWorkerError as exc:
        print(f"worker: releasing {what!r}: {exc}", file=sys.stderr)


class WorkerDataPlane(IngressPlane):
    def __init__(self, generation: int, emit: Emit, models: dict[str, Any], arena: Any = None,
                 bridge: Any = None, flush: Callable[[], None] = lambda: None) -> None:
        self.generation = generation
        self.emit = emit  # thread-safe: queues a message for the control socket (on the loop: for its next write)
        self.flush = flush  # has what `emit` queued written now
        self.models = models
        self.rings: dict[int, RingSlot] = {}
        self.roles: dict[str, Any] = {}
        self.objects = DeviceObjects()
        self._next_handle = 1
        self._bridge: Any = bridge
        self.arena = arena if arena is not None else map_arena()
        self.stream_window = STREAM_WINDOW
        self.aborted = False  # SHUTDOWN abort_in_flight: steps fail worker_shutting_down

    @property
    def bridge(self) -> Any:
        if self._bridge is None:
            from ._bridge import DeviceBridge  # imports tinygrad: only once rings are in use

            self._bridge = DeviceBridge()
            # Each ingress object allocates a few Python objects, so collections run every few hundred
            # objects, and a collection that walks tinygrad's whole import graph cost ~17 us per 4 KiB
            # object (measured). Freeze what exists now (never garbage) and collect young objects less often.
            gc.freeze()
            gc.set_threshold(GC_GEN0_THRESHOLD, *gc.get_threshold()[1:])
        return self._bridge

    # --- requests (run off the event loop) ------------------------------------------------------

    def install_ring(self, msg: InstallRing) -> RingInstalled | wire.RingFault:
        ring_id, layout = msg.ring_id, msg.layout
        ids = {"req_id": msg.req_id, "ring_id": ring_id, "edge_id": msg.edge_id, "port_id": msg.port_id}
        fail = lambda reason, text: wire.RingFault(**ids, reason=reason, msg=text)  # noqa: E731
        if self.arena is None:
            return fail("ring_layout_invalid", "this worker was started without an arena")
        if ring_id in self.rings:
            return fail("ring_state_invalid", f"ring {ring_id} is already installed")
        if layout["header_len"] != 128 or layout["offset"] % 64:
            return fail("ring_layout_invalid", f"bad layout {layout}")
        try:
            spec = ObjectSpec.from_wire(msg.object_spec)
            ring = Ring.attach(self.arena, layout["offset"], expected_ring_id=ring_id,
                               expected_capacity=layout["capacity"])
        except ValueError as exc:  # cython_ring's errors are ValueErrors with a wire code; a bare one is a bad argument
            return fail(getattr(exc, "code", "ring_layout_invalid"), str(exc))
        state = IngressState() if msg.direction == "ingress" else EgressState(spec)
        self.rings[ring_id] = RingSlot(ring_id, msg.edge_id, msg.port_id, msg.direction, spec, ring, state,
                                       block=bool(msg.loaded_block))
        return RingInstalled(**ids)

    def abort_ring(self, ring_id: int, reason: str = "invalid_output_ring") -> None:
        """Event loop, ahead of the queued uninstall: a step blocked on this ring's space gives up now."""
        slot = self.rings.get(ring_id)
        if slot is not None and not slot.closed:
            slot.closed, slot.close_reason = True, reason
            slot.writable.set()

    def abort_all(self) -> None:
        """SHUTDOWN abort_in_flight (event loop): every step fails worker_shutting_down, blocked on ring space or
        not yet started."""
        self.aborted = True
        for ring_id in list(self.rings):
            self.abort_ring(ring_id, "worker_shutting_down")

    def uninstall_ring(self, msg: UninstallRing) -> RingQuiesced:
        self.quiesce(msg.ring_id)
        return RingQuiesced(ring_id=msg.ring_id, req_id=msg.req_id)

    def quiesce(self, ring_id: int) -> None:
        """Compute thread. A step blocked on this ring's space was woken on the event loop first (abort_ring)."""
        slot = self.rings.pop(ring_id, None)
        if slot is not None:
            slot.closed = True
            self._drop_pending(slot)
            slot.ring.release()

    def stop(self) -> list[int]:
        """SHUTDOWN: quiesce every ring and free every device object (compute thread). Returns the ring ids."""
        ring_ids = list(self.rings)
        objects, self.objects = self.objects, DeviceObjects()
        for ring_id in ring_ids:
            _quietly(self.quiesce, ring_id)
        for obj in objects.values():
            _quietly(self.bridge.free_device, obj.alloc)
        return ring_ids

    def configure_role(self, msg: ConfigureRole) -> RoleConfigured | RoleFailed:
        from ._roles import make_role

        ids = {"req_id": msg.req_id, "role_id": msg.role_id}
        if msg.role_id in self.roles:
            return RoleFailed(**ids, reason="worker_rejected_role",
                              msg=f"role {msg.role_id!r} is already configured; role ids are immutable")
        try:
            self.roles[msg.role_id] = make_role(msg.config, self.models)
        except StepFailed as exc:
            return RoleFailed(**ids, reason=exc.code, msg=str(exc))
        return RoleConfigured(**ids)

    def release(self, msg: ReleaseDeviceObject) -> DeviceObjectReleased | ReleaseFailed:
        handle = msg.device_handle
        if (obj := self._take(handle)) is None:
            return ReleaseFailed(req_id=msg.req_id, device_handle=handle, reason="invalid_device_handle",
                                 msg=f"no live device object {handle}")
        self.bridge.free_device(obj.alloc)
        return DeviceObjectReleased(req_id=msg.req_id, device_handle=handle)

    def _lookup(self, handle: dict[str, int]) -> DeviceObject | None:
        """Handles of another worker generation never resolve, even if the id exists now."""
        if handle["worker_generation"] != self.generation:
            return None
        return self.objects.get(handle["id"])

    def _take(self, handle: dict[str, int]) -> DeviceObject | None:
        """_lookup, and the handle dies: a released or consumed object is gone from the table at once."""
        if handle["worker_generation"] != self.generation:
            return None
        return self.objects.pop(handle["id"], None)

    async def execute_step(self, msg: ExecuteStep, progress: Callable[[int, str, bool], None],
                           compute: Any) -> StepCompleted | wire.StepFailed:
        """The role runs on the compute thread; its outputs are then written into their egress rings from the event
        loop, so a step waiting for ring space never holds the compute thread (ingress drains go on meanwhile). An
        echo of host memory (CPU) touches no tinygrad state and runs on the event loop: no thread hand-off."""
        ids = {"req_id": msg.req_id, "role_id": msg.role_id, "step_id": msg.step_id}
        plan: list[_Output] = []
        in_place = self._host_echo(msg)
        try:
            plan = self._echo_plan(msg) if in_place else await compute.run(self._prepare, msg)
            for out in plan:
                await self._write_object(out.slot, out.binding, out.src, progress)
                self.emit(wire.ObjectProduced(req_id=msg.req_id, ring_id=out.slot.ring_id,
                                              port_id=out.binding["port_id"], object_id=out.binding["object_id"],
                                              sequence=out.binding["sequence"], extent=out.binding["extent"]))
        except DataPlaneError as exc:
            return wire.StepFailed(**ids, reason=exc.code, msg=str(exc))
        finally:
            consumed = msg.inputs if msg.release_inputs_after else ()
            if in_place:
                self._consume(consumed, compute)
            else:
                await compute.run(self._after_step, plan, consumed)
        return StepCompleted(**ids)

    def _host_echo(self, msg: ExecuteStep) -> bool:
        """An echo step whose input is host memory (CPU) and whose ports are the role's own: its output is the
        input's allocation, read at a stable host address, so it needs neither tinygrad nor the compute thread.
        Anything else (another role, other ports, a device without host addresses) takes the general path, which
        also types every failure."""
        return (isinstance(self.roles.get(msg.role_id), EchoRole) and self.host_bridge
                and not self.aborted and [b["port_id"] for b in msg.inputs] == ["in"]
                and all(b["port_id"] == "out" for b in msg.outputs))

    def _echo_plan(self, msg: ExecuteStep) -> list[_Output]:
        """Event loop: _prepare for a host echo. Only reads: the input's record and its buffer's address."""
        obj = self._input(msg.inputs[0])
        return [self._output(binding, slot, obj.alloc, None) for binding, slot in self._egress_slots(msg)]

    def _consume(self, consumed: list[dict[str, Any]] | tuple[()], compute: Any) -> None:
        """Event loop: the consumed inputs' handles die now. Their memory is freed here while the compute thread is
        idle (nothing can start there meanwhile: this thread alone hands it work), else on that thread, ahead of any
        later work there (the bridge's pool is not thread-safe). Freeing here spares the thread a wake-up that
        competes with this loop for the GIL (about 25 µs of an echo step, bench/ring.py)."""
        for binding in consumed:
            if (obj := self._take(binding["device_handle"])) is not None:
                free = functools.partial(_quietly, self.bridge.free_device, obj.alloc)
                if compute.idle:
                    free()
                else:
                    compute.submit(free)

    def _after_step(self, plan: list[_Output], consumed: list[dict[str, Any]] | tuple[()]) -> None:
        """Compute thread: free the outputs the step allocated; a failed step frees its inputs too when asked to
        (`consumed`: they are consumed either way)."""
        for out in plan:
            if out.owned is not None:
                self.bridge.free_device(out.owned)
        for binding in consumed:
            if (obj := self._take(binding["device_handle"])) is not None:
                self.bridge.free_device(obj.alloc)

    def _prepare(self, msg: ExecuteStep) -> list[_Output]:
        """Compute thread: run the role and make every output readable from host memory."""
        from ._bridge import DeviceError

        if self.aborted:
            raise DataPlaneError("worker_shutting_down", "the worker is shutting down (abort_in_flight)")
        role = self.roles.get(msg.role_id)
        if role is None:
            raise DataPlaneError("role_unavailable", f"role {msg.role_id!r} is not configured")
        inputs, allocs = {}, {}
        for binding in msg.inputs:
            obj = self._input(binding)
            try:
                tensor = inputs[binding["port_id"]] = self.bridge.as_tensor(obj.alloc, obj.dtype, obj.shape)
            except DeviceError as exc:
                raise DataPlaneError(exc.code, str(exc)) from exc
            allocs[id(tensor)] = obj.alloc
        slots = self._egress_slots(msg)
        try:
            produced = role.execute(inputs, msg.runtime)
        except StepFailed as exc:
            raise DataPlaneError(exc.code, str(exc)) from exc
        except MemoryError as exc:
            raise DataPlaneError("device_out_of_memory", str(exc)) from exc
        plan: list[_Output] = []
        try:
            for binding, slot in slots:
                plan.append(self._readable(binding, slot, produced.get(binding["port_id"]), allocs))
        except BaseException:
            self._after_step(plan, ())  # the inputs stay: _after_step in execute_step consumes them
            raise
        return plan

    def _input(self, binding: dict[str, Any]) -> DeviceObject:
        obj = self._lookup(binding["device_handle"])
        if obj is None:
            raise DataPlaneError("invalid_input_handle", f"no live device object {binding['device_handle']} "
                                                         f"in worker generation {self.generation}")
        return obj

    def _egress_slots(self, msg: ExecuteStep) -> list[tuple[dict[str, Any], RingSlot]]:
        slots = []
        for binding in msg.outputs:
            slot = self.rings.get(binding["ring_id"])
            if slot is None or slot.direction != "egress":
                raise DataPlaneError("invalid_output_ring",
                                     f"ring {binding['ring_id']} is not an installed egress ring")
            slots.append((binding, slot))
        return slots

    def _readable(self, binding: dict[str, Any], slot: RingSlot, tensor: Any, allocs: dict[int, Any]) -> _Output:
        from ._bridge import DeviceError

        if tensor is None:
            raise DataPlaneError("output_extent_invalid", f"role produced no output {binding['port_id']!r}")
        # an input handed back unchanged (echo) is written from its own allocation: no device copy, which costs a
        # tinygrad schedule (milliseconds) per step; the input stays the caller's to release
        alloc = allocs.get(id(tensor))
        owned = None
        if alloc is None:
            try:
                alloc = owned = self.bridge.from_tensor(tensor)
            except DeviceError as exc:
                raise DataPlaneError("output_copy_failed", str(exc)) from exc
        return self._output(binding, slot, alloc, owned)

    def _output(self, binding: dict[str, Any], slot: RingSlot, alloc: Any, owned: Any) -> _Output:
        """The output `alloc` made readable from host memory; `owned` (the step's own allocation) is freed on a
        refusal."""
        out = _Output(binding, slot, 0, owned)
        if alloc.nbytes != binding["extent"]:
            if owned is not None:
                self.bridge.free_device(owned)
            raise DataPlaneError("output_extent_invalid", f"output {binding['port_id']!r} has {alloc.nbytes} bytes, "
                                                          f"binding says {binding['extent']}")
        if self.bridge.direct:
            out.src = self.bridge.host_address(alloc)
        else:
            out.staging = np.empty(max(binding["extent"], 1), dtype=np.uint8)
            self.bridge.device_to_host(alloc, 0, memoryview(out.staging), binding["extent"])
            out.src = out.staging.ctypes.data
        return out

    async def _write_object(self, slot: RingSlot, binding: dict[str, Any], src: int,
                            progress: Callable[[int, str, bool], None]) -> None:
        """Event loop: header, then payload prefixes as space frees up; waits (never spins) for RING_WRITABLE."""
        extent, written = binding["extent"], 0
        state: EgressState = slot.state
        while True:
            slot.writable = trio.Event()
            if slot.closed:
                state.abandon(slot.ring)  # a header already committed: the reader sees a fault, not a short object
                raise DataPlaneError(slot.close_reason, f"ring {slot.ring_id} was closed while a step wrote to it")
            try:
                n, hint = write_egress(slot.ring, state, binding["object_id"], binding["sequence"], src, extent,
                                       binding["flags"])
            except ObjectHeaderError as exc:  # the binding breaks the ring's spec: nothing was written
                code = "invalid_output_ring" if exc.code == "sequence_violation" else "output_extent_invalid"
                raise DataPlaneError(code, str(exc)) from exc
            except (RingError, ValueError) as exc:
                raise DataPlaneError("output_copy_failed", str(exc)) from exc
            if hint:
                self.emit(wire.RingReadable(ring_id=slot.ring_id))
            if n:
                written += n
                # bytes committed are completed work: PROGRESS renews the watchdog while the step waits for space;
                # an object finished by this call needs none, its OBJECT_PRODUCED goes in the same write
                progress(written, "inference", state.busy)
            if not state.busy:
                return
            self.flush()  # the consumer must see RING_READABLE (and PROGRESS) before this step can go on
            await slot.writable.wait()

    # --- wake hints (run on the event loop) ----------------------------------------------------

    def on_writable(self, ring_id: int) -> None:
        """RING_WRITABLE: the daemon consumed egress bytes; a step waiting for space goes on (event loop)."""
        slot = self.rings.get(ring_id)
        if slot is not None:
            slot.writable.set()


__all__ = ["DataPlaneError", "DeviceObject", "RingSlot", "WorkerDataPlane", "map_arena", "shape_for"]
