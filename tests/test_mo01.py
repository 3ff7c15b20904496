"""MO01 object-record header codec (docs/architecture.md, 'Object records'): vector, every truncation, field order,
fuzz."""

from __future__ import annotations

import mmap
import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

import trio_gpuworker._errors as shell
from cython_ring import (
    FLAG_BEGIN_SEQUENCE,
    FLAG_END_OF_SEQUENCE,
    HEADER_LEN,
    MAGIC,
    VERSION,
    ObjectHeader,
    ObjectSpec,
    decode_header,
    encode_header,
    validate,
)
from cython_ring import errors as native
from cython_ring.errors import (
    ExtentAlignmentInvalid,
    ExtentExceedsMax,
    HeaderMalformed,
    ObjectHeaderError,
    SequenceViolation,
    SpecInvalid,
    UnsupportedObjectVersion,
    WireSpecInvalid,
)
from trio_gpuworker._errors import ConfigError, GpuWorkerError

VECTOR_HEX = "4d4f3031 0100 2800 2823000000000000 0000000000000000 0800000000000000 00000000 00000000"
VECTOR = bytes.fromhex(VECTOR_HEX.replace(" ", ""))
U64 = st.integers(0, 2**64 - 1)


def raw(magic: int = MAGIC, version: int = VERSION, header_len: int = HEADER_LEN, object_id: int = 9000,
        sequence: int = 0, extent: int = 8, flags: int = 0, reserved: int = 0) -> bytes:
    return struct.pack("<IHHQQQII", magic, version, header_len, object_id, sequence, extent, flags, reserved)


def spec(max_extent: int = 1 << 20, alignment: int = 8, policy: str = "strict") -> ObjectSpec:
    return ObjectSpec("tensor", max_extent, alignment, "float32", (2, 4), policy)


def test_constants() -> None:
    assert (HEADER_LEN, MAGIC, VERSION, FLAG_END_OF_SEQUENCE, FLAG_BEGIN_SEQUENCE) == (40, 0x31304F4D, 1, 1, 2)
    assert struct.pack("<I", MAGIC) == b"MO01"


def test_vector_encodes_exactly() -> None:
    assert encode_header(9000, 0, 8, 0) == VECTOR == raw()
    assert len(VECTOR) == HEADER_LEN


def test_vector_decodes() -> None:
    h = decode_header(VECTOR)
    assert (h.object_id, h.sequence, h.extent, h.flags) == (9000, 0, 8, 0)
    assert h == ObjectHeader(9000, 0, 8) and h.encode() == VECTOR
    assert not h.end_of_sequence and not h.begin_sequence


@pytest.mark.parametrize("kind", [bytes, bytearray, memoryview])
def test_decode_accepts_any_bytes_like(kind: type) -> None:
    assert decode_header(kind(VECTOR)).object_id == 9000


def test_decode_from_mmap() -> None:
    with mmap.mmap(-1, 4096) as m:
        m[:HEADER_LEN] = VECTOR
        assert decode_header(m).extent == 8


@pytest.mark.parametrize("length", range(HEADER_LEN))
def test_every_truncation_is_malformed(length: int) -> None:
    with pytest.raises(HeaderMalformed, match=f"needs 40 bytes, got {length}"):
        decode_header(VECTOR[:length])


@pytest.mark.parametrize("trailing", [b"\x00", b"payload!", bytes(4096)])
def test_trailing_bytes_are_the_payload(trailing: bytes) -> None:
    assert decode_header(VECTOR + trailing) == decode_header(VECTOR)


@pytest.mark.parametrize(
    ("fields", "error", "match"),
    [
        ({"magic": 0x31304F4E}, HeaderMalformed, "magic"),
        ({"version": 2}, UnsupportedObjectVersion, "version 2"),
        ({"version": 0}, UnsupportedObjectVersion, "version 0"),
        ({"header_len": 48}, HeaderMalformed, "header_len 48"),
        ({"reserved": 1}, HeaderMalformed, "reserved"),
        ({"flags": 4}, HeaderMalformed, "unknown bits 0x00000004"),
        ({"flags": 0x80000001}, HeaderMalformed, "unknown bits 0x80000000"),
    ],
)
def test_each_field_fault(fields: dict[str, int], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match) as info:
        decode_header(raw(**fields))
    assert type(info.value) is error


def test_faults_reported_in_section6_order() -> None:
    # magic, version, header_len, reserved, flags: each fault hides every later one.
    order = [("magic", 0, HeaderMalformed), ("version", 9, UnsupportedObjectVersion),
             ("header_len", 0, HeaderMalformed), ("reserved", 7, HeaderMalformed),
             ("flags", 8, HeaderMalformed)]
    for i, (name, _, error) in enumerate(order):
        fields = {n: v for n, v, _ in order[i:]}
        with pytest.raises(error) as info:
            decode_header(raw(**fields))
        assert name in str(info.value)


@pytest.mark.parametrize("flags", [0, FLAG_END_OF_SEQUENCE, FLAG_BEGIN_SEQUENCE, 3])
def test_known_flags(flags: int) -> None:
    h = decode_header(encode_header(1, 2, 3, flags))
    assert h.flags == flags
    assert h.end_of_sequence == bool(flags & 1) and h.begin_sequence == bool(flags & 2)


@pytest.mark.parametrize(
    "args", [(0, 0, 0, 4), (0, 0, 0, -1), (-1, 0, 0), (0, 2**64, 0), (0, 0, 1.0), (0, 0, 0, True), ("1", 0, 0)]
)
def test_encode_rejects_bad_arguments(args: tuple[object, ...]) -> None:
    with pytest.raises(HeaderMalformed):
        encode_header(*args)
    assert issubclass(HeaderMalformed, ValueError)


def test_error_codes_are_object_failure_names() -> None:
    assert [e.code for e in (HeaderMalformed, UnsupportedObjectVersion, ExtentExceedsMax,
                             ExtentAlignmentInvalid, SequenceViolation)] == [
        "header_malformed", "unsupported_object_version", "extent_exceeds_max",
        "extent_alignment_invalid", "sequence_violation"]


@pytest.mark.parametrize("name", sorted(set(native.__all__) - {"GpuWorkerError"}))
def test_native_errors_are_the_shells(name: str) -> None:
    """One family: every native error is a ValueError and a GpuWorkerError, and the shell raises the same class."""
    cls = getattr(native, name)
    assert issubclass(cls, ValueError) and issubclass(cls, GpuWorkerError)
    assert getattr(shell, name) is cls


@given(U64, U64, U64, st.integers(0, 3), st.binary(max_size=64))
def test_roundtrip(object_id: int, sequence: int, extent: int, flags: int, tail: bytes) -> None:
    h = decode_header(encode_header(object_id, sequence, extent, flags) + tail)
    assert (h.object_id, h.sequence, h.extent, h.flags) == (object_id, sequence, extent, flags)


@given(st.binary(max_size=96))
def test_fuzz_random_bytes(data: bytes) -> None:
    try:
        h = decode_header(data)
    except ObjectHeaderError:
        return
    assert data[:8] == raw()[:8] and h.encode() == data[:HEADER_LEN]


@given(st.lists(st.tuples(st.integers(0, HEADER_LEN - 1), st.integers(0, 255)), max_size=6),
       st.integers(0, HEADER_LEN + 8))
def test_fuzz_mutated_vector(edits: list[tuple[int, int]], cut: int) -> None:
    data = bytearray(VECTOR + b"tail")
    for pos, value in edits:
        data[pos] = value
    try:
        h = decode_header(bytes(data[:cut]))
    except ObjectHeaderError:
        return
    assert h.encode() == bytes(data[:HEADER_LEN])


# --- validation against the ObjectSpec --------------------------------------------------------


def test_validate_accepts() -> None:
    validate(ObjectHeader(1, 0, 64), spec(max_extent=64), 0)
    validate(ObjectHeader(1, 0, 0), spec(max_extent=0), 0)


def test_extent_exceeds_max_first() -> None:
    # Too large, misaligned and out of sequence: the extent bound is reported.
    with pytest.raises(ExtentExceedsMax, match="extent 65 exceeds max_extent 64"):
        validate(ObjectHeader(1, 5, 65), spec(max_extent=64), 0)


def test_alignment_before_sequence() -> None:
    with pytest.raises(ExtentAlignmentInvalid, match="alignment 8"):
        validate(ObjectHeader(1, 5, 12), spec(), 0)


def test_strict_sequence() -> None:
    with pytest.raises(SequenceViolation, match="sequence 5, expected 4"):
        validate(ObjectHeader(1, 5, 16), spec(), 4)
    validate(ObjectHeader(1, 5, 16), spec(), 5)


def test_policy_none_ignores_sequence() -> None:
    validate(ObjectHeader(1, 99, 16), spec(policy="none"), 0)


@given(U64, U64, st.integers(0, 2**20), st.integers(1, 4096), st.integers(0, 2**20), U64)
def test_validate_matches_model(sequence: int, expected: int, extent: int, alignment: int,
                                max_extent: int, object_id: int) -> None:
    want: type[Exception] | None = None
    if extent > max_extent:
        want = ExtentExceedsMax
    elif extent % alignment:
        want = ExtentAlignmentInvalid
    elif sequence != expected:
        want = SequenceViolation
    try:
        validate(ObjectHeader(object_id, sequence, extent), spec(max_extent, alignment), expected)
    except ObjectHeaderError as exc:
        assert type(exc) is want
    else:
        assert want is None


# --- ObjectSpec ---------------------------------------------------------------------------


def test_spec_wire_roundtrip() -> None:
    s = spec()
    wire = s.to_wire()
    assert wire == {"kind": "tensor", "max_extent": 1 << 20, "alignment": 8, "dtype": "float32",
                    "shape": [2, 4], "sequence_policy": "strict"}
    assert ObjectSpec.from_wire(wire) == s and hash(ObjectSpec.from_wire(wire)) == hash(s)
    assert s.strict and not spec(policy="none").strict


def test_spec_policy_defaults_to_strict() -> None:
    wire = spec().to_wire()
    del wire["sequence_policy"]
    assert ObjectSpec.from_wire(wire).sequence_policy == "strict"


GOOD = spec().to_wire()


@pytest.mark.parametrize(
    ("wire", "match"),
    [
        (None, "must be a map"),
        ([("kind", "x")], "must be a map"),
        *[({k: v for k, v in GOOD.items() if k != f}, f"missing {f}")
          for f in ("kind", "max_extent", "alignment", "dtype", "shape")],
        ({**GOOD, "layout": "nchw"}, "unknown fields layout"),
        ({**GOOD, "kind": ""}, "kind"),
        ({**GOOD, "kind": 3}, "kind"),
        ({**GOOD, "max_extent": -1}, "max_extent"),
        ({**GOOD, "max_extent": 2**64}, "max_extent"),
        ({**GOOD, "max_extent": True}, "max_extent"),
        ({**GOOD, "max_extent": "8"}, "max_extent"),
        ({**GOOD, "alignment": 0}, "alignment"),
        ({**GOOD, "alignment": 1.5}, "alignment"),
        ({**GOOD, "dtype": None}, "dtype"),
        ({**GOOD, "shape": 3}, "shape"),
        ({**GOOD, "shape": [2, -1]}, "shape"),
        ({**GOOD, "shape": ["2"]}, "shape"),
        ({**GOOD, "sequence_policy": "loose"}, "sequence_policy"),
    ],
)
def test_spec_from_bad_wire(wire: object, match: str) -> None:
    with pytest.raises(WireSpecInvalid, match=match) as info:
        ObjectSpec.from_wire(wire)
    assert isinstance(info.value, GpuWorkerError) and info.value.code == "malformed_control_message"


def test_spec_constructor_errors_are_config_errors() -> None:
    with pytest.raises(SpecInvalid, match="alignment") as info:
        ObjectSpec("tensor", 8, 0, "u8", ())
    assert isinstance(info.value, ConfigError)
