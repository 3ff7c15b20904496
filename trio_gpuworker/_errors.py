"""The one error hierarchy. Wire codes are the snake_case names of the reference taxonomies; each class carries the
HTTP status the daemon answers it with (`http_status`, 500 unless it says otherwise, and `http_headers()`), and a
worker's ERR codes map to theirs through `WORKER_CODE_STATUS` (docs/http-api.md, 'Errors').

The root `GpuWorkerError`, `ConfigError` and the ring errors live in `cython_ring.errors`, at the bottom, so the
native helper imports nothing of this package and its exceptions are this hierarchy's without any mapping."""

from __future__ import annotations

import math
from typing import Any

from cython_ring.errors import (
    ConfigError,
    ExtentAlignmentInvalid,
    ExtentExceedsMax,
    GpuWorkerError,
    HeaderMalformed,
    ObjectHeaderError,
    RingCorrupt,
    RingError,
    SequenceViolation,
    SpecInvalid,
    UnsupportedObjectVersion,
    UnsupportedRingVersion,
    WireSpecInvalid,
)

LOG_TAIL_WIRE_CHARS = 8 * 1024  # the last 8 KiB of a crashed worker's output reach the caller
SHOWN_CHARS = 64  # of a field name or value in an error: a body may carry any key
# A worker's ERR code -> the HTTP status of a request it ended: the caller's input was at fault (400), or the
# model cannot serve (503); any other code is the worker's failure (502, WorkerError.http_status).
WORKER_CODE_STATUS = {"invalid_request": 400, "grammar_unsupported": 400, "model_not_loaded": 400,
                      "unsupported_request": 400, "model_load_failed": 503}


def retry_after(seconds: float | None) -> dict[str, str]:
    """A Retry-After header of whole seconds, at least 1."""
    return {"retry-after": str(max(1, math.ceil(seconds or 0)))}


class CodedError(GpuWorkerError):
    """An error whose wire code varies per instance: `code` is a reason from one of the reference taxonomies and
    `message` says what happened. The base of every error that carries both."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


# --- protocol -------------------------------------------------------------------------------


class ProtocolError(GpuWorkerError):
    """The control protocol was broken."""

    code = "protocol_error"


class LocalProtocolError(ProtocolError):
    """We tried to send something the protocol does not allow (a bug on our side)."""


class OutgoingFrameTooLarge(LocalProtocolError):
    """A frame we were about to send exceeds the negotiated max_frame; nothing was written."""

    code = "request_too_large"


class RemoteProtocolError(ProtocolError):
    """The peer sent something the protocol does not allow."""


class FrameTooLarge(RemoteProtocolError):
    code = "frame_too_large"


class MalformedMessage(RemoteProtocolError):
    """Not CBOR, not a map, unknown type, or a missing or ill-typed field."""

    code = "malformed_control_message"


class UnexpectedFrame(RemoteProtocolError):
    """A frame arrived where the protocol does not allow one (raw frame missing, reply to nothing)."""

    code = "unexpected_frame"


class TruncatedStream(UnexpectedFrame):
    """The peer closed its end in the middle of a frame (or between a control map and its raw frame)."""

    code = "eof_mid_frame"


class HandshakeError(RemoteProtocolError):
    code = "handshake_failed"


class VersionMismatch(HandshakeError):
    code = "version_mismatch"


class NonceMismatch(HandshakeError):
    code = "nonce_mismatch"


class PidMismatch(HandshakeError):
    code = "pid_mismatch"


class RingAbiMismatch(HandshakeError):
    code = "ring_helper_abi_mismatch"


class ProgressViolation(RemoteProtocolError):
    """A PROGRESS frame named another request, did not increase, or moved its phase backwards."""

    code = "progress_violation"


# --- serving --------------------------------------------------------------------------------


class WorkerError(CodedError):
    """A request ended with ERR {code, msg}: the worker raises it to answer so, and the daemon raises it when it
    reads one. `str()` is "code: message", as callers have always seen it. Its HTTP status follows its code."""

    http_status = 502

    def __init__(self, code: str, message: str) -> None:
        super().__init__(code, message)
        self.http_status = WORKER_CODE_STATUS.get(code, WorkerError.http_status)

    def __str__(self) -> str:
        return f"{self.code}: {self.message}"


class EngineCrashed(GpuWorkerError):
    """The worker died, hung or broke the protocol while serving, or its lane is quarantined."""

    code = "engine_crashed"
    http_status = 503

    def __init__(
        self,
        message: str,
        *,
        lane_id: str,
        generation: int | None = None,
        cause: str = "crash",
        exit_code: int | None = None,
        signal: int | None = None,
        log_tail: str = "",
        quarantined: bool = False,
        cooldown_remaining_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.lane_id = lane_id
        self.generation = generation
        self.cause = cause
        self.exit_code = exit_code
        self.signal = signal
        self.log_tail = log_tail
        self.quarantined = quarantined
        self.cooldown_remaining_s = cooldown_remaining_s

    def http_headers(self) -> dict[str, str]:
        """Retry-After while the lane is quarantined: when its cooldown ends."""
        return retry_after(self.cooldown_remaining_s) if self.quarantined else {}

    def to_wire(self) -> dict[str, Any]:
        """The error as the HTTP API answers it: code, message, and the crash's detail."""
        detail: dict[str, Any] = {"lane_id": self.lane_id, "generation": self.generation, "cause": self.cause}
        if self.exit_code is not None:
            detail["exit_code"] = self.exit_code
        if self.signal is not None:
            detail["signal"] = self.signal
        if self.quarantined:
            detail["quarantined"] = True
            detail["cooldown_remaining_s"] = self.cooldown_remaining_s
        if self.log_tail:
            detail["log_tail"] = self.log_tail[-LOG_TAIL_WIRE_CHARS:]
        return {"code": self.code, "message": str(self), "detail": detail}


class DeadlineExceeded(GpuWorkerError, TimeoutError):
    """The caller's deadline passed; the worker keeps running and its reply is drained."""

    code = "deadline_exceeded"
    http_status = 504


class OverCapacity(GpuWorkerError):
    """The model's queue is over its byte budget right now; retry after `retry_after_s`."""

    code = "over_capacity"
    http_status = 429

    def __init__(self, message: str, *, model: str, queued_bytes: int, budget_bytes: int,
                 retry_after_s: float) -> None:
        super().__init__(message)
        self.model = model
        self.queued_bytes = queued_bytes
        self.budget_bytes = budget_bytes
        self.retry_after_s = retry_after_s

    def http_headers(self) -> dict[str, str]:
        """Retry-After: when a retry may find room."""
        return retry_after(self.retry_after_s)

    def to_wire(self) -> dict[str, Any]:
        """The error as the HTTP API answers it: code, message, and the queue's detail."""
        return {"code": self.code, "message": str(self),
                "detail": {"model": self.model, "queued_bytes": self.queued_bytes,
                           "budget_bytes": self.budget_bytes, "retry_after_s": self.retry_after_s}}


class ModelNotFound(GpuWorkerError, LookupError):
    """No model of that name is configured."""

    code = "model_not_found"
    http_status = 404


class InvalidRequest(GpuWorkerError, ValueError):
    """A caller's request is malformed or out of bounds."""

    code = "invalid_request"
    http_status = 400


class UnsupportedField(InvalidRequest):
    """A field (or a value of it) this daemon does not implement. `param` names it, as OpenAI's errors do."""

    code = "unsupported_field"

    def __init__(self, field: str, reason: str) -> None:
        self.param = field if len(field) <= SHOWN_CHARS else field[:SHOWN_CHARS] + "..."
        super().__init__(f"{self.param!r} {reason}")

    def to_wire(self) -> dict[str, Any]:
        return {**super().to_wire(), "param": self.param}


class GrammarRefused(UnsupportedField):
    """A grammar, JSON Schema or tool the grammar engine cannot compile: `param` names the field that carried it,
    the message what the engine refused (docs/http-api.md, 'Structured output'). Refused before any token."""

    code = "grammar_invalid"


class RequestTooLarge(InvalidRequest):
    """The request cannot fit the protocol's frames or the daemon's caps, however it is split."""

    code = "request_too_large"
    http_status = 413


class LaneNotFound(GpuWorkerError, LookupError):
    """No lane has this id."""

    code = "lane_not_found"
    http_status = 404


class NoLaneAvailable(GpuWorkerError):
    """No lane can serve the model now: none is configured for it, or every one is drained."""

    code = "no_lane_available"
    http_status = 503


class ModelLoading(NoLaneAvailable):
    """Every lane that serves the model is still in its first start (spawn, LOAD, compile): the daemon listens
    before its workers are ready, and a request for a model none of them serves yet is refused, not queued
    behind a load that may take minutes. Retry after `retry_after_s`."""

    code = "model_loading"

    def __init__(self, message: str, *, model: str, lanes: dict[str, Any], retry_after_s: float) -> None:
        super().__init__(message)
        self.model = model
        self.lanes = lanes  # lane id -> its start progress (phase, model, steps, elapsed_s)
        self.retry_after_s = retry_after_s

    def http_headers(self) -> dict[str, str]:
        """Retry-After: when a retry may find room."""
        return retry_after(self.retry_after_s)

    def to_wire(self) -> dict[str, Any]:
        """The error as the HTTP API answers it: code, message, and each lane's start progress."""
        return {"code": self.code, "message": str(self),
                "detail": {"model": self.model, "lanes": self.lanes, "retry_after_s": self.retry_after_s}}


class ModelLoadFailed(NoLaneAvailable):
    """The model's LOAD failed on every lane that serves it (an artifact the worker cannot read, a tensor type it
    does not support, ...): its requests are refused with the load errors until a reload fixes the model."""

    code = "model_load_failed"

    def __init__(self, message: str, *, model: str, lanes: dict[str, str]) -> None:
        super().__init__(message)
        self.model = model
        self.lanes = lanes  # lane id -> its LOAD's error, "code: message"

    def to_wire(self) -> dict[str, Any]:
        """The error as the HTTP API answers it: code, message, and each lane's LOAD error."""
        return {"code": self.code, "message": str(self), "detail": {"model": self.model, "lanes": self.lanes}}


class ClosedSupervisorError(GpuWorkerError):
    """We closed the supervisor (or lane); no more requests are accepted."""

    code = "shutting_down"
    http_status = 503


class BrokenWorkerError(GpuWorkerError):
    """The worker's connection broke under us (peer closed or OS error)."""

    code = "engine_crashed"


# --- data plane -----------------------------------------------------------------------------


class RingFault(CodedError):
    """A ring is unusable; `code` is the RingFaultReason (worker_process_exited, header_malformed, ...)."""


class ObjectFailed(CodedError):
    """The worker refused an ingress object; `code` is the ObjectFailure name."""


class StepFailed(CodedError):
    """A step, role or release request failed; `code` is the StepFailure / RoleFailure / ReleaseFailure name. The
    worker's roles raise it too (invalid_role_config, tinygrad_error, device_out_of_memory, ...)."""


class StaleHandle(StepFailed):
    """A device handle of another worker generation (so of another lane, or of a dead worker): it never resolves.
    `code` is invalid_input_handle (a step's input) or invalid_device_handle (a release)."""


class ArenaMapFailed(GpuWorkerError):
    """The worker could not map the arena it was handed (WorkerFatalReason)."""

    code = "arena_map_failed"


# --- arena leases -----------------------------------------------------------------------------


class ArenaError(GpuWorkerError):
    """Root of the arena's errors."""

    code = "arena_error"


class InvalidLeaseRequest(ArenaError, ValueError):
    """Capacity not a positive multiple of 64, or an ill-typed argument."""

    code = "invalid_lease_request"


class LeaseRejected(ArenaError):
    """The ring could never fit this arena, however many leases are released."""

    code = "lease_rejected"


class QuiescenceUnproven(ArenaError):
    """A release came without a valid quiescence proof; the lease is kept."""

    code = "quiescence_unproven"


class LeaseStateError(ArenaError):
    """The lease is released already, was installed already, or belongs to another arena."""

    code = "lease_state_invalid"


class ArenaBusy(ArenaError):
    """The arena cannot close while leases are live (or its mapping is still exported)."""

    code = "arena_busy"


class ClosedArenaError(ArenaError):
    """We closed the arena; it mints no more leases."""

    code = "shutting_down"


__all__ = [
    "LOG_TAIL_WIRE_CHARS",
    "SHOWN_CHARS",
    "WORKER_CODE_STATUS",
    "ArenaBusy",
    "ArenaError",
    "ArenaMapFailed",
    "BrokenWorkerError",
    "ClosedArenaError",
    "ClosedSupervisorError",
    "CodedError",
    "ConfigError",
    "DeadlineExceeded",
    "EngineCrashed",
    "ExtentAlignmentInvalid",
    "ExtentExceedsMax",
    "FrameTooLarge",
    "GpuWorkerError",
    "GrammarRefused",
    "HandshakeError",
    "HeaderMalformed",
    "InvalidLeaseRequest",
    "InvalidRequest",
    "LaneNotFound",
    "LeaseRejected",
    "LeaseStateError",
    "LocalProtocolError",
    "MalformedMessage",
    "ModelLoading",
    "ModelNotFound",
    "NoLaneAvailable",
    "NonceMismatch",
    "ObjectFailed",
    "ObjectHeaderError",
    "OutgoingFrameTooLarge",
    "OverCapacity",
    "PidMismatch",
    "ProgressViolation",
    "ProtocolError",
    "QuiescenceUnproven",
    "RemoteProtocolError",
    "RequestTooLarge",
    "RingAbiMismatch",
    "RingCorrupt",
    "RingError",
    "RingFault",
    "SequenceViolation",
    "SpecInvalid",
    "StaleHandle",
    "StepFailed",
    "TruncatedStream",
    "UnexpectedFrame",
    "UnsupportedField",
    "UnsupportedObjectVersion",
    "UnsupportedRingVersion",
    "VersionMismatch",
    "WireSpecInvalid",
    "WorkerError",
    "retry_after",
]
