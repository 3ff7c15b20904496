# cython: annotation_typing=False
# Annotations document the Python API; the typed checks below raise the domain errors instead.
"""MO01 object-record header codec and ObjectSpec validation (see docs/architecture.md, 'Object records').

The checks run in the order docs/architecture.md ('Object records') lists them, so a header with several faults always
reports the
same one: short buffer, magic, version, header_len, reserved, flags, then against the spec
extent <= max_extent, extent % alignment, and the sequence policy.
"""

from cpython.buffer cimport PyBUF_SIMPLE, PyBuffer_Release, PyObject_GetBuffer
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize
from libc.stdint cimport uint8_t, uint32_t, uint64_t

HEADER_LEN = MO01_HEADER_LEN
MAGIC = MO01_MAGIC
VERSION = MO01_VERSION
FLAG_END_OF_SEQUENCE = MO01_FLAG_END_OF_SEQUENCE
FLAG_BEGIN_SEQUENCE = MO01_FLAG_BEGIN_SEQUENCE
SEQUENCE_POLICIES = ("strict", "none")

_U64_MAX = 2**64 - 1
_WIRE_FIELDS = ("kind", "max_extent", "alignment", "dtype", "shape", "sequence_policy")

from cython_ring import errors as _errors_module


cdef object _errors():
    # the package's own exceptions (cython_ring.errors), which the trio shell raises and catches as they are
    return _errors_module


cdef object _err(str name, str message):
    return getattr(_errors(), name)(message)


def _u64(value: object, name: str, error: str) -> int:
    if type(value) is not int or not 0 <= value <= _U64_MAX:
        raise _err(error, f"{name} must be an integer in [0, 2**64), got {value!r}")
    return value


# Only called once a check has failed, so the error classes are imported only then.
cdef object _header_error(Mo01Status status, const Mo01Header* h, Py_ssize_t have):
    e = _errors()
    if status == MO01_SHORT:
        return e.HeaderMalformed(f"object header needs {MO01_HEADER_LEN} bytes, got {have}")
    if status == MO01_BAD_MAGIC:
        return e.HeaderMalformed(f"object header magic 0x{h.magic:08x}, expected 0x{MO01_MAGIC:08x} (MO01)")
    if status == MO01_BAD_VERSION:
        return e.UnsupportedObjectVersion(
            f"object header version {h.version} is not supported (expected {MO01_VERSION})")
    if status == MO01_BAD_HEADER_LEN:
        return e.HeaderMalformed(f"object header_len {h.header_len}, expected {MO01_HEADER_LEN}")
    if status == MO01_BAD_RESERVED:
        return e.HeaderMalformed(f"object header reserved field 0x{h.reserved:08x} is not zero")
    return e.HeaderMalformed(
        f"object header flags 0x{h.flags:08x} set unknown bits 0x{h.flags & ~(<uint32_t>MO01_FLAGS_KNOWN):08x}")


cdef object _spec_error(Mo01Status status, uint64_t object_id, uint64_t sequence, uint64_t extent,
                        ObjectSpec spec, uint64_t expected):
    e = _errors()
    if status == MO01_EXTENT_EXCEEDS_MAX:
        return e.ExtentExceedsMax(
            f"object {object_id} seq {sequence}: extent {extent} exceeds max_extent {spec.max_extent}")
    if status == MO01_EXTENT_ALIGNMENT:
        return e.ExtentAlignmentInvalid(
            f"object {object_id} seq {sequence}: extent {extent} is not a multiple of "
            f"alignment {spec.alignment}")
    return e.SequenceViolation(f"object {object_id}: sequence {sequence}, expected {expected}")


cdef class ObjectHeader:
    """A decoded, well-formed MO01 header (construction checks the same rules as decoding)."""

    def __init__(self, object_id: int, sequence: int, extent: int, flags: int = 0) -> None:
        self.object_id = _u64(object_id, "object_id", "HeaderMalformed")
        self.sequence = _u64(sequence, "sequence", "HeaderMalformed")
        self.extent = _u64(extent, "extent", "HeaderMalformed")
        if type(flags) is not int or not 0 <= flags <= MO01_FLAGS_KNOWN:
            raise _err("HeaderMalformed", f"object header flags {flags!r}: only END_OF_SEQUENCE (1) "
                                          f"and BEGIN_SEQUENCE (2) are defined")
        self.flags = flags

    @property
    def end_of_sequence(self) -> bool:
        return bool(self.flags & MO01_FLAG_END_OF_SEQUENCE)

    @property
    def begin_sequence(self) -> bool:
        return bool(self.flags & MO01_FLAG_BEGIN_SEQUENCE)

    def encode(self) -> bytes:
        out = PyBytes_FromStringAndSize(NULL, MO01_HEADER_LEN)
        mo01_pack(<uint8_t*>PyBytes_AS_STRING(out), self.object_id, self.sequence, self.extent, self.flags)
        return out

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ObjectHeader):
            return NotImplemented
        o = <ObjectHeader>other
        return (self.object_id == o.object_id and self.sequence == o.sequence and self.extent == o.extent
                and self.flags == o.flags)

    def __hash__(self) -> int:
        return hash((self.object_id, self.sequence, self.extent, self.flags))

    def __repr__(self) -> str:
        return (f"ObjectHeader(object_id={self.object_id}, sequence={self.sequence}, "
                f"extent={self.extent}, flags={self.flags})")


def encode_header(object_id: int, sequence: int, extent: int, flags: int = 0) -> bytes:
    """The 40 header bytes; bad flags or out-of-range integers raise HeaderMalformed."""
    return ObjectHeader(object_id, sequence, extent, flags).encode()


def decode_header(buffer: object) -> ObjectHeader:
    """Decode the header at the start of `buffer`; bytes past HEADER_LEN (the payload) are ignored.

    Any bytes-like input yields an ObjectHeader or raises an ObjectHeaderError subclass.
    """
    cdef Py_buffer view
    cdef Mo01Header h
    cdef Mo01Status status
    PyObject_GetBuffer(buffer, &view, PyBUF_SIMPLE)
    try:
        if view.len < MO01_HEADER_LEN:
            raise _header_error(MO01_SHORT, NULL, view.len)
        status = mo01_parse(<const uint8_t*>view.buf, &h)
    finally:
        PyBuffer_Release(&view)
    if status:
        raise _header_error(status, &h, MO01_HEADER_LEN)
    cdef ObjectHeader out = ObjectHeader.__new__(ObjectHeader)
    out.object_id = h.object_id
    out.sequence = h.sequence
    out.extent = h.extent
    out.flags = h.flags
    return out


def validate(ObjectHeader header not None, ObjectSpec spec not None, expected_sequence: int) -> None:
    """Check a decoded header against the spec: max extent, alignment, then the sequence policy."""
    if type(expected_sequence) is not int or not 0 <= expected_sequence <= _U64_MAX:
        raise ValueError(f"expected_sequence must be an integer in [0, 2**64), got {expected_sequence!r}")
    cdef uint64_t expected = expected_sequence
    cdef Mo01Status status = mo01_check(header.extent, header.sequence, spec.max_extent, spec.alignment,
                                        spec.strict, expected)
    if status:
        raise _spec_error(status, header.object_id, header.sequence, header.extent, spec, expected)


# Called by the ring drain on its (cold) failure path so both paths share one set of messages.
def _failure(raw: bytes, ObjectSpec spec, uint64_t expected) -> object:
    try:
        validate(decode_header(raw), spec, expected)
    except _errors().ObjectHeaderError as exc:
        return exc
    return None


def _spec_problem(kind: object, max_extent: object, alignment: object, dtype: object, shape: object,
                  sequence_policy: object) -> str | None:
    if type(kind) is not str or not kind:
        return f"object spec kind must be a non-empty string, got {kind!r}"
    if type(max_extent) is not int or not 0 <= max_extent <= _U64_MAX:
        return f"object spec max_extent must be an integer in [0, 2**64), got {max_extent!r}"
    if type(alignment) is not int or not 1 <= alignment <= _U64_MAX:
        return f"object spec alignment must be a positive integer, got {alignment!r}"
    if type(dtype) is not str or not dtype:
        return f"object spec dtype must be a non-empty string, got {dtype!r}"
    if not isinstance(shape, (tuple, list)) or any(type(d) is not int or d < 0 for d in shape):
        return f"object spec shape must be a sequence of non-negative integers, got {shape!r}"
    if sequence_policy not in SEQUENCE_POLICIES:
        return f"object spec sequence_policy must be one of {SEQUENCE_POLICIES}, got {sequence_policy!r}"
    return None


cdef class ObjectSpec:
    """The role-known validation contract of one ring (docs/architecture.md, 'Object records')."""

    def __init__(self, kind: str, max_extent: int, alignment: int, dtype: str, shape: tuple[int, ...],
                 sequence_policy: str = "strict") -> None:
        problem = _spec_problem(kind, max_extent, alignment, dtype, shape, sequence_policy)
        if problem:
            raise _err("SpecInvalid", problem)
        self.kind = kind
        self.max_extent = max_extent
        self.alignment = alignment
        self.dtype = dtype
        self.shape = tuple(shape)
        self.sequence_policy = sequence_policy
        self.strict = sequence_policy == "strict"

    @staticmethod
    def from_wire(wire: object) -> ObjectSpec:
        """Build from a control-message map; a missing, unknown or ill-typed field is MalformedMessage."""
        if not isinstance(wire, dict):
            raise _err("WireSpecInvalid", f"object_spec must be a map, got {type(wire).__name__}")
        missing = [k for k in _WIRE_FIELDS[:5] if k not in wire]
        if missing:
            raise _err("WireSpecInvalid", f"object_spec is missing {', '.join(missing)}")
        unknown = sorted(str(k) for k in wire if k not in _WIRE_FIELDS)
        if unknown:
            raise _err("WireSpecInvalid", f"object_spec has unknown fields {', '.join(unknown)}")
        args = (wire["kind"], wire["max_extent"], wire["alignment"], wire["dtype"], wire["shape"],
                wire.get("sequence_policy", "strict"))
        problem = _spec_problem(*args)
        if problem:
            raise _err("WireSpecInvalid", problem)
        return ObjectSpec(*args)

    def to_wire(self) -> dict[str, object]:
        return {"kind": self.kind, "max_extent": self.max_extent, "alignment": self.alignment,
                "dtype": self.dtype, "shape": list(self.shape), "sequence_policy": self.sequence_policy}

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ObjectSpec):
            return NotImplemented
        return self.to_wire() == (<ObjectSpec>other).to_wire()

    def __hash__(self) -> int:
        return hash((self.kind, self.max_extent, self.alignment, self.dtype, self.shape, self.sequence_policy))

    def __repr__(self) -> str:
        return (f"ObjectSpec(kind={self.kind!r}, max_extent={self.max_extent}, alignment={self.alignment}, "
                f"dtype={self.dtype!r}, shape={self.shape!r}, sequence_policy={self.sequence_policy!r})")
