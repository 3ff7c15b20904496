# cython: annotation_typing=False
# Annotations document the Python API; arguments are checked below so errors stay typed.
"""Ring header ABI v2 (see docs/architecture.md, 'Ring header' and 'Wake bits'): cursors, spans, wake bits and range
copies.

Every cursor, state and wake access goes through atomics.h; Python never touches ring atomics.
Span offsets are offsets into the buffer the Ring was made over (the arena mapping), so a pump
can `recv_into(memoryview(arena)[off:off + n])` and then `advance_commit(n)`.
"""

from cpython.buffer cimport PyBUF_SIMPLE, PyBUF_WRITABLE, PyBuffer_Release, PyObject_GetBuffer
from libc.stdint cimport uint8_t, uint16_t, uint32_t, uint64_t, uintptr_t
from libc.string cimport memcpy, memset

from cython_ring._mo01 cimport _errors, mo01_le16 as _le16, mo01_le32 as _le32, mo01_le64 as _le64
from cython_ring._region cimport _Region

from cython_ring._region import _u64_arg

RING_MAGIC = R_MAGIC
RING_VERSION = R_VERSION
RING_HEADER_LEN = R_HEADER_LEN
STATE_ACTIVE = S_ACTIVE
STATE_CLOSED = S_CLOSED
STATE_FAULTED = S_FAULTED
WAKE_READABLE = W_READABLE
WAKE_WRITABLE = W_WRITABLE

_STATE_NAMES = {S_ACTIVE: "active", S_CLOSED: "closed", S_FAULTED: "faulted"}

def _corrupt(message: str) -> Exception:
    return _errors().RingCorrupt(message)


cdef class Ring:
    """One SPSC ring over a writable buffer (an arena mmap) at a 64-byte aligned offset.

    The object keeps a buffer export for its lifetime, so the mapping cannot be closed under it;
    call release() (or use it as a context manager) before closing the mmap.
    """

    def __cinit__(self):
        self._held = False

    def __init__(self) -> None:
        raise TypeError("use Ring.init() for a new ring or Ring.attach() for an existing one")

    def __dealloc__(self):
        if self._held:
            PyBuffer_Release(&self._view)

    cdef int _map(self, object buf, Py_ssize_t offset) except -1:
        if offset < 0 or offset % R_ALIGN:
            raise ValueError(f"ring offset {offset} must be a non-negative multiple of {R_ALIGN}")
        PyObject_GetBuffer(buf, &self._view, PyBUF_WRITABLE)
        self._held = True
        self.offset = offset
        if self._view.len < R_HEADER_LEN or offset > self._view.len - R_HEADER_LEN:
            raise _errors().RingCorrupt(
                f"ring header at offset {offset} does not fit a {self._view.len}-byte buffer")
        self._hdr = <uint8_t*>self._view.buf + offset
        # Atomics on a misaligned word are not atomic (and not lock-free) across processes.
        if <uintptr_t>self._hdr % 8:
            raise ValueError("ring header address is not 8-byte aligned")
        self._data = self._hdr + R_HEADER_LEN
        return 0

    cdef int _live(self) except -1:
        if not self._held:
            raise ValueError("ring has been released")
        return 0

    cdef int _require(self, bint producing) except -1:
        self._live()
        cdef uint32_t st = cr_load_acquire_u32(self._hdr + OFF_STATE)
        if st == S_ACTIVE or (st == S_CLOSED and not producing):
            return 0
        if st == S_CLOSED or st == S_FAULTED:
            raise _errors().RingError(f"ring {self.ring_id} is {_STATE_NAMES[st]}")
        raise _errors().RingCorrupt(f"ring {self.ring_id}: state {st} is not 1, 2 or 3")

    cdef int _check(self, uint64_t commit, uint64_t consume) except -1:
        if commit < consume or commit - consume > self.capacity:
            raise _errors().RingCorrupt(
                f"ring {self.ring_id}: commit {commit} and consume {consume} violate "
                f"0 <= commit - consume <= capacity {self.capacity}")
        return 0

    @staticmethod
    def init(buf: object, offset: int, ring_id: int, capacity: int) -> Ring:
        """Write a fresh header (state active, cursors zero) and return the ring over it."""
        _u64_arg(ring_id, "ring_id")
        _u64_arg(capacity, "capacity")
        if ring_id == 0:
            raise ValueError("ring ids start at 1")
        if capacity == 0 or capacity % R_ALIGN:
            raise ValueError(f"capacity {capacity} must be a positive multiple of {R_ALIGN}")
        cdef Ring r = Ring.__new__(Ring)
        r._map(buf, offset)
        if capacity > <uint64_t>(r._view.len - offset - R_HEADER_LEN):
            raise ValueError(f"ring of capacity {capacity} at offset {offset} does not fit a "
                             f"{r._view.len}-byte buffer")
        r.ring_id = ring_id
        r.capacity = capacity
        cdef uint8_t* h = r._hdr
        memset(h, 0, R_HEADER_LEN)
        cdef uint32_t magic = R_MAGIC
        cdef uint16_t version = R_VERSION, header_len = R_HEADER_LEN
        cdef uint64_t rid = ring_id, cap = capacity
        memcpy(h + OFF_MAGIC, &magic, 4)
        memcpy(h + OFF_VERSION, &version, 2)
        memcpy(h + OFF_HEADER_LEN, &header_len, 2)
        memcpy(h + OFF_RING_ID, &rid, 8)
        memcpy(h + OFF_CAPACITY, &cap, 8)
        # Publish last: a reader that sees state active sees the whole header.
        cr_store_release_u32(h + OFF_STATE, S_ACTIVE)
        return r

    @staticmethod
    def attach(buf: object, offset: int, expected_ring_id: int | None = None,
               expected_capacity: int | None = None) -> Ring:
        """Validate an existing header byte for byte; any violation raises RingCorrupt."""
        cdef Ring r = Ring.__new__(Ring)
        r._map(buf, offset)
        corrupt = _corrupt
        cdef uint8_t* h = r._hdr
        cdef uint32_t st = cr_load_acquire_u32(h + OFF_STATE)
        cdef uint32_t magic = _le32(h + OFF_MAGIC)
        if magic != R_MAGIC:
            raise corrupt(f"ring magic 0x{magic:08x} at offset {offset}, expected 0x{R_MAGIC:08x} (SWRG)")
        if _le16(h + OFF_VERSION) != R_VERSION:
            raise _errors().UnsupportedRingVersion(
                f"ring ABI version {_le16(h + OFF_VERSION)}, expected {R_VERSION}")
        if _le16(h + OFF_HEADER_LEN) != R_HEADER_LEN:
            raise corrupt(f"ring header_len {_le16(h + OFF_HEADER_LEN)}, expected {R_HEADER_LEN}")
        r.ring_id = _le64(h + OFF_RING_ID)
        r.capacity = _le64(h + OFF_CAPACITY)
        if r.ring_id == 0:
            raise corrupt("ring_id 0 is never assigned")
        if expected_ring_id is not None and r.ring_id != expected_ring_id:
            raise corrupt(f"ring_id {r.ring_id}, expected {expected_ring_id}")
        if r.capacity == 0 or r.capacity % R_ALIGN:
            raise corrupt(f"ring {r.ring_id}: capacity {r.capacity} is not a positive multiple of {R_ALIGN}")
        if expected_capacity is not None and r.capacity != expected_capacity:
            raise corrupt(f"ring {r.ring_id}: capacity {r.capacity}, expected {expected_capacity}")
        if r.capacity > <uint64_t>(r._view.len - offset - R_HEADER_LEN):
            raise corrupt(f"ring {r.ring_id}: capacity {r.capacity} at offset {offset} overruns the "
                          f"{r._view.len}-byte buffer")
        for i in range(OFF_RESERVED, R_HEADER_LEN):
            if h[i]:
                raise corrupt(f"ring {r.ring_id}: reserved byte {i} is 0x{h[i]:02x}, not zero")
        if st not in _STATE_NAMES:
            raise corrupt(f"ring {r.ring_id}: state {st} is not 1, 2 or 3")
        cdef uint32_t wake = cr_load_acquire_u32(h + OFF_WAKE)
        if wake & ~(<uint32_t>(W_READABLE | W_WRITABLE)):
            raise corrupt(f"ring {r.ring_id}: wake word 0x{wake:08x} has undefined bits")
        r._check(cr_load_acquire_u64(h + OFF_COMMIT), cr_load_acquire_u64(h + OFF_CONSUME))
        return r

    def release(self) -> None:
        """Drop the buffer export; the Ring is unusable afterwards. Idempotent."""
        if self._busy:
            raise RuntimeError(f"ring {self.ring_id} is in use by a native call")
        if self._held:
            self._held = False
            self._hdr = self._data = NULL
            PyBuffer_Release(&self._view)

    def __enter__(self) -> Ring:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()

    def __repr__(self) -> str:
        if not self._held:
            return f"<Ring {self.ring_id} released>"
        return (f"<Ring {self.ring_id} capacity={self.capacity} commit={self.commit} "
                f"consume={self.consume} state={self.state} wake={self.wake}>")

    # --- header words -------------------------------------------------------------------

    @property
    def data_offset(self) -> int:
        return self.offset + R_HEADER_LEN

    @property
    def header_address(self) -> int:
        self._live()
        return <uintptr_t>self._hdr

    @property
    def data_address(self) -> int:
        self._live()
        return <uintptr_t>self._data

    @property
    def commit(self) -> int:
        self._live()
        return cr_load_acquire_u64(self._hdr + OFF_COMMIT)

    @property
    def consume(self) -> int:
        self._live()
        return cr_load_acquire_u64(self._hdr + OFF_CONSUME)

    @property
    def state(self) -> int:
        self._live()
        return cr_load_acquire_u32(self._hdr + OFF_STATE)

    @property
    def wake(self) -> int:
        self._live()
        return cr_load_acquire_u32(self._hdr + OFF_WAKE)

    @property
    def readable(self) -> int:
        """Committed bytes not yet consumed (loads consume first so the pair is never torn backwards)."""
        self._live()
        cdef uint64_t consume = cr_load_acquire_u64(self._hdr + OFF_CONSUME)
        cdef uint64_t commit = cr_load_acquire_u64(self._hdr + OFF_COMMIT)
        self._check(commit, consume)
        return commit - consume

    @property
    def writable(self) -> int:
        self._live()
        cdef uint64_t commit = cr_load_acquire_u64(self._hdr + OFF_COMMIT)
        cdef uint64_t consume = cr_load_acquire_u64(self._hdr + OFF_CONSUME)
        self._check(commit, consume)
        return self.capacity - (commit - consume)

    def close(self) -> bool:
        """Producer: no bytes after the current commit. False if the ring was not active."""
        self._live()
        return bool(cr_cas_u32(self._hdr + OFF_STATE, S_ACTIVE, S_CLOSED))

    def fault(self) -> bool:
        """Either side: stop the ring for good. False if it was already faulted."""
        self._live()
        cdef uint32_t st
        while True:
            st = cr_load_acquire_u32(self._hdr + OFF_STATE)
            if st == S_FAULTED:
                return False
            if cr_cas_u32(self._hdr + OFF_STATE, st, S_FAULTED):
                return True

    # --- wake coalescing: set after advancing a cursor, clear before draining ---------------

    def mark_readable(self) -> bool:
        """Producer, after advancing commit. True when the bit was clear: send RING_READABLE."""
        self._live()
        return not (cr_fetch_or_u32(self._hdr + OFF_WAKE, W_READABLE) & W_READABLE)

    def clear_readable(self) -> bool:
        """Consumer, before draining. Returns whether the bit was set."""
        self._live()
        return bool(cr_fetch_and_u32(self._hdr + OFF_WAKE, ~(<uint32_t>W_READABLE)) & W_READABLE)

    def mark_writable(self) -> bool:
        """Consumer, after advancing consume. True when the bit was clear: send RING_WRITABLE."""
        self._live()
        return not (cr_fetch_or_u32(self._hdr + OFF_WAKE, W_WRITABLE) & W_WRITABLE)

    def clear_writable(self) -> bool:
        """Producer, before looking for space. Returns whether the bit was set."""
        self._live()
        return bool(cr_fetch_and_u32(self._hdr + OFF_WAKE, ~(<uint32_t>W_WRITABLE)) & W_WRITABLE)

    # --- spans and cursors --------------------------------------------------------------

    cdef list _spans(self, uint64_t pos, uint64_t n):
        if n == 0:
            return []
        cdef uint64_t phys = pos % self.capacity
        cdef uint64_t first = min(n, self.capacity - phys)
        base = self.offset + R_HEADER_LEN
        if first == n:
            return [(base + phys, n)]
        return [(base + phys, first), (base, n - first)]

    def readable_spans(self) -> list[tuple[int, int]]:
        """Up to two (buffer offset, length) spans of committed bytes, in stream order."""
        self._require(False)
        cdef uint64_t consume = cr_load_relaxed_u64(self._hdr + OFF_CONSUME)
        cdef uint64_t commit = cr_load_acquire_u64(self._hdr + OFF_COMMIT)
        self._check(commit, consume)
        return self._spans(consume, commit - consume)

    def writable_spans(self) -> list[tuple[int, int]]:
        """Up to two (buffer offset, length) spans of free space, in stream order."""
        self._require(True)
        cdef uint64_t consume = cr_load_acquire_u64(self._hdr + OFF_CONSUME)
        cdef uint64_t commit = cr_load_relaxed_u64(self._hdr + OFF_COMMIT)
        self._check(commit, consume)
        return self._spans(commit, self.capacity - (commit - consume))

    def advance_commit(self, n: int) -> None:
        """Producer: publish n bytes already written into the writable spans."""
        cdef uint64_t k = _u64_arg(n, "n")
        self._require(True)
        cdef uint64_t consume = cr_load_acquire_u64(self._hdr + OFF_CONSUME)
        cdef uint64_t commit = cr_load_relaxed_u64(self._hdr + OFF_COMMIT)
        self._check(commit, consume)
        if k > self.capacity - (commit - consume):
            raise ValueError(f"ring {self.ring_id}: cannot commit {k} bytes, "
                             f"{self.capacity - (commit - consume)} free")
        cr_store_release_u64(self._hdr + OFF_COMMIT, commit + k)

    def advance_consume(self, n: int) -> None:
        """Consumer: release n bytes whose reads (and any DMA from them) are finished."""
        cdef uint64_t k = _u64_arg(n, "n")
        self._require(False)
        cdef uint64_t consume = cr_load_relaxed_u64(self._hdr + OFF_CONSUME)
        cdef uint64_t commit = cr_load_acquire_u64(self._hdr + OFF_COMMIT)
        self._check(commit, consume)
        if k > commit - consume:
            raise ValueError(f"ring {self.ring_id}: cannot consume {k} bytes, {commit - consume} committed")
        cr_store_release_u64(self._hdr + OFF_CONSUME, consume + k)

    # --- range copies (GIL released for large ones) ---------------------------------------

    def copy_in(self, src: object, src_offset: int, n: int, src_size: int | None = None) -> int:
        """Produce n bytes from src[src_offset:] (an address with src_size, or a buffer); commit them."""
        cdef _Region region = _Region(src, src_size, False)
        cdef uint64_t k = _u64_arg(n, "n")
        cdef const uint8_t* p = region.at(_u64_arg(src_offset, "src_offset"), k)
        self._require(True)
        cdef uint64_t consume = cr_load_acquire_u64(self._hdr + OFF_CONSUME)
        cdef uint64_t commit = cr_load_relaxed_u64(self._hdr + OFF_COMMIT)
        self._check(commit, consume)
        if k > self.capacity - (commit - consume):
            raise ValueError(f"ring {self.ring_id}: cannot write {k} bytes, "
                             f"{self.capacity - (commit - consume)} free")
        self._busy += 1
        try:
            ring_write_big(self._data, self.capacity, commit, p, k)
        finally:
            self._busy -= 1
        cr_store_release_u64(self._hdr + OFF_COMMIT, commit + k)
        return k

    def copy_out(self, dst: object, dst_offset: int, n: int, dst_size: int | None = None) -> int:
        """Consume n committed bytes into dst[dst_offset:] (an address with dst_size, or a buffer)."""
        cdef _Region region = _Region(dst, dst_size, True)
        cdef uint64_t k = _u64_arg(n, "n")
        cdef uint8_t* p = region.at(_u64_arg(dst_offset, "dst_offset"), k)
        self._require(False)
        cdef uint64_t consume = cr_load_relaxed_u64(self._hdr + OFF_CONSUME)
        cdef uint64_t commit = cr_load_acquire_u64(self._hdr + OFF_COMMIT)
        self._check(commit, consume)
        if k > commit - consume:
            raise ValueError(f"ring {self.ring_id}: cannot read {k} bytes, {commit - consume} committed")
        self._busy += 1
        try:
            ring_read_big(self._data, self.capacity, consume, p, k)
        finally:
            self._busy -= 1
        cr_store_release_u64(self._hdr + OFF_CONSUME, consume + k)
        return k

    def write(self, data: object) -> int:
        """Produce as much of `data` as fits; returns the byte count committed."""
        cdef _Region region = _Region(data, None, False)
        cdef uint64_t free = self.writable
        return self.copy_in(data, 0, min(free, region.size))

    def read(self, max_bytes: int | None = None) -> bytes:
        """Consume up to max_bytes committed bytes (all of them by default)."""
        cdef uint64_t k = self.readable
        if max_bytes is not None:
            k = min(k, _u64_arg(max_bytes, "max_bytes"))
        out = bytearray(k)
        self.copy_out(out, 0, k)
        return bytes(out)
