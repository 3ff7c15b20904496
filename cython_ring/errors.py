"""The native helper's own exceptions, and the root of the whole error family.

`GpuWorkerError` is defined here, at the bottom, so that this package imports nothing above it and its errors are
still the trio shell's: `trio_gpuworker._errors` builds on this root and re-exports these classes. Like msgpack's
`FormatError(ValueError, UnpackException)`, each native error is both a `ValueError` and a `GpuWorkerError`, and
carries the wire `code` of the reference taxonomies and the HTTP status the daemon answers it with (`http_status`,
docs/http-api.md, 'Errors')."""

from __future__ import annotations

from typing import Any


class GpuWorkerError(Exception):
    """Root of every error trio_gpuworker and cython_ring raise."""

    code: str = "internal"
    http_status: int = 500

    def to_wire(self) -> dict[str, Any]:
        """The error as the HTTP API answers it: its wire code and message."""
        return {"code": self.code, "message": str(self)}

    def http_headers(self) -> dict[str, str]:
        """The headers an HTTP answer with this error carries (Retry-After, ...)."""
        return {}


class ConfigError(GpuWorkerError, ValueError):
    """A configuration key or value is invalid; the message names the key."""

    code = "config_invalid"
    http_status = 400


class RingError(GpuWorkerError, ValueError):
    """A ring cannot be used as asked (released, closed, faulted, an abandoned partial object)."""

    code = "worker_internal"


class RingCorrupt(RingError):
    """A ring header or cursor pair violates the ABI (bad magic, capacity, cursors, state)."""

    code = "ring_layout_invalid"


class UnsupportedRingVersion(RingCorrupt):
    """The ring header names an ABI version this helper does not speak."""

    code = "unsupported_ring_version"


class ObjectHeaderError(RingError):
    """An MO01 object record header failed validation; `code` is the ObjectFailure name."""

    code = "header_malformed"


class HeaderMalformed(ObjectHeaderError):
    code = "header_malformed"


class UnsupportedObjectVersion(ObjectHeaderError):
    code = "unsupported_object_version"


class ExtentExceedsMax(ObjectHeaderError):
    code = "extent_exceeds_max"


class ExtentAlignmentInvalid(ObjectHeaderError):
    code = "extent_alignment_invalid"


class SequenceViolation(ObjectHeaderError):
    code = "sequence_violation"


class SpecInvalid(RingError, ConfigError):
    """An ObjectSpec built from bad arguments (a configuration error)."""

    code = "config_invalid"


class WireSpecInvalid(SpecInvalid):
    """An object_spec map from a control message is missing, unknown or ill-typed."""

    code = "malformed_control_message"


__all__ = ["ConfigError", "ExtentAlignmentInvalid", "ExtentExceedsMax", "GpuWorkerError", "HeaderMalformed",
           "ObjectHeaderError", "RingCorrupt", "RingError", "SequenceViolation", "SpecInvalid",
           "UnsupportedObjectVersion", "UnsupportedRingVersion", "WireSpecInvalid"]
