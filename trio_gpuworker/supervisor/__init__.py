"""The trio shell around _proto: lanes, supervisor, spawn/kill, log ring, event bus."""

from ._arena import ArenaManager
from ._dataplane import DataPlane, RingEnd
from ._events import EventBus
from ._jobs import Job, LaneState, LoadSpec
from ._lane import Lane
from ._logring import LogRing
from ._supervisor import Supervisor

__all__ = ["ArenaManager", "DataPlane", "EventBus", "Job", "Lane", "LaneState", "LoadSpec", "LogRing", "RingEnd",
           "Supervisor"]
