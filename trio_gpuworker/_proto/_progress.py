"""PROGRESS validation: the current request, strictly increasing counts, phases only forward."""

from __future__ import annotations

from .._errors import ProgressViolation
from ._messages import Progress
from ._schema import PHASES

_RANK = {p: i for i, p in enumerate(PHASES)}


class ProgressValidator:
    """One per request. `accept` returns the phase now in force, or raises ProgressViolation."""

    def __init__(self, req_id: int, phase: str) -> None:
        self.req_id = req_id
        self.phase = phase
        self.completed: int | None = None

    def accept(self, msg: Progress) -> str:
        if msg.req_id != self.req_id:
            raise ProgressViolation(f"PROGRESS for req_id {msg.req_id} while {self.req_id} is current")
        if self.completed is not None and msg.completed <= self.completed:
            raise ProgressViolation(f"PROGRESS completed {msg.completed} does not exceed {self.completed}")
        if _RANK[msg.phase] < _RANK[self.phase]:
            raise ProgressViolation(f"PROGRESS phase moved back from {self.phase} to {msg.phase}")
        self.completed, self.phase = msg.completed, msg.phase
        return self.phase
