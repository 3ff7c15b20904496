from libc.stdint cimport uint32_t, uint64_t

from cython_ring._mo01 cimport ObjectSpec


cdef class IngressState:
    cdef int _phase
    cdef readonly uint64_t expected_sequence
    cdef readonly uint64_t object_id
    cdef readonly uint64_t sequence
    cdef readonly uint64_t extent
    cdef readonly uint32_t flags
    cdef readonly uint64_t copied
    cdef uint64_t _dst
    cdef uint64_t _window  # 0: the destination holds the whole object; else a window flushed as it fills
    cdef uint64_t _filled
    cdef readonly uint64_t objects_loaded
    cdef readonly uint64_t bytes_consumed
    cdef readonly object last_exception
