# cython: annotation_typing=False
# Annotations document the Python API; arguments are checked below so errors stay typed.
"""Ring header ABI v2 (ARCHITECTURE §6): cursors, spans, wake bits and range copies.

Every cursor, state and wake access goes through atomics.h; Python never touches ring atomics.
Span offsets are offsets into the buffer the Ring was made over (the arena mapping), so a pump
can `recv_into(memoryview(arena)[off:off + n])` and then `advance_commit(n)`.
"""

from cpython.buffer cimport PyBUF_SIMPLE, PyBUF_WRITABLE, PyBuffer_Release, PyObject_GetBuffer
from libc.stdint cimport uint8_t, uint16_t, uint32_t, uint64_t, uintptr_t
from libc.string cimport memcpy, memset

from cython_ring._mo01 cimport (
    MO01_EXTENT_EXCEEDS_MAX,
    MO01_FLAGS_KNOWN,
    MO01_HEADER_LEN,
    MO01_OK,
    Mo01Header,
    Mo01Status,
    ObjectSpec,
    mo01_check,
    mo01_pack,
    mo01_parse,
)

from cython_ring._mo01 import ObjectHeader, _failure

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

RING_MAGIC = R_MAGIC
RING_VERSION = R_VERSION
RING_HEADER_LEN = R_HEADER_LEN
STATE_ACTIVE = S_ACTIVE
STATE_CLOSED = S_CLOSED
STATE_FAULTED = S_FAULTED
WAKE_READABLE = W_READABLE
WAKE_WRITABLE = W_WRITABLE

_U64_MAX = 2**64 - 1
_STATE_NAMES = {S_ACTIVE: "active", S_CLOSED: "closed", S_FAULTED: "faulted"}

cdef object _errors_module = None


cdef object _errors():
    # Lazy: trio_gpuworker/__init__ may import trio, and the error classes are only needed on failure.
    global _errors_module
    if _errors_module is None:
        from trio_gpuworker import _errors
        _errors_module = _errors
    return _errors_module


def _corrupt(message: str) -> Exception:
    return _errors().RingCorrupt(message)


cdef inline uint64_t _le64(const uint8_t* p) noexcept nogil:
    cdef uint64_t v
    memcpy(&v, p, 8)
    return v


cdef inline uint32_t _le32(const uint8_t* p) noexcept nogil:
    cdef uint32_t v
    memcpy(&v, p, 4)
    return v


cdef inline uint16_t _le16(const uint8_t* p) noexcept nogil:
    cdef uint16_t v
    memcpy(&v, p, 2)
    return v


# Copies between the ring's data region and flat memory, splitting at the wrap point.
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


cdef void ring_read_big(const uint8_t* data, uint64_t cap, uint64_t pos, uint8_t* dst, uint64_t n):
    if n >= NOGIL_COPY:
        with nogil:
            ring_read(data, cap, pos, dst, n)
    else:
        ring_read(data, cap, pos, dst, n)


cdef void ring_write_big(uint8_t* data, uint64_t cap, uint64_t pos, const uint8_t* src, uint64_t n):
    if n >= NOGIL_COPY:
        with nogil:
            ring_write(data, cap, pos, src, n)
    else:
        ring_write(data, cap, pos, src, n)


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

    cdef Py_buffer view
    cdef bint held
    cdef uint8_t* ptr
    cdef uint64_t size

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
            raise corrupt(f"ring ABI version {_le16(h + OFF_VERSION)}, expected {R_VERSION}")
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



# --- ingress: one native call per drain (spec §11.1) ----------------------------------------

cdef enum:
    IN_NEED_HEADER = 0
    IN_NEED_PAYLOAD = 1
    IN_FAULTED = 2
    IN_CLOSED = 3

_INGRESS_PHASES = ("need_header", "need_payload", "faulted", "closed")


cdef inline void _fault_shared(uint8_t* hdr) noexcept nogil:
    cdef uint32_t st
    while True:
        st = cr_load_acquire_u32(hdr + OFF_STATE)
        if st == S_FAULTED or cr_cas_u32(hdr + OFF_STATE, st, S_FAULTED):
            return


cdef class IngressState:
    """Parser state of one ingress ring, carried across drain calls so objects larger than the
    ring stream through: NeedHeader -> NeedPayload (copied of extent) -> NeedHeader; Faulted and
    Closed are terminal and later drains return no events."""

    def __init__(self) -> None:
        self._phase = IN_NEED_HEADER
        self.last_exception = None

    @property
    def phase(self) -> str:
        return _INGRESS_PHASES[self._phase]

    def __repr__(self) -> str:
        return (f"<IngressState {self.phase} expected_sequence={self.expected_sequence} "
                f"object_id={self.object_id} copied={self.copied}/{self.extent}>")


cdef int _object_failed(list events, uint8_t* hdr, IngressState state, str code, str message,
                        object object_id, object sequence) except -1:
    # Stream alignment is lost, so the producer must stop too: fault the shared state.
    _fault_shared(hdr)
    state._phase = IN_FAULTED
    events.append(("failed", code, message, object_id, sequence))
    return 0


cdef int _ring_faulted(list events, uint8_t* hdr, IngressState state, str message) except -1:
    _fault_shared(hdr)
    state._phase = IN_FAULTED
    events.append(("ring_fault", "ring_state_invalid", message))
    return 0


def drain_ingress(Ring ring not None, IngressState state not None, ObjectSpec spec not None,
                  dst_resolver: object) -> list[tuple[object, ...]]:
    """Parse, validate and copy everything committed; advance consume behind the copies.

    `dst_resolver(object_id, sequence, extent) -> (address, size)` is called once per valid
    header, after validation and before any payload byte moves; it names the destination's host
    address (size >= extent). Its exceptions become a device_allocation_failed event.

    Clears the READABLE bit first and drains until no progress, so a commit it misses sets the
    bit again and triggers a fresh hint. Events, in stream order:
      ("header", object_id, sequence, extent, flags)   destination resolved, payload follows
      ("loaded", object_id, sequence, extent, flags)   every payload byte copied, ring space freed
      ("failed", code, message, object_id | None, sequence | None)   ObjectFailure; ring faulted
      ("ring_fault", reason, message)   cursors or state corrupt, or the peer faulted the ring
      ("closed",)   producer closed the ring at an object boundary and all bytes are consumed
      ("writable",)   consume advanced and WRITABLE was clear: send RING_WRITABLE
    """
    cdef list events = []
    if state._phase >= IN_FAULTED:
        return events
    ring._live()
    cdef uint8_t* hdr = ring._hdr
    cdef uint8_t* data = ring._data
    cdef uint64_t cap = ring.capacity
    cdef uint64_t start, consume, published, commit, avail, n, dst, size
    cdef uint32_t st
    cdef uint8_t raw[MO01_HEADER_LEN]
    cdef Mo01Header h
    cdef Mo01Status status
    cdef bint short
    ring._busy += 1
    try:
        cr_fetch_and_u32(hdr + OFF_WAKE, ~(<uint32_t>W_READABLE))
        start = consume = published = commit = cr_load_relaxed_u64(hdr + OFF_CONSUME)
        while True:
            avail = commit - consume
            if state._phase == IN_NEED_HEADER:
                short = avail < MO01_HEADER_LEN
            else:
                short = avail == 0 and state.copied < state.extent
            if short:
                # State before commit: a producer closes after its last commit, so seeing
                # "closed" guarantees the commit loaded next is final.
                st = cr_load_acquire_u32(hdr + OFF_STATE)
                commit = cr_load_acquire_u64(hdr + OFF_COMMIT)
                if st == S_FAULTED:
                    state._phase = IN_FAULTED
                    events.append(("ring_fault", "ring_state_invalid", f"ring {ring.ring_id} is faulted"))
                    break
                if st != S_ACTIVE and st != S_CLOSED:
                    _ring_faulted(events, hdr, state, f"ring {ring.ring_id}: state {st} is not 1, 2 or 3")
                    break
                if commit < consume or commit - consume > cap:
                    _ring_faulted(events, hdr, state, f"ring {ring.ring_id}: commit {commit} and consume "
                                  f"{consume} violate 0 <= commit - consume <= capacity {cap}")
                    break
                avail = commit - consume
                short = avail < MO01_HEADER_LEN if state._phase == IN_NEED_HEADER else avail == 0
                if short:
                    if st == S_CLOSED:
                        if state._phase == IN_NEED_HEADER and avail == 0:
                            state._phase = IN_CLOSED
                            events.append(("closed",))
                        elif state._phase == IN_NEED_HEADER:
                            _object_failed(events, hdr, state, "eof_mid_object",
                                           f"ring {ring.ring_id} closed {avail} bytes into an object header",
                                           None, None)
                        else:
                            _object_failed(events, hdr, state, "eof_mid_object",
                                           f"ring {ring.ring_id} closed after {state.copied} of {state.extent} "
                                           f"payload bytes", state.object_id, state.sequence)
                    break

            if state._phase == IN_NEED_HEADER:
                ring_read(data, cap, consume, raw, MO01_HEADER_LEN)
                status = mo01_parse(raw, &h)
                if status == MO01_OK:
                    status = mo01_check(h.extent, h.sequence, spec.max_extent, spec.alignment, spec.strict,
                                        state.expected_sequence)
                if status != MO01_OK:
                    exc = _failure(raw[:MO01_HEADER_LEN], spec, state.expected_sequence)
                    known = status >= MO01_EXTENT_EXCEEDS_MAX
                    _object_failed(events, hdr, state, exc.code, str(exc), h.object_id if known else None,
                                   h.sequence if known else None)
                    break
                try:
                    addr, size_obj = dst_resolver(h.object_id, h.sequence, h.extent)
                    dst = _u64_arg(addr, "destination address")
                    size = _u64_arg(size_obj, "destination size")
                    if size < h.extent or (dst == 0 and h.extent):
                        raise ValueError(f"destination ({dst:#x}, {size}) cannot hold extent {h.extent}")
                except Exception as exc:
                    state.last_exception = exc
                    _object_failed(events, hdr, state, "device_allocation_failed",
                                   f"object {h.object_id} seq {h.sequence}: {type(exc).__name__}: {exc}",
                                   h.object_id, h.sequence)
                    break
                consume += MO01_HEADER_LEN
                state._dst = dst
                state.object_id = h.object_id
                state.sequence = h.sequence
                state.extent = h.extent
                state.flags = h.flags
                state.copied = 0
                state.expected_sequence = h.sequence + 1
                state._phase = IN_NEED_PAYLOAD
                events.append(("header", h.object_id, h.sequence, h.extent, h.flags))
                continue

            n = state.extent - state.copied
            if n:
                if n > avail:
                    n = avail
                ring_read_big(data, cap, consume, <uint8_t*><uintptr_t>(state._dst + state.copied), n)
                consume += n
                state.copied += n
                # Release ring space as soon as it is copied: large objects need it to stream.
                cr_store_release_u64(hdr + OFF_CONSUME, consume)
                published = consume
            if state.copied == state.extent:
                if published != consume:
                    cr_store_release_u64(hdr + OFF_CONSUME, consume)
                    published = consume
                state._phase = IN_NEED_HEADER
                state.objects_loaded += 1
                events.append(("loaded", state.object_id, state.sequence, state.extent, state.flags))
    finally:
        if published != consume:
            cr_store_release_u64(hdr + OFF_CONSUME, consume)
        ring._busy -= 1
    state.bytes_consumed += consume - start
    if consume != start and state._phase < IN_FAULTED:
        if not (cr_fetch_or_u32(hdr + OFF_WAKE, W_WRITABLE) & W_WRITABLE):
            events.append(("writable",))
    return events


# --- egress: header, then payload prefixes as space allows (spec §11.2, §16.3) -------------

cdef enum:
    EG_IDLE = 0
    EG_HEADER = 1
    EG_PAYLOAD = 2
    EG_FAULTED = 3

_EGRESS_PHASES = ("idle", "header", "payload", "faulted")


cdef class EgressState:
    """Producer state of one egress ring. With a spec, each object is checked (extent, alignment,
    strict sequence) before its header is written, so a rejected object leaves no bytes behind."""

    def __init__(self, ObjectSpec spec=None) -> None:
        self.spec = spec
        self._phase = EG_IDLE

    @property
    def phase(self) -> str:
        return _EGRESS_PHASES[self._phase]

    @property
    def busy(self) -> bool:
        """An object was started and not yet fully committed."""
        return self._phase == EG_HEADER or self._phase == EG_PAYLOAD

    def abandon(self, Ring ring not None) -> bool:
        """Give up the current object. Once its header is committed the ring must fault (True)."""
        if self._phase == EG_PAYLOAD:
            ring._live()
            _fault_shared(ring._hdr)
            self._phase = EG_FAULTED
            return True
        if self._phase == EG_HEADER:
            self._phase = EG_IDLE
        return False

    def __repr__(self) -> str:
        return (f"<EgressState {self.phase} expected_sequence={self.expected_sequence} "
                f"object_id={self.object_id} produced={self.produced}/{self.extent}>")


def write_egress(Ring ring not None, EgressState state not None, uint64_t object_id, uint64_t sequence,
                 uint64_t src_addr, uint64_t extent, uint32_t flags=0) -> tuple[int, bool]:
    """Write the object's header, then as much payload from src_addr as fits; returns
    (bytes committed by this call, whether to send RING_READABLE).

    Call again with the same arguments after RING_WRITABLE until `state.busy` is False (the
    object is produced). Clears WRITABLE before looking for space, so no hint is lost.
    """
    if state._phase == EG_FAULTED:
        raise _errors().RingError(f"ring {ring.ring_id}: a partial egress object was abandoned; "
                                  f"the ring is faulted")
    ring._live()
    cdef uint8_t* hdr = ring._hdr
    cdef uint64_t cap = ring.capacity
    cdef uint8_t raw[MO01_HEADER_LEN]
    cdef Mo01Status status
    if state._phase == EG_IDLE:
        header = ObjectHeader(object_id, sequence, extent, flags)
        if state.spec is not None:
            status = mo01_check(extent, sequence, state.spec.max_extent, state.spec.alignment,
                                state.spec.strict, state.expected_sequence)
            if status != MO01_OK:
                raise _failure(header.encode(), state.spec, state.expected_sequence)
        if extent and not src_addr:
            raise ValueError("a non-empty object needs a source address")
        state.object_id = object_id
        state.sequence = sequence
        state.extent = extent
        state.flags = flags
        state.produced = 0
        state._phase = EG_HEADER
    elif (object_id != state.object_id or sequence != state.sequence or extent != state.extent
          or flags != state.flags):
        raise ValueError(f"ring {ring.ring_id}: object {state.object_id} seq {state.sequence} is still "
                         f"being written")

    cdef uint32_t st = cr_load_acquire_u32(hdr + OFF_STATE)
    if st != S_ACTIVE:
        if state._phase == EG_PAYLOAD:
            _fault_shared(hdr)
            state._phase = EG_FAULTED
        else:
            state._phase = EG_IDLE
        raise _errors().RingError(f"ring {ring.ring_id} is {_STATE_NAMES.get(st, f'in state {st}')}")
    cr_fetch_and_u32(hdr + OFF_WAKE, ~(<uint32_t>W_WRITABLE))
    cdef uint64_t consume = cr_load_acquire_u64(hdr + OFF_CONSUME)
    cdef uint64_t commit = cr_load_relaxed_u64(hdr + OFF_COMMIT)
    if commit < consume or commit - consume > cap:
        _fault_shared(hdr)
        state._phase = EG_FAULTED if state._phase == EG_PAYLOAD else EG_IDLE
        ring._check(commit, consume)
    cdef uint64_t free = cap - (commit - consume)
    cdef uint64_t written = 0, n
    if state._phase == EG_HEADER:
        # The header goes in whole; capacity >= 64 guarantees it eventually fits.
        if free < MO01_HEADER_LEN:
            return (0, False)
        mo01_pack(raw, object_id, sequence, extent, flags)
        ring_write(ring._data, cap, commit, raw, MO01_HEADER_LEN)
        commit += MO01_HEADER_LEN
        free -= MO01_HEADER_LEN
        written = MO01_HEADER_LEN
        state._phase = EG_PAYLOAD
    n = extent - state.produced
    if n > free:
        n = free
    if n:
        ring._busy += 1
        try:
            ring_write_big(ring._data, cap, commit, <const uint8_t*><uintptr_t>(src_addr + state.produced), n)
        finally:
            ring._busy -= 1
        commit += n
        state.produced += n
        written += n
    if state.produced == extent:
        state._phase = EG_IDLE
        state.expected_sequence = sequence + 1
        state.objects_produced += 1
    if not written:
        return (0, False)
    cr_store_release_u64(hdr + OFF_COMMIT, commit)
    return (written, not (cr_fetch_or_u32(hdr + OFF_WAKE, W_READABLE) & W_READABLE))
