from libc.stdint cimport uint32_t, uint64_t

from cython_ring._mo01 cimport ObjectSpec


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
