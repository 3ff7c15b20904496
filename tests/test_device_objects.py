"""The worker's device-object table: a CPU drain's batch goes in as one run, and each object's record and allocation
are made once, when first read; a released handle is gone and its memory goes back to the bridge's pool."""

from __future__ import annotations

import ctypes

import pytest

from trio_gpuworker.worker._bridge import DeviceBridge
from trio_gpuworker.worker._objects import DeviceObjects, LoadedRun


def test_a_run_makes_each_record_once_and_releases_by_handle() -> None:
    bridge = DeviceBridge()
    buffers, addresses = bridge.alloc_mapped_many(16, 3)
    for k, address in enumerate(addresses.tolist()):
        ctypes.memset(address, k + 1, 16)
    objects = DeviceObjects()
    objects.add_run(LoadedRun(7, list(buffers), [40, 41, 42], 16, "float32", (4,), 3, bridge.adopt))
    assert sorted(objects) == [7, 8, 9] and 6 not in objects and objects.get(10) is None
    first = objects[8]
    assert objects[8] is first and objects.get(8) is first  # made once
    assert (first.object_id, first.shape, first.dtype, first.ring_id) == (41, (4,), "float32", 3)
    assert ctypes.string_at(bridge.host_address(first.alloc), 16) == b"\x02" * 16
    popped = objects.pop(9)
    assert popped.object_id == 42 and 9 not in objects and objects.pop(9, None) is None
    with pytest.raises(KeyError):
        objects.pop(9)
    bridge.free_device(popped.alloc)
    rest = objects.values()
    assert [o.object_id for o in rest] == [40, 41] and rest[1] is first
    for obj in rest:
        bridge.free_device(obj.alloc)
    again, _ = bridge.alloc_mapped_many(16, 5)  # the three buffers came back to the pool: only they go out
    assert len(again) == 3 and {id(b) for b in again} == {id(b) for b in buffers}
    for buf in again:
        bridge.free_device(bridge.adopt(16, buf))
