"""The in-process fake engine's side of the data plane: rings on the real arena through the native cython_ring helper,
device objects as numpy buffers, the echo role. An independent implementation of the worker interface (not the
real worker's code), so the daemon's data plane is checked against the contract rather than against itself."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import trio

from cython_ring import EgressState, IngressState, ObjectSpec, Ring, drain_ingress, write_egress

from .._proto import ConfigureRole, InstallRing, ReleaseDeviceObject, UninstallRing, WireMessage


class Worker(Protocol):
    generation: int

    async def send(self, t: str, fields: dict[str, Any], raw: bytes | None = None) -> None: ...

    async def send_all(self, messages: list[tuple[str, dict[str, Any]]]) -> None: ...


@dataclass(eq=False)
class Slot:
    ring_id: int
    edge_id: str
    port_id: str
    direction: str
    spec: ObjectSpec
    ring: Ring
    state: Any
    closed: str | None = None  # the StepFailure a step writing to it gets
    wake: trio.Event = field(default_factory=trio.Event)
    landing: list[np.ndarray] = field(default_factory=list)


class SimRings:
    def __init__(self, worker: Worker, arena: Any) -> None:
        self.worker, self.arena = worker, arena
        self.rings: dict[int, Slot] = {}
        self.objects: dict[int, np.ndarray] = {}
        self.roles: set[str] = set()
        self._next = 1
        self.busy = False
        self.idle = trio.Event()

    def ids(self, slot: Slot) -> dict[str, Any]:
        return {"ring_id": slot.ring_id, "edge_id": slot.edge_id, "port_id": slot.port_id}

    async def request(self, msg: WireMessage) -> tuple[str, dict[str, Any]]:
        if isinstance(msg, InstallRing):
            ids = {"ring_id": msg.ring_id, "edge_id": msg.edge_id, "port_id": msg.port_id}
            if self.arena is None or msg.ring_id in self.rings:
                return "RING_FAULT", {**ids, "reason": "ring_state_invalid", "msg": "no arena or a duplicate"}
            spec = ObjectSpec.from_wire(msg.object_spec)
            ring = Ring.attach(self.arena, msg.layout["offset"], expected_ring_id=msg.ring_id,
                               expected_capacity=msg.layout["capacity"])
            state = IngressState() if msg.direction == "ingress" else EgressState(spec)
            self.rings[msg.ring_id] = Slot(msg.ring_id, msg.edge_id, msg.port_id, msg.direction, spec,
                                              ring, state)
            return "RING_INSTALLED", ids
        if isinstance(msg, UninstallRing):
            self.quiesce(msg.ring_id)
            return "RING_QUIESCED", {"ring_id": msg.ring_id}
        if isinstance(msg, ConfigureRole):
            if msg.role_id in self.roles or msg.config.get("kind") != "echo":
                return "ROLE_FAILED", {"role_id": msg.role_id, "reason": "worker_rejected_role"}
            self.roles.add(msg.role_id)
            return "ROLE_CONFIGURED", {"role_id": msg.role_id}
        if isinstance(msg, ReleaseDeviceObject):
            handle = msg.device_handle
            if handle["worker_generation"] != self.worker.generation or self.objects.pop(handle["id"], None) is None:
                return "RELEASE_FAILED", {"device_handle": handle, "reason": "invalid_device_handle"}
            return "DEVICE_OBJECT_RELEASED", {"device_handle": handle}
        return "ERR", {"code": "unsupported_request", "msg": f"sim worker: no {msg.T}"}

    # --- ingress -----------------------------------------------------------------------------------

    async def drain(self, ring_id: int) -> None:
        slot = self.rings.get(ring_id)
        if slot is None or slot.direction != "ingress" or slot.closed:
            return
        landing = slot.landing  # an object larger than the ring finishes in a later drain than it starts

        def resolve(object_id: int, sequence: int, extent: int) -> tuple[int, int]:
            buf = np.empty(max(extent, 1), dtype=np.uint8)
            landing.append(buf)
            return buf.ctypes.data, extent

        out: list[tuple[str, dict[str, Any]]] = []
        loaded: list[list[int]] = []
        events = drain_ingress(slot.ring, slot.state, slot.spec, resolve)
        for ev in events:
            if ev[0] == "loaded":
                buf = landing.pop(0)[: ev[3]]
                handle, self._next = self._next, self._next + 1
                self.objects[handle] = buf
                loaded.append([ev[1], ev[2], ev[3], handle])
            elif ev[0] == "writable":
                out.append(("RING_WRITABLE", {"ring_id": ring_id}))
            elif ev[0] in ("failed", "ring_fault"):
                slot.closed = "invalid_output_ring"
                if ev[0] == "failed":
                    out.append(("OBJECT_FAILED", {**self.ids(slot), "reason": ev[1], "msg": ev[2]}))
                out.append(("RING_FAULT", {**self.ids(slot), "reason": ev[1] if ev[0] == "ring_fault"
                                           else "header_malformed", "msg": ev[2]}))
        if loaded:
            out.insert(0, ("OBJECTS_LOADED", {**self.ids(slot), "worker_generation": self.worker.generation,
                                              "objects": loaded}))
        await self.worker.send_all(out)

    def writable(self, ring_id: int) -> None:
        if (slot := self.rings.get(ring_id)) is not None:
            slot.wake.set()

    # --- steps ---------------------------------------------------------------------------------------

    async def execute(self, msg: WireMessage) -> tuple[str, dict[str, Any], None]:
        ids = {"role_id": msg.role_id, "step_id": msg.step_id}
        self.busy, self.idle = True, trio.Event()
        try:
            reason = await self._echo(msg)
        finally:
            self.busy = False
            self.idle.set()
            if msg.release_inputs_after:
                for binding in msg.inputs:
                    if binding["device_handle"]["worker_generation"] == self.worker.generation:
                        self.objects.pop(binding["device_handle"]["id"], None)
        if reason is not None:
            return "STEP_FAILED", {"req_id": msg.req_id, **ids, "reason": reason}, None
        return "STEP_COMPLETED", {"req_id": msg.req_id, **ids}, None

    async def _echo(self, msg: WireMessage) -> str | None:
        if msg.role_id not in self.roles:
            return "role_unavailable"
        inputs = []
        for binding in msg.inputs:
            handle = binding["device_handle"]
            buf = self.objects.get(handle["id"]) if handle["worker_generation"] == self.worker.generation else None
            if buf is None:
                return "invalid_input_handle"
            inputs.append(buf)
        for k, out in enumerate(msg.outputs):
            slot = self.rings.get(out["ring_id"])
            if slot is None or slot.direction != "egress" or not inputs:
                return "invalid_output_ring"
            src = inputs[min(k, len(inputs) - 1)]
            if src.nbytes != out["extent"]:
                return "output_extent_invalid"
            while True:
                slot.wake = trio.Event()
                if slot.closed is not None:
                    slot.state.abandon(slot.ring)
                    return slot.closed
                n, hint = write_egress(slot.ring, slot.state, out["object_id"], out["sequence"], src.ctypes.data,
                                       src.nbytes, out["flags"])
                if hint:
                    await self.worker.send("RING_READABLE", {"ring_id": slot.ring_id})
                if n:
                    await self.worker.send("PROGRESS", {"req_id": msg.req_id, "completed": self._tick(),
                                                        "phase": "inference"})
                if not slot.state.busy:
                    break
                await slot.wake.wait()
            await self.worker.send("OBJECT_PRODUCED", {"req_id": msg.req_id, "ring_id": slot.ring_id,
                                                       "port_id": out["port_id"], "object_id": out["object_id"],
                                                       "sequence": out["sequence"], "extent": out["extent"]})
        return None

    _count = 1

    def _tick(self) -> int:
        self._count += 1
        return self._count

    # --- ending --------------------------------------------------------------------------------------

    def close(self, ring_id: int, reason: str) -> None:
        if (slot := self.rings.get(ring_id)) is not None and slot.closed is None:
            slot.closed = reason
            slot.wake.set()

    def close_all(self, reason: str) -> None:
        for ring_id in list(self.rings):
            self.close(ring_id, reason)

    def quiesce(self, ring_id: int) -> None:
        if (slot := self.rings.pop(ring_id, None)) is not None:
            slot.closed = slot.closed or "invalid_output_ring"
            slot.wake.set()
            slot.ring.release()

    def quiesce_all(self) -> list[int]:
        ids = list(self.rings)
        for ring_id in ids:
            self.quiesce(ring_id)
        self.objects.clear()
        return ids
