"""Named records the batch drain hands to Python (cython_ring._batch): one per loaded object, and one for the
event that stopped a drain for good. Plain NamedTuples, so they unpack like the drain's old tuples."""

from __future__ import annotations

from typing import NamedTuple


class Completion(NamedTuple):
    """An object whose every payload byte is in its destination and whose ring space is released."""

    object_id: int
    sequence: int
    extent: int
    flags: int


class DrainEnd(NamedTuple):
    """Why the stream stopped: kind "failed" (an ObjectFailure; the ring is faulted), "ring_fault" (cursors or
    state corrupt, or the peer faulted it) or "closed" (the producer closed it at an object boundary).
    object_id and sequence are None where the failing header could not be read."""

    kind: str
    code: str | None = None
    message: str | None = None
    object_id: int | None = None
    sequence: int | None = None

    def legacy(self) -> tuple[object, ...]:
        """The tuple drain_ingress has always returned for it."""
        if self.kind == "failed":
            return ("failed", self.code, self.message, self.object_id, self.sequence)
        if self.kind == "ring_fault":
            return ("ring_fault", self.code, self.message)
        return ("closed",)
