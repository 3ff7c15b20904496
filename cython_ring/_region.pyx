# cython: annotation_typing=False
"""Bounds-checked flat memory ranges (an address with a stated size, or a buffer) for the range copies."""

from cpython.buffer cimport PyBUF_SIMPLE, PyBUF_WRITABLE, PyBuffer_Release, PyObject_GetBuffer
from libc.stdint cimport uint8_t, uint64_t, uintptr_t

_U64_MAX = 2**64 - 1


def _u64_arg(value: object, name: str) -> int:
    # Accepts integer-likes (numpy scalars from a resolver) but never bools or floats.
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise ValueError(f"{name} must be an integer in [0, 2**64), got {value!r}")
    v = value.__index__()
    if not 0 <= v <= _U64_MAX:
        raise ValueError(f"{name} must be an integer in [0, 2**64), got {value!r}")
    return v


cdef class _Region:
    """A bounds-checked flat memory range: an integer address with a caller-stated size, or a buffer."""

    def __cinit__(self, target: object, size: object, bint writable):
        if isinstance(target, int):
            if size is None:
                raise ValueError("an integer address needs its size")
            if not 0 < target <= _U64_MAX:
                raise ValueError(f"address {target!r} is not a valid pointer")
            self.ptr = <uint8_t*><uintptr_t><uint64_t>target
            self.size = _u64_arg(size, "size")
            return
        PyObject_GetBuffer(target, &self.view, PyBUF_WRITABLE if writable else PyBUF_SIMPLE)
        self.held = True
        self.ptr = <uint8_t*>self.view.buf
        self.size = <uint64_t>self.view.len
        if size is not None and _u64_arg(size, "size") > self.size:
            raise ValueError(f"size {size} exceeds the buffer's {self.size} bytes")
        if size is not None:
            self.size = size

    cdef uint8_t* at(self, uint64_t offset, uint64_t n) except NULL:
        if offset > self.size or n > self.size - offset:
            raise ValueError(f"range [{offset}, {offset + n}) exceeds the {self.size}-byte region")
        return self.ptr + offset

    def __dealloc__(self):
        if self.held:
            PyBuffer_Release(&self.view)
