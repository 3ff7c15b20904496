# cython: annotation_typing=False
# Annotations document the Python API; arguments are checked below so errors stay typed.
"""The batch drain's two native halves (see docs/architecture.md, 'The worker side'): a pool of preallocated
destinations the drain takes
from in order, and the completion batch it writes into. With both, one drain call moves every committed object
without calling Python, and the caller's Python runs once per call, not once per object."""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize
from cpython.list cimport PyList_New, PyList_SET_ITEM
from cpython.ref cimport Py_INCREF
from libc.stdint cimport uint64_t
from libc.stdlib cimport free, malloc, realloc
from libc.string cimport memmove

from cython_ring._region import _u64_arg
from cython_ring.records import Completion


cdef class DestPool:
    """Free destinations (host address, size), taken oldest first by drain_batch: one per object header.

    With `exact`, a destination fits only an object of exactly its size (a device allocation handed on as the
    object); otherwise any size >= the extent fits. When the oldest does not fit, or the pool is empty, the drain
    stops before that header and names it (Completions.need); the caller refills and drains
    again. `taken` counts destinations handed to objects since the pool was made, so a caller that keeps its
    allocations in a FIFO parallel to the pool knows which are in use.
    """

    def __cinit__(self, bint exact=False):
        self.exact = exact

    def __dealloc__(self):
        free(self._addr)
        free(self._size)

    cdef int _reserve(self, Py_ssize_t n) except -1:
        cdef Py_ssize_t live = self._tail - self._head
        cdef uint64_t* p
        if self._head and self._tail + n > self._cap:  # slide the live entries down before growing
            memmove(self._addr, self._addr + self._head, live * sizeof(uint64_t))
            memmove(self._size, self._size + self._head, live * sizeof(uint64_t))
            self._head, self._tail = 0, live
        if self._tail + n <= self._cap:
            return 0
        cdef Py_ssize_t cap = max(64, 2 * self._cap, self._tail + n)
        p = <uint64_t*>realloc(self._addr, cap * sizeof(uint64_t))
        if p == NULL:
            raise MemoryError()
        self._addr = p
        p = <uint64_t*>realloc(self._size, cap * sizeof(uint64_t))
        if p == NULL:
            raise MemoryError()
        self._size = p
        self._cap = cap
        return 0

    def put(self, address: int, size: int) -> None:
        """Add one destination: `size` writable bytes at host address `address` (0 only when size is 0)."""
        cdef uint64_t a = _u64_arg(address, "destination address"), s = _u64_arg(size, "destination size")
        if a == 0 and s:
            raise ValueError(f"destination (0x0, {s}) has no address")
        self._reserve(1)
        self._addr[self._tail] = a
        self._size[self._tail] = s
        self._tail += 1

    def put_many(self, const uint64_t[::1] addresses not None, size: int) -> None:
        """Add len(addresses) destinations of one size, in order."""
        cdef uint64_t s = _u64_arg(size, "destination size")
        cdef Py_ssize_t i, n = addresses.shape[0]
        for i in range(n):
            if addresses[i] == 0 and s:
                raise ValueError(f"destination {i} (0x0, {s}) has no address")
        self._reserve(n)
        for i in range(n):
            self._addr[self._tail + i] = addresses[i]
            self._size[self._tail + i] = s
        self._tail += n

    def clear(self) -> int:
        """Forget every free destination; returns how many there were (the newest ones of the caller's FIFO)."""
        cdef Py_ssize_t n = self._tail - self._head
        self._head = self._tail = 0
        return n

    @property
    def next_size(self) -> int | None:
        """The size of the destination the next header takes, or None when the pool is empty."""
        return self._size[self._head] if self._tail > self._head else None

    def __len__(self) -> int:
        return self._tail - self._head

    def __repr__(self) -> str:
        return f"<DestPool {len(self)} free, {self.taken} taken{' exact' if self.exact else ''}>"


cdef class Completions:
    """What one drain_batch call did, reused from call to call (cleared at the start of each): the objects it
    loaded, in stream order, and how it stopped.

    `end` is a DrainEnd when the stream stopped for good (failed, ring_fault, closed), else None; `need` is the
    next header (a Completion record) when the pool had no destination for it (it is not consumed); `more` says
    the drain stopped at max_objects; `writable` says consume advanced and WRITABLE was clear (send
    RING_WRITABLE).
    """

    def __cinit__(self):
        self._rec = NULL

    def __dealloc__(self):
        free(self._rec)

    cdef void _reset(self) noexcept nogil:
        self._n = 0
        self.loaded = 0
        self.loaded_bytes = 0
        self.writable = False
        self.more = False

    cdef int _grow(self) noexcept nogil:
        # Returns -1 (nothing changed) when memory is short; the drain then stops before the next header.
        cdef Py_ssize_t cap = 2 * self._cap if self._cap else 256
        cdef BatchRecord* p = <BatchRecord*>realloc(self._rec, cap * sizeof(BatchRecord))
        if p == NULL:
            return -1
        self._rec = p
        self._cap = cap
        return 0

    def __len__(self) -> int:
        return self.loaded

    def records(self) -> list[Completion]:
        """The loaded objects, in stream order."""
        cdef Py_ssize_t i
        cdef BatchRecord* r
        out = []
        for i in range(self._n):
            r = &self._rec[i]
            if r.kind == REC_LOADED:
                out.append(Completion(r.object_id, r.sequence, r.extent, r.flags))
        return out

    def rows(self, uint64_t first_handle) -> list[list[int]]:
        """OBJECTS_LOADED rows [object_id, sequence, extent, handle id], handle ids first_handle, +1, ... in
        stream order: the worker's message built without a Python statement per object."""
        cdef Py_ssize_t i, k = 0
        cdef BatchRecord* r
        cdef list out = PyList_New(self.loaded)
        cdef list row
        for i in range(self._n):
            r = &self._rec[i]
            if r.kind != REC_LOADED:
                continue
            row = [r.object_id, r.sequence, r.extent, first_handle + <uint64_t>k]
            Py_INCREF(row)
            PyList_SET_ITEM(out, k, row)
            k += 1
        return out

    def block(self, uint64_t first_handle) -> bytes:
        """rows() as LOADED_BLOCK's raw frame: four little-endian u64s per object, in the same columns and order."""
        cdef Py_ssize_t i, k = 0
        cdef int j
        cdef BatchRecord* r
        cdef uint64_t v[4]
        cdef bytes out = PyBytes_FromStringAndSize(NULL, self.loaded * 32)
        cdef unsigned char* p = <unsigned char*>PyBytes_AS_STRING(out)
        for i in range(self._n):
            r = &self._rec[i]
            if r.kind != REC_LOADED:
                continue
            v[0], v[1], v[2], v[3] = r.object_id, r.sequence, r.extent, first_handle + <uint64_t>k
            for j in range(32):  # byte by byte: little-endian whatever the host's order
                p[j] = <unsigned char>((v[j >> 3] >> (8 * (j & 7))) & 0xff)
            p += 32
            k += 1
        return out

    def events(self) -> list[tuple[object, ...]]:
        """drain_ingress's event list: header and loaded events in stream order, then the end, then writable."""
        cdef Py_ssize_t i
        cdef BatchRecord* r
        out = []
        for i in range(self._n):
            r = &self._rec[i]
            out.append(("loaded" if r.kind == REC_LOADED else "header", r.object_id, r.sequence, r.extent,
                        r.flags))
        if self.end is not None:
            out.append(self.end.legacy())
        if self.writable:
            out.append(("writable",))
        return out

    def __repr__(self) -> str:
        return (f"<Completions {self.loaded} loaded, {self.loaded_bytes} bytes, end={self.end!r}, "
                f"need={self.need!r}, more={self.more}, writable={self.writable}>")
