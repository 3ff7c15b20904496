# cython: annotation_typing=False
# Annotations document the Python API; arguments are checked below so errors stay typed.
"""The ingress byte stream over a ring (spec §11.1): one native call parses, validates and copies every
committed object prefix, with the per-ring parser state. The egress writers are in _egress.pyx."""

from libc.stdint cimport uint8_t, uint32_t, uint64_t, uintptr_t

from cython_ring._mo01 cimport (
    MO01_EXTENT_EXCEEDS_MAX,
    MO01_HEADER_LEN,
    MO01_OK,
    Mo01Header,
    Mo01Status,
    ObjectSpec,
    mo01_check,
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
    _fault_shared,
    cr_fetch_and_u32,
    cr_fetch_or_u32,
    cr_load_acquire_u32,
    cr_load_acquire_u64,
    cr_load_relaxed_u64,
    cr_store_release_u64,
    ring_read,
    ring_read_big,
)

from cython_ring._mo01 import _failure
from cython_ring._ring import _u64_arg


# --- ingress: one native call per drain (spec §11.1) ----------------------------------------

cdef enum:
    IN_NEED_HEADER = 0
    IN_NEED_PAYLOAD = 1
    IN_FAULTED = 2
    IN_CLOSED = 3

_INGRESS_PHASES = ("need_header", "need_payload", "faulted", "closed")


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
