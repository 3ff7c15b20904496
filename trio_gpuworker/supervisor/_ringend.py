"""The daemon's end of one ring: its lease, native state, pending completions and wake-up events."""

from __future__ import annotations

import collections
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import trio

from cython_ring import Completions, DestPool, ObjectSpec, Ring

from .. import _proto as wire  # its ObjectFailed and RingFault are the messages; _errors' the exceptions
from .._errors import ObjectFailed, RingFault
from ._arena import Lease
from ._lane import Lane


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
    # ingress completions in stream order: whole OBJECTS_LOADED batches (lists of [object_id, sequence, extent,
    # handle id] rows, or a LOADED_BLOCK's (n, 4) uint64 array of them; the first `taken` rows of the oldest
    # already handed out), or a message (OBJECT_FAILED / RING_FAULT, their classes). A batch lands, and is handed
    # on, without a Python step per row.
    events: collections.deque[Any] = field(default_factory=collections.deque)
    taken: int = 0
    event_ready: trio.Event = field(default_factory=trio.Event)
    steps: int = 0  # steps in flight that write to this egress ring: uninstalling it must not wait for them
    quiesced: trio.Event = field(default_factory=trio.Event)
    received: collections.deque[tuple[int, int, np.ndarray]] = field(default_factory=collections.deque)
    # egress destinations in the drain's pool (or taken by an object still arriving), oldest first, and the
    # drain's completion batch
    landing: collections.deque[np.ndarray] = field(default_factory=collections.deque)
    pool: DestPool = field(default_factory=lambda: DestPool(exact=True))
    batch: Completions = field(default_factory=Completions)
    released: bool = False
    bytes_moved: int = 0
    # (object_id, sequence) of objects written whole whose loader left before taking their completion: their rows
    # never reach a later loader, their device handles are released
    orphans: set[tuple[int, int]] = field(default_factory=set)

    @property
    def ring_id(self) -> int:
        return self.lease.ring_id

    def raise_if_faulted(self) -> None:
        if self.fault is not None:
            raise self.fault

    def fail(self, fault: RingFault) -> None:
        """Fault the end (the first fault stays) and wake every waiter on it, so each raises it."""
        self.fault = self.fault or fault
        self.hint.set()
        self.event_ready.set()

    def disown(self, objects: Iterable[tuple[int, int]] = ()) -> list[int]:
        """Add `objects` to the orphans, and take every orphan's completed row out of `events`: returns their handle
        ids (to release). The rows left keep their stream order."""
        self.orphans.update(objects)
        handles: list[int] = []
        kept: collections.deque[Any] = collections.deque()
        for i, batch in enumerate(self.events):
            if not isinstance(batch, list | np.ndarray):
                kept.append(batch)
                continue
            table = np.asarray(batch, np.uint64).reshape(-1, 4)[self.taken if i == 0 else 0:]
            orphaned = np.array([(int(o), int(q)) in self.orphans for o, q in table[:, :2].tolist()], bool)
            for o, q, _, h in table[orphaned].tolist():
                self.orphans.discard((o, q))
                handles.append(h)
            if len(rest := table[~orphaned]):
                kept.append(rest)
        self.events, self.taken = kept, 0
        return handles

    def take_rows(self, limit: int) -> list[list[int]] | np.ndarray:
        """Up to `limit` (> 0) completed rows, in stream order, from the oldest batch (a list, or an array for a
        LOADED_BLOCK); [] when none is there yet. A failure next in the stream raises ObjectFailed or RingFault."""
        if not self.events:
            return []
        batch = self.events[0]
        if not isinstance(batch, list | np.ndarray):  # an OBJECT_FAILED or RING_FAULT message
            self.events.popleft()
            error = ObjectFailed if isinstance(batch, wire.ObjectFailed) else RingFault
            raise error(batch.reason, batch.msg or "")
        start, stop = self.taken, min(len(batch), self.taken + limit)
        if stop == len(batch):
            self.events.popleft()
            self.taken = 0
        else:
            self.taken = stop
        return batch if start == 0 and stop == len(batch) else batch[start:stop]
