"""Every error carries the HTTP status the daemon answers it with (docs/http-api.md, 'Errors'), and the statuses
are the ones the HTTP API has always given: pinned here per class, per worker ERR code and per Retry-After."""

from __future__ import annotations

import importlib
import pkgutil

import pytest

import trio_gpuworker
from trio_gpuworker._errors import (
    WORKER_CODE_STATUS,
    EngineCrashed,
    GpuWorkerError,
    InvalidRequest,
    ModelLoading,
    OverCapacity,
    RequestTooLarge,
    UnsupportedField,
    WorkerError,
)
from trio_gpuworker.daemon.http_common import HttpError, error_body

# The status of every error class, as the daemon's HTTP layer mapped them when statuses still lived there.
STATUS = {
    "ArenaBusy": 500, "ArenaError": 500, "ArenaMapFailed": 500, "BrokenWorkerError": 500, "CacheEntryInvalid": 500,
    "ClosedArenaError": 500, "ClosedSupervisorError": 503, "CodedError": 500, "ConfigError": 400,
    "DataPlaneError": 500, "DeadlineExceeded": 504, "DeviceError": 500, "DeviceRangeError": 500,
    "EngineCrashed": 503, "ExtentAlignmentInvalid": 500, "ExtentExceedsMax": 500, "FrameTooLarge": 500,
    "GpuWorkerError": 500, "GrammarRefused": 400, "HandshakeError": 500, "HeaderMalformed": 500,
    "InvalidLeaseRequest": 500,
    "InvalidRequest": 400, "LaneNotFound": 404, "LeaseRejected": 500, "LeaseStateError": 500, "LifecycleError": 500,
    "LocalProtocolError": 500, "MalformedMessage": 500, "ModelLoadFailed": 503, "ModelLoading": 503,
    "ModelNotFound": 404, "NoLaneAvailable": 503, "NonceMismatch": 500, "ObjectFailed": 500,
    "ObjectHeaderError": 500, "OutgoingFrameTooLarge": 500, "OverCapacity": 429, "PidMismatch": 500,
    "ProgressViolation": 500, "ProtocolError": 500, "QuiescenceUnproven": 500, "RemoteProtocolError": 500,
    "RequestTooLarge": 413, "RingAbiMismatch": 500, "RingCorrupt": 500, "RingError": 500, "RingFault": 500,
    "SequenceViolation": 500, "SpecInvalid": 400, "StaleHandle": 500, "StepFailed": 500, "TruncatedStream": 500,
    "UnexpectedFrame": 500, "UnsupportedField": 400, "UnsupportedObjectVersion": 500, "UnsupportedRingVersion": 500,
    "VersionMismatch": 500,
    "WireSpecInvalid": 400, "WorkerError": 502,
}
# A worker's ERR code -> the status of the request it ended (any other code: 502)
WORKER_STATUS = {"invalid_request": 400, "grammar_unsupported": 400, "model_not_loaded": 400,
                 "unsupported_request": 400, "model_load_failed": 503, "tinygrad_error": 502, "oom": 502,
                 "request_cancelled": 502, "worker_shutting_down": 502}


def error_classes() -> set[type[GpuWorkerError]]:
    for module in pkgutil.walk_packages(trio_gpuworker.__path__, "trio_gpuworker."):
        importlib.import_module(module.name)
    found, todo = set(), [GpuWorkerError]
    while todo:
        cls = todo.pop()
        found.add(cls)
        todo += cls.__subclasses__()
    return found


def test_every_error_class_carries_its_status() -> None:
    classes = {cls for cls in error_classes() if not issubclass(cls, HttpError)}  # the HTTP layer's: per instance
    assert {cls.__qualname__ for cls in classes} == set(STATUS)
    for cls in classes:
        assert isinstance(cls.http_status, int), cls
        assert cls.http_status == STATUS[cls.__qualname__], cls
        assert cls.code, cls


def test_worker_codes_map_through_one_table() -> None:
    for code, status in WORKER_STATUS.items():
        err = WorkerError(code, "why")
        assert err.http_status == status, code
        assert err.http_headers() == {}
    assert {c for c, s in WORKER_STATUS.items() if s != 502} == set(WORKER_CODE_STATUS)


@pytest.mark.parametrize(("error", "headers"), [
    (ModelLoading("loading", model="m", lanes={}, retry_after_s=2.2), {"retry-after": "3"}),
    (OverCapacity("full", model="m", queued_bytes=9, budget_bytes=8, retry_after_s=0.2), {"retry-after": "1"}),
    (EngineCrashed("down", lane_id="a", quarantined=True, cooldown_remaining_s=3.5), {"retry-after": "4"}),
    (EngineCrashed("down", lane_id="a", quarantined=True, cooldown_remaining_s=None), {"retry-after": "1"}),
    (EngineCrashed("down", lane_id="a"), {}),
    (InvalidRequest("bad"), {}),
])
def test_retry_after_headers(error: GpuWorkerError, headers: dict[str, str]) -> None:
    assert error.http_headers() == headers


def test_http_layer_errors_carry_their_own_status() -> None:
    err = HttpError(405, "method_not_allowed", "no", {"allow": "GET"})
    assert (err.http_status, err.http_headers(), err.code) == (405, {"allow": "GET"}, "method_not_allowed")
    like = HttpError.like(RequestTooLarge, "too big", {"connection": "close"})
    assert (like.http_status, like.code, like.http_headers()) == (413, "request_too_large", {"connection": "close"})
    field = UnsupportedField("n", "= 2 is not supported")
    assert field.http_status == 400 and error_body(field)["error"]["param"] == "n"
    # OpenAI's four fields, always present: the openai client reads `e.type`, `e.param`, `e.code`
    assert error_body(WorkerError("oom", "out of memory")) == {"error": {
        "code": "oom", "message": "oom: out of memory", "type": "server_error", "param": None}}
    assert error_body(InvalidRequest("bad"))["error"]["type"] == "invalid_request_error"
