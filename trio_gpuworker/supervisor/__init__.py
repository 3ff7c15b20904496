"""The trio shell around _proto: lanes, supervisor, spawn/kill, log ring, event bus, routing, admission,
batching and the daemon-side data plane. What it exports here is what the daemon and `trio_gpuworker.testing`
build on, not an API: a program of one's own uses `trio_gpuworker`."""

from .._proto import SERVING_STATES, LaneState
from ._admission import Router, Scheduler, Ticket
from ._arena import ArenaManager
from ._batching import Batcher
from ._dataplane import DataPlane, RingEnd
from ._events import EventBus
from ._gate import ModelGate
from ._genbatch import Packer, packer_for
from ._jobs import Job, LaneSettings, LoadSpec
from ._lane import Lane
from ._launcher import Launched, Launcher, ProcessLauncher, WorkerSpec
from ._logring import LogRing
from ._models import DigestCache, load_spec
from ._startup import MODEL_LOADING_RETRY_AFTER_S, FirstStart, describe_progress
from ._supervisor import Supervisor

__all__ = [
           "MODEL_LOADING_RETRY_AFTER_S",
           "SERVING_STATES",
           "ArenaManager",
           "Batcher",
           "DataPlane",
           "DigestCache",
           "EventBus",
           "FirstStart",
           "Job",
           "Lane",
           "LaneSettings",
           "LaneState",
           "Launched",
           "Launcher",
           "LoadSpec",
           "LogRing",
           "ModelGate",
           "Packer",
           "ProcessLauncher",
           "RingEnd",
           "Router",
           "Scheduler",
           "Supervisor",
           "Ticket",
           "WorkerSpec",
           "describe_progress",
           "load_spec",
           "packer_for",
]
