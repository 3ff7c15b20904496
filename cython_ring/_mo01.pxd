# MO01 object-record header: the C-level codec, inlined into every module that cimports it so the
# ingress drain parses headers without a call through a capsule.
from libc.stdint cimport uint8_t, uint16_t, uint32_t, uint64_t

cdef enum:
    MO01_HEADER_LEN = 40
    MO01_MAGIC = 0x31304F4D
    MO01_VERSION = 1
    MO01_FLAG_END_OF_SEQUENCE = 1
    MO01_FLAG_BEGIN_SEQUENCE = 2
    MO01_FLAGS_KNOWN = 3

# Failure statuses, in the order docs/architecture.md ('Object records') lists them; MO01_OK is zero so `if status:`
# means failed.
cdef enum Mo01Status:
    MO01_OK = 0
    MO01_SHORT
    MO01_BAD_MAGIC
    MO01_BAD_VERSION
    MO01_BAD_HEADER_LEN
    MO01_BAD_RESERVED
    MO01_BAD_FLAGS
    MO01_EXTENT_EXCEEDS_MAX
    MO01_EXTENT_ALIGNMENT
    MO01_SEQUENCE_VIOLATION

cdef struct Mo01Header:
    uint32_t magic
    uint16_t version
    uint16_t header_len
    uint64_t object_id
    uint64_t sequence
    uint64_t extent
    uint32_t flags
    uint32_t reserved


# Byte-wise little-endian access: correct on any host, and compilers fold it into one load.
cdef inline uint16_t mo01_le16(const uint8_t* p) noexcept nogil:
    return <uint16_t>(p[0] | (<uint16_t>p[1] << 8))


cdef inline uint32_t mo01_le32(const uint8_t* p) noexcept nogil:
    return (<uint32_t>p[0] | (<uint32_t>p[1] << 8) | (<uint32_t>p[2] << 16) | (<uint32_t>p[3] << 24))


cdef inline uint64_t mo01_le64(const uint8_t* p) noexcept nogil:
    return <uint64_t>mo01_le32(p) | (<uint64_t>mo01_le32(p + 4) << 32)


cdef inline void mo01_put32(uint8_t* p, uint32_t v) noexcept nogil:
    p[0] = <uint8_t>v
    p[1] = <uint8_t>(v >> 8)
    p[2] = <uint8_t>(v >> 16)
    p[3] = <uint8_t>(v >> 24)


cdef inline void mo01_put64(uint8_t* p, uint64_t v) noexcept nogil:
    mo01_put32(p, <uint32_t>v)
    mo01_put32(p + 4, <uint32_t>(v >> 32))


cdef inline void mo01_pack(uint8_t* p, uint64_t object_id, uint64_t sequence, uint64_t extent,
                           uint32_t flags) noexcept nogil:
    mo01_put32(p, MO01_MAGIC)
    p[4] = MO01_VERSION
    p[5] = 0
    p[6] = MO01_HEADER_LEN
    p[7] = 0
    mo01_put64(p + 8, object_id)
    mo01_put64(p + 16, sequence)
    mo01_put64(p + 24, extent)
    mo01_put32(p + 32, flags)
    mo01_put32(p + 36, 0)


# Fills every field before checking any, so a failure message can quote what arrived.
cdef inline Mo01Status mo01_parse(const uint8_t* p, Mo01Header* h) noexcept nogil:
    h.magic = mo01_le32(p)
    h.version = mo01_le16(p + 4)
    h.header_len = mo01_le16(p + 6)
    h.object_id = mo01_le64(p + 8)
    h.sequence = mo01_le64(p + 16)
    h.extent = mo01_le64(p + 24)
    h.flags = mo01_le32(p + 32)
    h.reserved = mo01_le32(p + 36)
    if h.magic != MO01_MAGIC:
        return MO01_BAD_MAGIC
    if h.version != MO01_VERSION:
        return MO01_BAD_VERSION
    if h.header_len != MO01_HEADER_LEN:
        return MO01_BAD_HEADER_LEN
    if h.reserved != 0:
        return MO01_BAD_RESERVED
    if h.flags & ~(<uint32_t>MO01_FLAGS_KNOWN):
        return MO01_BAD_FLAGS
    return MO01_OK


cdef inline Mo01Status mo01_check(uint64_t extent, uint64_t sequence, uint64_t max_extent,
                                  uint64_t alignment, bint strict, uint64_t expected) noexcept nogil:
    if extent > max_extent:
        return MO01_EXTENT_EXCEEDS_MAX
    if alignment > 1 and extent % alignment:  # alignment 0 (a spec never constructed) must not trap
        return MO01_EXTENT_ALIGNMENT
    if strict and sequence != expected:
        return MO01_SEQUENCE_VIOLATION
    return MO01_OK


cdef class ObjectHeader:
    cdef readonly uint64_t object_id
    cdef readonly uint64_t sequence
    cdef readonly uint64_t extent
    cdef readonly uint32_t flags


cdef class ObjectSpec:
    cdef readonly str kind
    cdef readonly uint64_t max_extent
    cdef readonly uint64_t alignment
    cdef readonly str dtype
    cdef readonly tuple shape
    cdef readonly str sequence_policy
    cdef readonly bint strict


# The package's own exception classes (cython_ring.errors); the trio shell maps them to its hierarchy.
cdef object _errors()
