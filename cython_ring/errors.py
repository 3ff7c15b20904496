"""The native helper's own exceptions: ValueError subclasses carrying the wire `code` of the reference
taxonomies. The package depends on nothing above it; the trio shell maps these to its error
hierarchy (trio_gpuworker._errors.from_native)."""

from __future__ import annotations


class RingError(ValueError):
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


class SpecInvalid(RingError):
    """An ObjectSpec built from bad arguments (a configuration error)."""

    code = "config_invalid"


class WireSpecInvalid(SpecInvalid):
    """An object_spec map from a control message is missing, unknown or ill-typed."""

    code = "malformed_control_message"


__all__ = ["ExtentAlignmentInvalid", "ExtentExceedsMax", "HeaderMalformed", "ObjectHeaderError", "RingCorrupt",
           "RingError", "SequenceViolation", "SpecInvalid", "UnsupportedObjectVersion", "UnsupportedRingVersion",
           "WireSpecInvalid"]
