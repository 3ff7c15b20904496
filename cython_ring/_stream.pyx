# cython: annotation_typing=False
# Annotations document the Python API; arguments are checked below so errors stay typed.
"""The byte streams over a ring (spec §11): the ingress drain (one native call parses, validates and
copies every committed object prefix) and the egress writer, with their per-ring parser states."""

from cpython.buffer cimport PyBUF_SIMPLE, PyBuffer_Release, PyObject_GetBuffer
from libc.stdint cimport uint8_t, uint32_t, uint64_t, uintptr_t

from cython_ring._mo01 cimport (
    MO01_EXTENT_EXCEEDS_MAX,
    MO01_FLAGS_KNOWN,
    MO01_HEADER_LEN,
    MO01_OK,
    Mo01Header,
    Mo01Status,
    ObjectSpec,
    _errors,
    mo01_check,
    mo01_pack,
    mo01_parse,
)
from cython_ring._ring cimport (
    OFF_COMMIT,
    OFF_CONSUME,
    OFF_STATE,
    OFF_WAKE,
    S_ACTIVE,
    S_CLOSED,
    S_FAULTED,
    W_READABLE,
    W_WRITABLE,
    Ring,
    cr_cas_u32,
    cr_fetch_and_u32,
    cr_fetch_or_u32,
    cr_load_acquire_u32,
    cr_load_acquire_u64,
    cr_load_relaxed_u64,
    cr_store_release_u64,
    ring_read,
    ring_read_big,
    ring_write,
    ring_write_big,
)

from cython_ring._mo01 import ObjectHeader, _failure
from cython_ring._ring import _STATE_NAMES, _u64_arg


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
                  dst_resolver: object, flush: object = None,
                  Py_ssize_t max_objects=0) -> list[tuple[object, ...]]:
    """Parse, validate and copy everything committed; advance consume behind the copies.

    `dst_resolver(object_id, sequence, extent) -> (address, size)` is called once per valid
    header, after validation and before any payload byte moves; it names the destination's host
    address (size >= extent). Its exceptions become a device_allocation_failed event.

    With `flush`, a size below the extent names a window instead: payload streams through it,
    and `flush(offset, n)` is called each time the window is full or the object ends, to move
    window bytes [0, n) to object bytes [offset, offset + n) (a device copy) before the window is
    reused. So an object never needs host memory of its own size. Exceptions from flush become a
    device_copy_failed event.

    `max_objects` > 0 stops the drain after that many loaded objects, so a consumer can hand a
    first part of a long burst on while the rest waits; the caller drains again itself (no new
    hint comes for bytes already committed).

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
    cdef Py_ssize_t loaded_now = 0
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
                    if (size < h.extent and (flush is None or size == 0)) or (dst == 0 and h.extent):
                        raise ValueError(f"destination ({dst:#x}, {size}) cannot hold extent {h.extent}")
                except Exception as exc:
                    state.last_exception = exc
                    _object_failed(events, hdr, state, "device_allocation_failed",
                                   f"object {h.object_id} seq {h.sequence}: {type(exc).__name__}: {exc}",
                                   h.object_id, h.sequence)
                    break
                consume += MO01_HEADER_LEN
                state._dst = dst
                state._window = size if size < h.extent else 0
                state._filled = 0
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
                if state._window:
                    if n > state._window - state._filled:
                        n = state._window - state._filled
                    ring_read_big(data, cap, consume, <uint8_t*><uintptr_t>(state._dst + state._filled), n)
                    state._filled += n
                else:
                    ring_read_big(data, cap, consume, <uint8_t*><uintptr_t>(state._dst + state.copied), n)
                consume += n
                state.copied += n
                # Release ring space as soon as it is copied: large objects need it to stream.
                cr_store_release_u64(hdr + OFF_CONSUME, consume)
                published = consume
                if state._window and (state._filled == state._window or state.copied == state.extent):
                    try:
                        flush(state.copied - state._filled, state._filled)
                    except Exception as exc:
                        state.last_exception = exc
                        _object_failed(events, hdr, state, "device_copy_failed",
                                       f"object {state.object_id} seq {state.sequence}: {type(exc).__name__}: "
                                       f"{exc}", state.object_id, state.sequence)
                        break
                    state._filled = 0
            if state.copied == state.extent:
                if published != consume:
                    cr_store_release_u64(hdr + OFF_CONSUME, consume)
                    published = consume
                state._phase = IN_NEED_HEADER
                state.objects_loaded += 1
                events.append(("loaded", state.object_id, state.sequence, state.extent, state.flags))
                loaded_now += 1
                if loaded_now == max_objects:
                    break
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
