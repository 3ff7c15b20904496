"""The worker's live device objects by handle id. A CPU drain's batch goes in as one run (its buffers and columns,
referenced from every handle of the batch), and an object's record and allocation are made when it is first read,
by a step or its release: a drain runs no Python per object."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from itertools import repeat
from typing import Any, NamedTuple


class DeviceObject(NamedTuple):
    """A live device object: its allocation (a DeviceAlloc), how a step views it, and where it came from."""

    alloc: Any
    dtype: str
    shape: tuple[int, ...]
    ring_id: int
    object_id: int


@dataclass(eq=False, slots=True)
class LoadedRun:
    """The objects one drain call loaded, handle ids from `first` on, in order: all of one extent (its pool
    holds destinations of one size)."""

    first: int
    buffers: list[Any]  # each becomes the object's allocation through `adopt`; None once it has
    object_ids: list[int]
    nbytes: int
    dtype: str
    shape: tuple[int, ...]
    ring_id: int
    adopt: Callable[[int, Any], Any]  # DeviceBridge.adopt


class DeviceObjects(dict[int, Any]):
    """handle id -> DeviceObject, as a dict whose reads make a run's records on demand. Both worker threads read
    it (the event loop plans a host echo); a record is made once, under a lock."""

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()

    def add_run(self, run: LoadedRun) -> None:
        self.update(zip(range(run.first, run.first + len(run.buffers)), repeat(run)))

    def _made(self, handle: int, value: Any) -> DeviceObject:
        if type(value) is not LoadedRun:
            return value
        with self._lock:
            value = dict.get(self, handle)
            if type(value) is LoadedRun:
                value = self._record(handle, value)
                dict.__setitem__(self, handle, value)
        return value

    @staticmethod
    def _record(handle: int, run: LoadedRun) -> DeviceObject:
        k = handle - run.first
        buf, run.buffers[k] = run.buffers[k], None
        return DeviceObject(run.adopt(run.nbytes, buf), run.dtype, run.shape, run.ring_id, run.object_ids[k])

    def __getitem__(self, handle: int) -> DeviceObject:
        return self._made(handle, dict.__getitem__(self, handle))

    def get(self, handle: int, default: Any = None) -> Any:  # type: ignore[override]
        value = dict.get(self, handle)
        return default if value is None else self._made(handle, value)

    def pop(self, handle: int, *default: Any) -> Any:  # type: ignore[override]
        """Removed first, so no other reader can make its record meanwhile; made here only if it was not yet."""
        value = dict.pop(self, handle, *default)
        return self._record(handle, value) if type(value) is LoadedRun else value

    def values(self) -> list[DeviceObject]:  # type: ignore[override]
        return [self[h] for h in list(self)]
