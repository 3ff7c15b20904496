"""trio-gpuworker: supervise tinygrad worker processes from a trio node daemon."""

from ._config import LaneConfig, ModelConfig, QuarantinePolicy, RestartPolicy, SupervisorConfig, Windows
from ._errors import (
    BrokenWorkerError,
    ClosedSupervisorError,
    ConfigError,
    DeadlineExceeded,
    EngineCrashed,
    GpuWorkerError,
    InvalidRequest,
    LocalProtocolError,
    ModelNotFound,
    NoLaneAvailable,
    OverCapacity,
    ProtocolError,
    RemoteProtocolError,
    RequestTooLarge,
    WorkerError,
)
from .supervisor import LaneState, Supervisor

__all__ = [
    "BrokenWorkerError",
    "ClosedSupervisorError",
    "ConfigError",
    "DeadlineExceeded",
    "EngineCrashed",
    "GpuWorkerError",
    "InvalidRequest",
    "LaneConfig",
    "LaneState",
    "LocalProtocolError",
    "ModelConfig",
    "ModelNotFound",
    "NoLaneAvailable",
    "OverCapacity",
    "ProtocolError",
    "QuarantinePolicy",
    "RemoteProtocolError",
    "RequestTooLarge",
    "RestartPolicy",
    "Supervisor",
    "SupervisorConfig",
    "Windows",
    "WorkerError",
]
