from libc.stdint cimport uint32_t, uint64_t


ctypedef struct BatchRecord:
    uint64_t object_id
    uint64_t sequence
    uint64_t extent
    uint32_t flags
    uint32_t kind  # REC_HEADER or REC_LOADED


cdef enum:
    REC_HEADER = 0
    REC_LOADED = 1


cdef class DestPool:
    cdef uint64_t* _addr
    cdef uint64_t* _size
    cdef Py_ssize_t _cap
    cdef Py_ssize_t _head  # entries [_head, _tail) are free destinations, oldest first
    cdef Py_ssize_t _tail
    cdef readonly bint exact
    cdef readonly uint64_t taken

    cdef int _reserve(self, Py_ssize_t n) except -1


cdef class Completions:
    cdef BatchRecord* _rec
    cdef Py_ssize_t _n
    cdef Py_ssize_t _cap
    cdef bint _headers  # also record "header" events (drain_ingress's event list needs them)
    cdef readonly Py_ssize_t loaded
    cdef readonly uint64_t loaded_bytes
    cdef readonly bint writable
    cdef readonly bint more
    cdef readonly object end
    cdef readonly object need

    cdef void _reset(self) noexcept nogil
    cdef int _grow(self) noexcept nogil
