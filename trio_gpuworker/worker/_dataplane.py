"""Worker side of the data plane: the arena mapping, per-ring ingress/egress state, device handles,
roles and EXECUTE_STEP. Cursor atomics, header parsing and copies are cython_ring's; tinygrad is
reached only through the DeviceBridge and the roles.
"""

from __future__ import annotations

import collections
import math
import mmap
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from cython_ring import EgressState, IngressState, ObjectSpec, Ring, drain_ingress, write_egress

from .._errors import ArenaMapFailed, CodedError, GpuWorkerError, ObjectHeaderError, RingError
from .._proto import Message
from ._engine import Reply

Emit = Callable[[str, dict[str, Any]], None]
# ObjectFailure codes that also leave the ring unusable, mapped to RingFaultReason names
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
    writable: threading.Event = field(default_factory=threading.Event)
    # allocations handed to the drain, oldest first: one drain call may start and finish several objects
    # before its events are read. Each is (device allocation, host staging or None when copies go direct).
    pending: collections.deque[tuple[Any, np.ndarray | None]] = field(default_factory=collections.deque)
    shapes: dict[int, tuple[int, ...]] = field(default_factory=dict)  # extent -> shape, a bounded cache
    closed: bool = False  # uninstalled (or the worker is stopping): a step writing to it gives up
    close_reason: str = "invalid_output_ring"  # the StepFailure of a step that finds it closed
    faulted: bool = False  # the worker faulted it (a device copy failed): later drains report nothing


@dataclass(slots=True)
class DeviceObject:
    alloc: Any
    dtype: str
    shape: tuple[int, ...]
    ring_id: int
    object_id: int


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


def map_arena() -> mmap.mmap | None:
    """The arena the daemon handed over (GPUWORKER_ARENA_FD/BYTES), or None when it handed none."""
    fd, size = os.environ.get("GPUWORKER_ARENA_FD"), os.environ.get("GPUWORKER_ARENA_BYTES", "0")
    if not fd:
        return None
    try:
        nbytes = int(size)
        return mmap.mmap(int(fd), nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE) if nbytes else None
    except (OSError, ValueError, OverflowError) as exc:
        raise ArenaMapFailed(f"cannot map arena fd {fd!r} of {size!r} bytes: {exc}") from exc


class WorkerDataPlane:
    def __init__(self, generation: int, emit: Emit, models: dict[str, Any], arena: Any = None,
                 bridge: Any = None) -> None:
        self.generation = generation
        self.emit = emit  # thread-safe: sends a message on the control socket
        self.models = models
        self.rings: dict[int, RingSlot] = {}
        self.roles: dict[str, Any] = {}
        self.objects: dict[int, DeviceObject] = {}
        self._next_handle = 1
        self._bridge: Any = bridge
        self.arena = arena if arena is not None else map_arena()

    @property
    def bridge(self) -> Any:
        if self._bridge is None:
            from ._bridge import DeviceBridge  # imports tinygrad: only once rings are in use

            self._bridge = DeviceBridge()
        return self._bridge

    # --- requests (run off the event loop) ------------------------------------------------------

    def install_ring(self, msg: Message) -> Reply:
        ring_id, layout = msg["ring_id"], msg["layout"]
        fail = lambda reason, text: Reply("RING_FAULT", {"ring_id": ring_id, "reason": reason, "msg": text})  # noqa: E731
        if self.arena is None:
            return fail("ring_layout_invalid", "this worker was started without an arena")
        if ring_id in self.rings:
            return fail("ring_state_invalid", f"ring {ring_id} is already installed")
        if layout["header_len"] != 128 or layout["offset"] % 64:
            return fail("ring_layout_invalid", f"bad layout {layout}")
        try:
            spec = ObjectSpec.from_wire(msg["object_spec"])
            ring = Ring.attach(self.arena, layout["offset"], expected_ring_id=ring_id,
                               expected_capacity=layout["capacity"])
        except GpuWorkerError as exc:
            return fail(getattr(exc, "code", "ring_layout_invalid"), str(exc))
        except ValueError as exc:
            return fail("ring_layout_invalid", str(exc))
        state = IngressState() if msg["direction"] == "ingress" else EgressState(spec)
        self.rings[ring_id] = RingSlot(ring_id, msg["edge_id"], msg["port_id"], msg["direction"], spec, ring, state)
        return Reply("RING_INSTALLED", {"ring_id": ring_id})

    def abort_ring(self, ring_id: int, reason: str = "invalid_output_ring") -> None:
        """Event loop, ahead of the queued uninstall: a step blocked on this ring's space gives up now."""
        slot = self.rings.get(ring_id)
        if slot is not None and not slot.closed:
            slot.closed, slot.close_reason = True, reason
            slot.writable.set()

    def abort_all(self) -> None:
        """SHUTDOWN abort_in_flight (event loop): every step blocked on ring space fails worker_shutting_down."""
        for ring_id in list(self.rings):
            self.abort_ring(ring_id, "worker_shutting_down")

    def uninstall_ring(self, msg: Message) -> Reply:
        self.quiesce(msg["ring_id"])
        return Reply("RING_QUIESCED", {"ring_id": msg["ring_id"]})

    def quiesce(self, ring_id: int) -> None:
        slot = self.rings.pop(ring_id, None)
        if slot is not None:
            slot.closed = True
            slot.writable.set()
            self._drop_pending(slot)
            slot.ring.release()

    def stop(self) -> list[int]:
        """SHUTDOWN: quiesce every ring and free every device object (compute thread). Returns the ring ids."""
        ring_ids = list(self.rings)
        for ring_id in ring_ids:
            self.quiesce(ring_id)
        objects, self.objects = self.objects, {}
        for obj in objects.values():
            self.bridge.free_device(obj.alloc)
        return ring_ids

    def configure_role(self, msg: Message) -> Reply:
        from ._roles import RoleError, make_role

        if msg["role_id"] in self.roles:
            return Reply("ROLE_FAILED", {"role_id": msg["role_id"], "reason": "worker_rejected_role",
                                         "msg": f"role {msg['role_id']!r} is already configured; role ids are "
                                                "immutable"})
        try:
            self.roles[msg["role_id"]] = make_role(msg["config"], self.models)
        except RoleError as exc:
            return Reply("ROLE_FAILED", {"role_id": msg["role_id"], "reason": exc.code, "msg": str(exc)})
        return Reply("ROLE_CONFIGURED", {"role_id": msg["role_id"]})

    def release(self, msg: Message) -> Reply:
        handle = msg["device_handle"]
        obj = self._lookup(handle)
        if obj is None:
            return Reply("RELEASE_FAILED", {"device_handle": handle, "reason": "invalid_device_handle",
                                            "msg": f"no live device object {handle}"})
        del self.objects[handle["id"]]
        self.bridge.free_device(obj.alloc)
        return Reply("DEVICE_OBJECT_RELEASED", {"device_handle": handle})

    def _lookup(self, handle: dict[str, int]) -> DeviceObject | None:
        """Handles of another worker generation never resolve, even if the id exists now."""
        if handle["worker_generation"] != self.generation:
            return None
        return self.objects.get(handle["id"])

    def execute_step(self, msg: Message, progress: Callable[[int, str], None]) -> Reply:
        step_id = msg["step_id"]
        try:
            self._execute(msg, progress)
        except DataPlaneError as exc:
            return Reply("STEP_FAILED", {"step_id": step_id, "reason": exc.code, "msg": str(exc)})
        finally:
            if msg["release_inputs_after"]:  # a failed step frees its inputs too: they are consumed either way
                for binding in msg["inputs"]:
                    obj = self._lookup(binding["device_handle"])
                    if obj is not None:
                        del self.objects[binding["device_handle"]["id"]]
                        self.bridge.free_device(obj.alloc)
        return Reply("STEP_COMPLETED", {"step_id": step_id})

    def _execute(self, msg: Message, progress: Callable[[int, str], None]) -> None:
        from ._bridge import DeviceError
        from ._roles import RoleError

        role = self.roles.get(msg["role_id"])
        if role is None:
            raise DataPlaneError("role_unavailable", f"role {msg['role_id']!r} is not configured")
        inputs, allocs = {}, {}
        for binding in msg["inputs"]:
            obj = self._lookup(binding["device_handle"])
            if obj is None:
                raise DataPlaneError("invalid_input_handle", f"no live device object {binding['device_handle']}")
            try:
                tensor = inputs[binding["port_id"]] = self.bridge.as_tensor(obj.alloc, obj.dtype, obj.shape)
            except DeviceError as exc:
                raise DataPlaneError(exc.code, str(exc)) from exc
            allocs[id(tensor)] = obj.alloc
        outs = []
        for binding in msg["outputs"]:
            slot = self.rings.get(binding["ring_id"])
            if slot is None or slot.direction != "egress":
                raise DataPlaneError("invalid_output_ring",
                                     f"ring {binding['ring_id']} is not an installed egress ring")
            outs.append((binding, slot))
        try:
            produced = role.execute(inputs, msg["runtime"])
        except RoleError as exc:
            raise DataPlaneError(exc.code, str(exc)) from exc
        except MemoryError as exc:
            raise DataPlaneError("device_out_of_memory", str(exc)) from exc
        written = 0
        for binding, slot in outs:
            tensor = produced.get(binding["port_id"])
            if tensor is None:
                raise DataPlaneError("output_extent_invalid", f"role produced no output {binding['port_id']!r}")
            # an input handed back unchanged (echo) is written from its own allocation: no device copy, which
            # costs a tinygrad schedule (milliseconds) per step; the input stays the caller's to release
            alloc = allocs.get(id(tensor))
            owned = alloc is None
            try:
                alloc = self.bridge.from_tensor(tensor) if owned else alloc
            except DeviceError as exc:
                raise DataPlaneError("output_copy_failed", str(exc)) from exc
            try:
                if alloc.nbytes != binding["extent"]:
                    raise DataPlaneError("output_extent_invalid",
                                         f"output {binding['port_id']!r} has {alloc.nbytes} bytes, binding says "
                                         f"{binding['extent']}")
                written = self._write_object(slot, binding, alloc, written, progress)
            finally:
                if owned:
                    self.bridge.free_device(alloc)
            self.emit("OBJECT_PRODUCED", {"req_id": msg["req_id"], "ring_id": slot.ring_id,
                                          "port_id": binding["port_id"], "object_id": binding["object_id"],
                                          "sequence": binding["sequence"], "extent": binding["extent"]})

    def _write_object(self, slot: RingSlot, binding: dict[str, Any], alloc: Any, written: int,
                      progress: Callable[[int, str], None]) -> int:
        """Header, then payload prefixes as space frees up; blocks (never spins) on RING_WRITABLE."""
        extent = binding["extent"]
        if self.bridge.direct:
            src = self.bridge.host_address(alloc)
        else:
            staging = np.empty(max(extent, 1), dtype=np.uint8)
            self.bridge.device_to_host(alloc, 0, memoryview(staging), extent)
            src = staging.ctypes.data
        state: EgressState = slot.state
        while True:
            slot.writable.clear()
            if slot.closed:
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
                self.emit("RING_READABLE", {"ring_id": slot.ring_id})
            if n:
                written += n
                progress(written, "inference")  # bytes committed are completed work: renews the watchdog
            if not state.busy:
                return written
            slot.writable.wait()

    # --- wake hints (run on the event loop) ----------------------------------------------------

    def on_writable(self, ring_id: int) -> None:
        """RING_WRITABLE: the daemon consumed egress bytes; a step waiting for space goes on (event loop)."""
        slot = self.rings.get(ring_id)
        if slot is not None:
            slot.writable.set()

    def drain(self, ring_id: int) -> list[tuple[str, dict[str, Any]]] | None:
        """RING_READABLE: one native drain of an ingress ring (compute thread). None once the ring is gone."""
        slot = self.rings.get(ring_id)
        if slot is None:
            return None
        return self._drain(slot) if slot.direction == "ingress" and not slot.faulted else []

    def _drain(self, slot: RingSlot) -> list[tuple[str, dict[str, Any]]]:
        """Every object this burst finished goes into one OBJECTS_LOADED (stream order), ahead of any failure."""
        from ._bridge import DeviceError

        out: list[tuple[str, dict[str, Any]]] = []
        loaded: list[list[int]] = []
        rid = slot.ring_id
        events = drain_ingress(slot.ring, slot.state, slot.spec, lambda o, s, n: self._resolve(slot, n))
        try:
            for ev in events:
                kind = ev[0]
                if kind == "loaded":
                    loaded.append(self._loaded(slot, ev[1], ev[2], ev[3]))
                elif kind == "failed":
                    _, code, text, object_id, sequence = ev
                    self._drop_pending(slot)
                    self._flush(slot, loaded, out)
                    fields = {"ring_id": rid, "reason": code, "msg": text}
                    fields.update({k: v for k, v in (("object_id", object_id), ("sequence", sequence))
                                   if v is not None})
                    out.append(("OBJECT_FAILED", fields))
                    if code != "eof_mid_object":
                        out.append(("RING_FAULT", {"ring_id": rid, "msg": text,
                                                   "reason": _RING_REASON.get(code, "header_malformed")}))
                elif kind == "ring_fault":
                    self._drop_pending(slot)
                    self._flush(slot, loaded, out)
                    out.append(("RING_FAULT", {"ring_id": rid, "reason": ev[1], "msg": ev[2]}))
                elif kind == "writable":
                    self._flush(slot, loaded, out)
                    out.append(("RING_WRITABLE", {"ring_id": rid}))
            if loaded:
                self.bridge.synchronize()  # nothing is compute-visible before every copy completed
        except DeviceError as exc:
            # the failed object's bytes left the ring but never reached the device: the stream cannot go on
            self._drop_pending(slot)
            if ev[0] == "loaded" and (not loaded or loaded[-1][0] != ev[1]):
                failed = {"object_id": ev[1], "sequence": ev[2]}  # its own copy failed
            else:  # the burst's synchronize failed: no object of it is known to be complete
                failed = {"object_id": loaded[0][0], "sequence": loaded[0][1]} if loaded else {}
                for row in loaded:
                    self.bridge.free_device(self.objects.pop(row[3]).alloc)
                loaded.clear()
            slot.ring.fault()
            slot.faulted = True
            self._flush(slot, loaded, out)
            out = [m for m in out if m[0] != "RING_WRITABLE"]
            text = str(exc)
            out.append(("OBJECT_FAILED", {"ring_id": rid, "reason": "device_copy_failed", "msg": text, **failed}))
            out.append(("RING_FAULT", {"ring_id": rid, "reason": "device_copy_failed", "msg": text}))
            return out
        self._flush(slot, loaded, out)
        return out

    def _flush(self, slot: RingSlot, loaded: list[list[int]], out: list[tuple[str, dict[str, Any]]]) -> None:
        if loaded:
            out.append(("OBJECTS_LOADED", {"ring_id": slot.ring_id, "edge_id": slot.edge_id, "port_id": slot.port_id,
                                           "worker_generation": self.generation, "objects": loaded[:]}))
            loaded.clear()

    def _resolve(self, slot: RingSlot, extent: int) -> tuple[int, int]:
        alloc = self.bridge.alloc_device(extent)  # zero bytes allocate nothing; its host address is 0
        if self.bridge.direct:
            slot.pending.append((alloc, None))
            return self.bridge.host_address(alloc), extent
        staging = np.empty(max(extent, 1), dtype=np.uint8)
        slot.pending.append((alloc, staging))
        return staging.ctypes.data, extent

    def _loaded(self, slot: RingSlot, object_id: int, sequence: int, extent: int) -> list[int]:
        """[object_id, sequence, extent, handle id] of an object whose every byte is on the device."""
        alloc, staging = slot.pending[0]
        if staging is not None:
            self.bridge.host_to_device(alloc, 0, memoryview(staging), extent)
        slot.pending.popleft()
        handle_id, self._next_handle = self._next_handle, self._next_handle + 1
        shape = slot.shapes.get(extent)
        if shape is None:  # objects of a ring mostly share one extent: work the shape out once per extent
            try:
                shape = shape_for(slot.spec, extent)
            except DataPlaneError:
                shape = (extent // np.dtype(slot.spec.dtype).itemsize,)
            if len(slot.shapes) < 64:
                slot.shapes[extent] = shape
        self.objects[handle_id] = DeviceObject(alloc, slot.spec.dtype, shape, slot.ring_id, object_id)
        return [object_id, sequence, extent, handle_id]

    def _drop_pending(self, slot: RingSlot) -> None:
        while slot.pending:
            self.bridge.free_device(slot.pending.popleft()[0])
