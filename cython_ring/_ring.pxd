from cpython.buffer cimport Py_buffer
from libc.stdint cimport uint8_t, uint32_t, uint64_t

from cython_ring._mo01 cimport ObjectSpec

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


cdef class IngressState:
    cdef int _phase
    cdef readonly uint64_t expected_sequence
    cdef readonly uint64_t object_id
    cdef readonly uint64_t sequence
    cdef readonly uint64_t extent
    cdef readonly uint32_t flags
    cdef readonly uint64_t copied
    cdef uint64_t _dst
    cdef readonly uint64_t objects_loaded
    cdef readonly uint64_t bytes_consumed
    cdef readonly object last_exception


cdef class EgressState:
    cdef int _phase
    cdef readonly ObjectSpec spec
    cdef readonly uint64_t expected_sequence
    cdef readonly uint64_t object_id
    cdef readonly uint64_t sequence
    cdef readonly uint64_t extent
    cdef readonly uint32_t flags
    cdef readonly uint64_t produced
    cdef readonly uint64_t objects_produced
