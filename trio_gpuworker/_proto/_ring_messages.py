"""The data-plane control surface (docs/architecture.md, 'Data plane') as protocol-v3 messages, one class each.

Requests carry req_id and end in one terminal reply; OBJECT_PRODUCED is an intermediate reply of
EXECUTE_STEP. Worker events without req_id are notifications, like the wake hints.

Two out-of-band forms exist because the worker runs one request at a time: UNINSTALL_RING without
req_id stops a step blocked on that ring's space now (answered by RING_QUIESCED without req_id), and
OBJECTS_LOADED reports every object one ingress drain finished as rows [object_id, sequence, extent,
handle id], in stream order; it means exactly what the same rows sent as OBJECT_LOADED would.
"""

from __future__ import annotations

from itertools import chain
from typing import Any, NamedTuple

from ._fields import DAEMON, WORKER, flag, list_of, mapping, one_of, record, text, uint
from ._wire import WireMessage, collect, message, need, numbered, opt, raw_frame

DIRECTIONS = ("ingress", "egress")
UNINSTALL_REASONS = ("edge_stopped", "ring_faulted", "worker_shutdown")
HANDLE = record(worker_generation=uint, id=uint)
LAYOUT = record(offset=uint, header_len=uint, capacity=uint)
STEP_INPUT = record(port_id=text, object_id=uint, sequence=uint, device_handle=HANDLE)
STEP_OUTPUT = record(port_id=text, ring_id=uint, object_id=uint, sequence=uint, extent=uint, flags=uint)


class LoadedRow(NamedTuple):
    """One row of OBJECTS_LOADED, named. On the wire, and in the batches handed on whole, a row stays a list of
    four ints (a drain reports hundreds: no Python step per row); OBJECT_ID ... HANDLE_ID name its columns."""

    object_id: int
    sequence: int
    extent: int
    handle_id: int  # the device handle's id; its worker_generation is the message's


OBJECT_ID, SEQUENCE, EXTENT, HANDLE_ID = range(4)  # LoadedRow's columns, for a row that stays a list


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


@message("CONFIGURE_ROLE", DAEMON)
class ConfigureRole(WireMessage):
    req_id: int = numbered()
    role_id: str = need(text)
    config: dict[str, Any] = need(mapping)


@message("ROLE_CONFIGURED", WORKER, ends=(ConfigureRole,))
class RoleConfigured(WireMessage):
    req_id: int = need(uint)
    role_id: str = need(text)


@message("ROLE_FAILED", WORKER, ends=(ConfigureRole,), fails=True)
class RoleFailed(WireMessage):
    req_id: int = need(uint)
    role_id: str = need(text)
    reason: str = need(text)
    msg: str | None = opt(text)


@message("INSTALL_RING", DAEMON)
class InstallRing(WireMessage):
    req_id: int = numbered()
    ring_id: int = need(uint)
    edge_id: str = need(text)
    port_id: str = need(text)
    direction: str = need(one_of(*DIRECTIONS))
    layout: dict[str, Any] = need(LAYOUT)
    object_spec: dict[str, Any] = need(mapping)
    loaded_block: bool | None = opt(flag)  # extension gpuworker.loaded_block: completions as LOADED_BLOCK


# a ring's events name its edge and port (docs/architecture.md, 'Batched completions and out-of-band control')
@message("RING_INSTALLED", WORKER, ends=(InstallRing,))
class RingInstalled(WireMessage):
    req_id: int = need(uint)
    ring_id: int = need(uint)
    edge_id: str = need(text)
    port_id: str = need(text)


# a terminal reply to INSTALL_RING (with req_id) or a notification at any time (without)
@message("RING_FAULT", WORKER, ends=(InstallRing,))
class RingFault(WireMessage):
    ring_id: int = need(uint)
    edge_id: str = need(text)
    port_id: str = need(text)
    reason: str = need(text)
    req_id: int | None = opt(uint)
    msg: str | None = opt(text)


# a request (with req_id) or, while a step may be blocked on the ring, a notification (without)
@message("UNINSTALL_RING", DAEMON)
class UninstallRing(WireMessage):
    ring_id: int = need(uint)
    reason: str = need(one_of(*UNINSTALL_REASONS))
    req_id: int | None = opt(uint)


@message("RING_QUIESCED", WORKER, ends=(UninstallRing,))
class RingQuiesced(WireMessage):
    ring_id: int = need(uint)
    req_id: int | None = opt(uint)


@message("EXECUTE_STEP", DAEMON, serves=True)
class ExecuteStep(WireMessage):
    req_id: int = numbered()
    role_id: str = need(text)
    step_id: int = need(uint)
    inputs: list[dict[str, Any]] = need(list_of(STEP_INPUT))
    outputs: list[dict[str, Any]] = need(list_of(STEP_OUTPUT))
    runtime: dict[str, Any] = need(mapping)
    release_inputs_after: bool = need(flag)


@message("OBJECT_PRODUCED", WORKER, precedes=(ExecuteStep,))
class ObjectProduced(WireMessage):
    req_id: int = need(uint)
    ring_id: int = need(uint)
    port_id: str = need(text)
    object_id: int = need(uint)
    sequence: int = need(uint)
    extent: int = need(uint)


@message("STEP_COMPLETED", WORKER, ends=(ExecuteStep,))
class StepCompleted(WireMessage):
    req_id: int = need(uint)
    role_id: str = need(text)
    step_id: int = need(uint)


@message("STEP_FAILED", WORKER, ends=(ExecuteStep,), fails=True)
class StepFailed(WireMessage):
    req_id: int = need(uint)
    role_id: str = need(text)
    step_id: int = need(uint)
    reason: str = need(text)
    msg: str | None = opt(text)


@message("RELEASE_DEVICE_OBJECT", DAEMON)
class ReleaseDeviceObject(WireMessage):
    req_id: int = numbered()
    device_handle: dict[str, Any] = need(HANDLE)


@message("DEVICE_OBJECT_RELEASED", WORKER, ends=(ReleaseDeviceObject,))
class DeviceObjectReleased(WireMessage):
    req_id: int = need(uint)
    device_handle: dict[str, Any] = need(HANDLE)


@message("RELEASE_FAILED", WORKER, ends=(ReleaseDeviceObject,), fails=True)
class ReleaseFailed(WireMessage):
    req_id: int = need(uint)
    reason: str = need(text)
    device_handle: dict[str, Any] | None = opt(HANDLE)
    msg: str | None = opt(text)


@message("OBJECT_LOADED", WORKER)
class ObjectLoaded(WireMessage):
    ring_id: int = need(uint)
    edge_id: str = need(text)
    port_id: str = need(text)
    object_id: int = need(uint)
    sequence: int = need(uint)
    extent: int = need(uint)
    device_handle: dict[str, Any] = need(HANDLE)


@message("OBJECTS_LOADED", WORKER)
class ObjectsLoaded(WireMessage):
    ring_id: int = need(uint)
    edge_id: str = need(text)
    port_id: str = need(text)
    worker_generation: int = need(uint)
    objects: list[list[int]] = need(_rows)  # a LoadedRow per object, as a list


@message("LOADED_BLOCK", WORKER)
class LoadedBlock(WireMessage):
    """OBJECTS_LOADED of a ring installed with loaded_block: its rows as the raw frame, LOADED_ROW_BYTES per
    object (four little-endian u64s, LoadedRow's columns), in stream order."""

    ring_id: int = need(uint)
    edge_id: str = need(text)
    port_id: str = need(text)
    worker_generation: int = need(uint)
    raw: bytes = raw_frame()


LOADED_ROW_BYTES = 32


@message("OBJECT_FAILED", WORKER)
class ObjectFailed(WireMessage):
    ring_id: int = need(uint)
    edge_id: str = need(text)
    port_id: str = need(text)
    reason: str = need(text)
    msg: str | None = opt(text)
    object_id: int | None = opt(uint)
    sequence: int | None = opt(uint)


RING_MESSAGES = collect(globals())
