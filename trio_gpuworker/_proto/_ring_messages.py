"""The data-plane control surface (GPU worker interface §7-§8) as protocol-v3 messages.

Requests carry req_id and end in one terminal reply; OBJECT_PRODUCED is an intermediate reply of
EXECUTE_STEP. Worker events without req_id are notifications, like the wake hints.

Two out-of-band forms exist because the worker runs one request at a time: UNINSTALL_RING without
req_id stops a step blocked on that ring's space now (answered by RING_QUIESCED without req_id), and
OBJECTS_LOADED reports every object one ingress drain finished as rows [object_id, sequence, extent,
handle id], in stream order; it means exactly what the same rows sent as OBJECT_LOADED would.
"""

from __future__ import annotations

from itertools import chain

from ._fields import DAEMON, REQ, WORKER, Spec, flag, list_of, mapping, one_of, record, text, uint

DIRECTIONS = ("ingress", "egress")
UNINSTALL_REASONS = ("edge_stopped", "ring_faulted", "worker_shutdown")
HANDLE = record(worker_generation=uint, id=uint)
LAYOUT = record(offset=uint, header_len=uint, capacity=uint)
STEP_INPUT = record(port_id=text, object_id=uint, sequence=uint, device_handle=HANDLE)
STEP_OUTPUT = record(port_id=text, ring_id=uint, object_id=uint, sequence=uint, extent=uint, flags=uint)
INTERMEDIATE = {"EXECUTE_STEP": {"OBJECT_PRODUCED"}}
RING_IDS = {"ring_id": uint, "edge_id": text, "port_id": text}  # a ring's events name its edge and port (§8.3)


def _rows(v: object) -> bool:
    """A list of [object_id, sequence, extent, handle id] rows of u64s. One drain reports up to hundreds of rows,
    so the check runs as C-level loops over the flattened values rather than one Python call per value."""
    if not isinstance(v, list):
        return False
    if not v:
        return True
    if set(map(type, v)) != {list} or set(map(len, v)) != {4}:
        return False
    flat = list(chain.from_iterable(v))
    # exactly int: bool (and any other int subclass) is refused, as uint refuses it
    return set(map(type, flat)) == {int} and min(flat) >= 0 and max(flat) < (1 << 64)


_MESSAGES: dict[str, tuple[Spec, dict[str, set[str]]]] = {
    "CONFIGURE_ROLE": (Spec(DAEMON, {**REQ, "role_id": text, "config": mapping}), {}),
    "ROLE_CONFIGURED": (Spec(WORKER, {**REQ, "role_id": text}), {"CONFIGURE_ROLE": {"ROLE_CONFIGURED", "ROLE_FAILED"}}),
    "ROLE_FAILED": (Spec(WORKER, {**REQ, "role_id": text, "reason": text}, {"msg": text}), {}),
    "INSTALL_RING": (Spec(DAEMON, {**REQ, "ring_id": uint, "edge_id": text, "port_id": text,
                                   "direction": one_of(*DIRECTIONS), "layout": LAYOUT, "object_spec": mapping}), {}),
    "RING_INSTALLED": (Spec(WORKER, {**REQ, **RING_IDS}), {"INSTALL_RING": {"RING_INSTALLED", "RING_FAULT"}}),
    # a terminal reply to INSTALL_RING (with req_id) or a notification at any time (without)
    "RING_FAULT": (Spec(WORKER, {**RING_IDS, "reason": text}, {"req_id": uint, "msg": text}), {}),
    # a request (with req_id) or, while a step may be blocked on the ring, a notification (without)
    "UNINSTALL_RING": (Spec(DAEMON, {"ring_id": uint, "reason": one_of(*UNINSTALL_REASONS)}, {"req_id": uint}), {}),
    "RING_QUIESCED": (Spec(WORKER, {"ring_id": uint}, {"req_id": uint}), {"UNINSTALL_RING": {"RING_QUIESCED"}}),
    "EXECUTE_STEP": (Spec(DAEMON, {**REQ, "role_id": text, "step_id": uint, "inputs": list_of(STEP_INPUT),
                                   "outputs": list_of(STEP_OUTPUT), "runtime": mapping,
                                   "release_inputs_after": flag}), {}),
    "OBJECT_PRODUCED": (Spec(WORKER, {**REQ, "ring_id": uint, "port_id": text, "object_id": uint, "sequence": uint,
                                      "extent": uint}), {}),
    "STEP_COMPLETED": (Spec(WORKER, {**REQ, "role_id": text, "step_id": uint}),
                       {"EXECUTE_STEP": {"STEP_COMPLETED", "STEP_FAILED"}}),
    "STEP_FAILED": (Spec(WORKER, {**REQ, "role_id": text, "step_id": uint, "reason": text}, {"msg": text}), {}),
    "RELEASE_DEVICE_OBJECT": (Spec(DAEMON, {**REQ, "device_handle": HANDLE}), {}),
    "DEVICE_OBJECT_RELEASED": (Spec(WORKER, {**REQ, "device_handle": HANDLE}),
                               {"RELEASE_DEVICE_OBJECT": {"DEVICE_OBJECT_RELEASED", "RELEASE_FAILED"}}),
    "RELEASE_FAILED": (Spec(WORKER, {**REQ, "reason": text}, {"device_handle": HANDLE, "msg": text}), {}),
    "OBJECT_LOADED": (Spec(WORKER, {"ring_id": uint, "edge_id": text, "port_id": text, "object_id": uint,
                                    "sequence": uint, "extent": uint, "device_handle": HANDLE}), {}),
    "OBJECTS_LOADED": (Spec(WORKER, {"ring_id": uint, "edge_id": text, "port_id": text, "worker_generation": uint,
                                     "objects": _rows}), {}),
    "OBJECT_FAILED": (Spec(WORKER, {**RING_IDS, "reason": text}, {"msg": text, "object_id": uint, "sequence": uint}),
                      {}),
}

RING_SCHEMAS: dict[str, Spec] = {name: spec for name, (spec, _) in _MESSAGES.items()}
RING_TERMINAL: dict[str, set[str]] = {req: replies for _, terminal in _MESSAGES.values()
                                      for req, replies in terminal.items()}
