from cpython.buffer cimport Py_buffer
from libc.stdint cimport uint8_t, uint64_t


cdef class _Region:
    cdef Py_buffer view
    cdef bint held
    cdef uint8_t* ptr
    cdef uint64_t size

    cdef uint8_t* at(self, uint64_t offset, uint64_t n) except NULL
