from cpython.buffer cimport Py_buffer
from libc.stdint cimport uint8_t, uint32_t, uint64_t
from libc.string cimport memcpy

cdef extern from "atomics.h" nogil:
    uint64_t cr_load_acquire_u64(void* p)
    uint64_t cr_load_relaxed_u64(void* p)
    void cr_store_release_u64(void* p, uint64_t v)
    uint32_t cr_load_acquire_u32(void* p)
    void cr_store_release_u32(void* p, uint32_t v)
    uint32_t cr_fetch_or_u32(void* p, uint32_t v)
    uint32_t cr_fetch_and_u32(void* p, uint32_t v)
    int cr_cas_u32(void* p, uint32_t expected, uint32_t desired)

cdef enum:
    R_MAGIC = 0x47525753
    R_VERSION = 2
    R_HEADER_LEN = 128
    R_ALIGN = 64
    OFF_MAGIC = 0
    OFF_VERSION = 4
    OFF_HEADER_LEN = 6
    OFF_RING_ID = 8
    OFF_CAPACITY = 16
    OFF_COMMIT = 24
    OFF_CONSUME = 32
    OFF_STATE = 40
    OFF_WAKE = 44
    OFF_RESERVED = 48
    S_ACTIVE = 1
    S_CLOSED = 2
    S_FAULTED = 3
    W_READABLE = 1
    W_WRITABLE = 2
    # Below this a copy is cheaper than dropping and retaking the GIL.
    NOGIL_COPY = 65536


# Copies between the ring's data region and flat memory, splitting at the wrap point.
# Faults the shared state (from any state); the peer sees it on its next look.
cdef inline void _fault_shared(uint8_t* hdr) noexcept nogil:
    cdef uint32_t st
    while True:
        st = cr_load_acquire_u32(hdr + OFF_STATE)
        if st == S_FAULTED or cr_cas_u32(hdr + OFF_STATE, st, S_FAULTED):
            return


cdef inline void ring_read(const uint8_t* data, uint64_t cap, uint64_t pos, uint8_t* dst,
                           uint64_t n) noexcept nogil:
    cdef uint64_t phys = pos % cap
    cdef uint64_t first = cap - phys
    if first >= n:
        memcpy(dst, data + phys, n)
    else:
        memcpy(dst, data + phys, first)
        memcpy(dst + first, data, n - first)


cdef inline void ring_write(uint8_t* data, uint64_t cap, uint64_t pos, const uint8_t* src,
                            uint64_t n) noexcept nogil:
    cdef uint64_t phys = pos % cap
    cdef uint64_t first = cap - phys
    if first >= n:
        memcpy(data + phys, src, n)
    else:
        memcpy(data + phys, src, first)
        memcpy(data, src + first, n - first)


cdef inline void ring_read_big(const uint8_t* data, uint64_t cap, uint64_t pos, uint8_t* dst, uint64_t n):
    if n >= NOGIL_COPY:
        with nogil:
            ring_read(data, cap, pos, dst, n)
    else:
        ring_read(data, cap, pos, dst, n)


cdef inline void ring_write_big(uint8_t* data, uint64_t cap, uint64_t pos, const uint8_t* src, uint64_t n):
    if n >= NOGIL_COPY:
        with nogil:
            ring_write(data, cap, pos, src, n)
    else:
        ring_write(data, cap, pos, src, n)


cdef class Ring:
    cdef Py_buffer _view
    cdef bint _held
    cdef uint8_t* _hdr
    cdef uint8_t* _data
    cdef readonly uint64_t ring_id
    cdef readonly uint64_t capacity
    cdef readonly Py_ssize_t offset
    # Native calls in progress (copies with the GIL released); release() refuses while non-zero.
    cdef Py_ssize_t _busy

    cdef int _live(self) except -1
    cdef int _map(self, object buf, Py_ssize_t offset) except -1
    cdef int _require(self, bint producing) except -1
    cdef int _check(self, uint64_t commit, uint64_t consume) except -1
    cdef list _spans(self, uint64_t pos, uint64_t n)
