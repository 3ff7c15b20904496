# cython: annotation_typing=False
# Annotations document the Python API; arguments are checked below so errors stay typed.
"""The egress byte stream over a ring (see docs/architecture.md, 'Ingress and egress'): the producer's state, the
one-object writer
and the batch writer (many MO01 records per call, GIL released, one wake hint per burst)."""

from cpython.buffer cimport PyBUF_SIMPLE, PyBuffer_Release, PyObject_GetBuffer
from libc.stdint cimport uint8_t, uint32_t, uint64_t, uintptr_t

from cython_ring._mo01 cimport (
    MO01_FLAGS_KNOWN,
    MO01_HEADER_LEN,
    MO01_OK,
    Mo01Status,
    ObjectSpec,
    _errors,
    mo01_check,
    mo01_pack,
)
from cython_ring._ring cimport (
    OFF_COMMIT,
    OFF_CONSUME,
    OFF_STATE,
    OFF_WAKE,
    S_ACTIVE,
    W_READABLE,
    W_WRITABLE,
    Ring,
    _fault_shared,
    cr_fetch_and_u32,
    cr_fetch_or_u32,
    cr_load_acquire_u32,
    cr_load_acquire_u64,
    cr_load_relaxed_u64,
    cr_store_release_u64,
    ring_write,
    ring_write_big,
)

from cython_ring._mo01 import ObjectHeader, _failure
from cython_ring._ring import _STATE_NAMES


# --- egress: header, then payload prefixes as space allows (docs/architecture.md, 'Ingress and egress') -

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


cdef uint64_t _egress_space(Ring ring, EgressState state, uint64_t* commit, uint64_t need) except? 0:
    """The producer's look at the ring before it writes: a ring that is not active is refused (and faulted if
    an object is half written) and corrupt cursors fault the ring. Returns the free bytes; `commit` gets the
    commit cursor to write at. The writable wake bit is cleared only when fewer than `need` bytes are free (the
    producer is about to wait for RING_WRITABLE), and the consume cursor is read again after clearing it: a
    consumer that advanced before the clear is seen here, one after it finds the bit clear and sends the hint.
    A producer that never runs short leaves the bit set, so its consumer sends no RING_WRITABLE at all."""
    cdef uint8_t* hdr = ring._hdr
    cdef uint32_t st = cr_load_acquire_u32(hdr + OFF_STATE)
    if st != S_ACTIVE:
        if state._phase == EG_PAYLOAD:
            _fault_shared(hdr)
            state._phase = EG_FAULTED
        else:
            state._phase = EG_IDLE
        raise _errors().RingError(f"ring {ring.ring_id} is {_STATE_NAMES.get(st, f'in state {st}')}")
    cdef uint64_t consume = cr_load_acquire_u64(hdr + OFF_CONSUME)
    commit[0] = cr_load_relaxed_u64(hdr + OFF_COMMIT)
    _check_cursors(ring, state, commit[0], consume)
    if ring.capacity - (commit[0] - consume) < need:
        cr_fetch_and_u32(hdr + OFF_WAKE, ~(<uint32_t>W_WRITABLE))
        consume = cr_load_acquire_u64(hdr + OFF_CONSUME)
        _check_cursors(ring, state, commit[0], consume)
    return ring.capacity - (commit[0] - consume)


cdef int _check_cursors(Ring ring, EgressState state, uint64_t commit, uint64_t consume) except -1:
    if commit < consume or commit - consume > ring.capacity:
        _fault_shared(ring._hdr)
        state._phase = EG_FAULTED if state._phase == EG_PAYLOAD else EG_IDLE
        ring._check(commit, consume)
    return 0


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

    cdef uint64_t commit
    cdef uint64_t need = extent - state.produced + (MO01_HEADER_LEN if state._phase == EG_HEADER else 0)
    cdef uint64_t free = _egress_space(ring, state, &commit, need)
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


cdef uint64_t _burst_need(const uint64_t[:, ::1] records, Py_ssize_t i, EgressState state, uint64_t cap):
    """Bytes records[i:] still need (each unstarted row its header and payload), counted only up to more than
    the ring holds: past that the burst waits for space whatever the count."""
    cdef uint64_t need = 0
    cdef Py_ssize_t n = records.shape[0]
    if i < n and state._phase != EG_IDLE:
        need = records[i, 3] - state.produced + (MO01_HEADER_LEN if state._phase == EG_HEADER else 0)
        i += 1
    while i < n and need <= cap:
        need += MO01_HEADER_LEN + (records[i, 3] if records[i, 3] <= cap else cap + 1)
        i += 1
    return need


def write_egress_batch(Ring ring not None, EgressState state not None, const uint64_t[:, ::1] records not None,
                       Py_ssize_t start=0) -> tuple[int, int, bool]:
    """Write records[start:] back to back, one row per object: (object_id, sequence, src_addr, extent,
    flags). Each header, then its payload as space allows, in one native call with the GIL released;
    one commit store and at most one wake hint for the whole burst.

    Returns (index of the first row not yet fully written, bytes committed, whether to send
    RING_READABLE). After RING_WRITABLE, call again from that index; `state.busy` says that row is
    partly written. A row the spec refuses stops the burst before its header; the next call starting
    at it raises the typed ObjectHeaderError, so the rows before it are committed either way.
    """
    if records.shape[1] != 5:
        raise ValueError(f"records must have 5 columns, got {records.shape[1]}")
    if state._phase == EG_FAULTED:
        raise _errors().RingError(f"ring {ring.ring_id}: a partial egress object was abandoned; "
                                  f"the ring is faulted")
    ring._live()
    cdef Py_ssize_t i = start, n = records.shape[0]
    if i < 0 or i > n:
        raise IndexError(f"start {start} is outside the {n} records")
    if i == n:
        return (i, 0, False)
    if state._phase != EG_IDLE and (records[i, 0] != state.object_id or records[i, 1] != state.sequence
                                    or records[i, 3] != state.extent or records[i, 4] != state.flags):
        raise ValueError(f"ring {ring.ring_id}: object {state.object_id} seq {state.sequence} is still "
                         f"being written")
    cdef bint has_spec = state.spec is not None
    cdef uint64_t max_extent = state.spec.max_extent if has_spec else 0
    cdef uint64_t alignment = state.spec.alignment if has_spec else 0
    cdef bint strict = state.spec.strict if has_spec else False
    if state._phase == EG_IDLE:
        # the first row raises at once, so a refused object is typed exactly as write_egress types it
        if has_spec and mo01_check(records[i, 3], records[i, 1], max_extent, alignment, strict,
                                   state.expected_sequence) != MO01_OK:
            raise _failure(ObjectHeader(records[i, 0], records[i, 1], records[i, 3], records[i, 4]).encode(),
                           state.spec, state.expected_sequence)
        if records[i, 4] & ~(<uint64_t>MO01_FLAGS_KNOWN):
            raise ValueError(f"object {records[i, 0]}: flags 0x{records[i, 4]:x} set unknown bits")
    cdef uint8_t* hdr = ring._hdr
    cdef uint8_t* data = ring._data
    cdef uint64_t cap = ring.capacity
    cdef uint64_t commit
    cdef uint64_t free = _egress_space(ring, state, &commit, _burst_need(records, i, state, ring.capacity))
    cdef uint64_t written = 0, k, extent, src
    cdef uint8_t raw[MO01_HEADER_LEN]
    ring._busy += 1
    try:
        with nogil:
            while i < n:
                extent = records[i, 3]
                src = records[i, 2]
                if state._phase == EG_IDLE:
                    if (has_spec and mo01_check(extent, records[i, 1], max_extent, alignment, strict,
                                                state.expected_sequence) != MO01_OK) \
                            or (extent and not src) or records[i, 4] & ~(<uint64_t>MO01_FLAGS_KNOWN):
                        break  # the next call raises it typed, after this burst is committed
                    state.object_id = records[i, 0]
                    state.sequence = records[i, 1]
                    state.extent = extent
                    state.flags = <uint32_t>records[i, 4]
                    state.produced = 0
                    state._phase = EG_HEADER
                if state._phase == EG_HEADER:
                    if free < MO01_HEADER_LEN:
                        break
                    mo01_pack(raw, state.object_id, state.sequence, extent, state.flags)
                    ring_write(data, cap, commit, raw, MO01_HEADER_LEN)
                    commit += MO01_HEADER_LEN
                    free -= MO01_HEADER_LEN
                    written += MO01_HEADER_LEN
                    state._phase = EG_PAYLOAD
                k = extent - state.produced
                if k > free:
                    k = free
                if k:
                    ring_write(data, cap, commit, <const uint8_t*><uintptr_t>(src + state.produced), k)
                    commit += k
                    free -= k
                    written += k
                    state.produced += k
                if state.produced != extent:
                    break
                state._phase = EG_IDLE
                state.expected_sequence = state.sequence + 1
                state.objects_produced += 1
                i += 1
    finally:
        ring._busy -= 1
    if not written:
        if i < n and state._phase == EG_IDLE and records[i, 3] and not records[i, 2]:
            raise ValueError("a non-empty object needs a source address")
        return (i, 0, False)
    cr_store_release_u64(hdr + OFF_COMMIT, commit)
    return (i, written, not (cr_fetch_or_u32(hdr + OFF_WAKE, W_READABLE) & W_READABLE))


def buffer_records(list objects not None, uint64_t first_object_id, uint64_t first_sequence,
                   uint64_t flags=0):
    """The (N, 5) uint64 record table for write_egress_batch: consecutive object ids and sequences, each
    row's source address and extent taken from one buffer of `objects`. The addresses stay valid only
    while the caller keeps those objects alive and unresized."""
    import numpy as np
    cdef Py_ssize_t n = len(objects), j
    out = np.empty((n, 5), dtype=np.uint64)
    cdef uint64_t[:, ::1] rows = out
    cdef Py_buffer view
    for j in range(n):
        PyObject_GetBuffer(objects[j], &view, PyBUF_SIMPLE)
        rows[j, 0] = first_object_id + <uint64_t>j
        rows[j, 1] = first_sequence + <uint64_t>j
        rows[j, 2] = <uint64_t><uintptr_t>view.buf
        rows[j, 3] = <uint64_t>view.len
        rows[j, 4] = flags
        PyBuffer_Release(&view)
    return out
