# cython: annotation_typing=False
# Annotations document the Python API; arguments are checked below so errors stay typed.
"""The ingress byte stream over a ring (see docs/architecture.md, 'Ingress and egress'): one native call parses,
validates and copies every
committed object prefix, with the per-ring parser state. The egress writers are in _egress.pyx.

drain_batch takes destinations from a DestPool and writes completions into a Completions batch, so its loop
runs with the GIL released and calls no Python; drain_ingress is the same loop with a per-object Python
resolver (and optional window flush) and a list of event tuples, for callers whose destinations depend on
each object."""

from libc.stdint cimport uint8_t, uint32_t, uint64_t, uintptr_t

from cython_ring._batch cimport REC_HEADER, REC_LOADED, BatchRecord, Completions, DestPool

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
)

from cython_ring._mo01 import _failure
from cython_ring._ring import _u64_arg
from cython_ring.records import Completion, DrainEnd


# --- ingress: one native call per drain (docs/architecture.md, 'Ingress and egress') ------------

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


# Why the drain loop stopped; the events that need Python (messages) are built after it, with the GIL.
cdef enum:
    STOP_IDLE = 0        # no more committed bytes (or the pool needs refilling, or max_objects)
    STOP_PEER_FAULTED = 1
    STOP_BAD_STATE = 2
    STOP_BAD_CURSORS = 3
    STOP_CLOSED = 4
    STOP_EOF_HEADER = 5
    STOP_EOF_PAYLOAD = 6
    STOP_BAD_HEADER = 7
    STOP_ALLOC = 8       # the resolver failed: its message is in `failure`
    STOP_FLUSH = 9       # the window flush failed: its message is in `failure`
    STOP_NOMEM = 10


cdef int _resolve(object resolver, object flush, IngressState state, Mo01Header* h, uint64_t* dst,
                  uint64_t* size, list failure) except -1:
    # Returns 1 with failure[0] set when the resolver refused the object (a device_allocation_failed).
    try:
        addr, size_obj = resolver(h.object_id, h.sequence, h.extent)
        dst[0] = _u64_arg(addr, "destination address")
        size[0] = _u64_arg(size_obj, "destination size")
        if (size[0] < h.extent and (flush is None or size[0] == 0)) or (dst[0] == 0 and h.extent):
            raise ValueError(f"destination ({dst[0]:#x}, {size[0]}) cannot hold extent {h.extent}")
    except Exception as exc:
        state.last_exception = exc
        failure.append(f"object {h.object_id} seq {h.sequence}: {type(exc).__name__}: {exc}")
        return 1
    return 0


cdef int _flush(object flush, IngressState state, list failure) except -1:
    try:
        flush(state.copied - state._filled, state._filled)
    except Exception as exc:
        state.last_exception = exc
        failure.append(f"object {state.object_id} seq {state.sequence}: {type(exc).__name__}: {exc}")
        return 1
    return 0


cdef inline bint _record(Completions out, uint32_t kind, IngressState state) noexcept nogil:
    # Capacity for this record was reserved before its header was consumed, so this cannot fail.
    cdef BatchRecord* r = &out._rec[out._n]
    r.object_id = state.object_id
    r.sequence = state.sequence
    r.extent = state.extent
    r.flags = state.flags
    r.kind = kind
    out._n += 1
    return True


cdef int _drain(Ring ring, IngressState state, ObjectSpec spec, DestPool pool, object resolver, object flush,
                Completions out, Py_ssize_t max_objects) except -1:
    """The one drain loop (see drain_ingress). With a pool it never takes the GIL; with a resolver it takes it
    once per header (and per window flush). Writes every record and the end into `out`."""
    out._reset()
    out.end = None
    out.need = None
    if state._phase >= IN_FAULTED:
        return 0
    ring._live()
    # Room for the loaded record of an object a previous call started; each header reserves its own two.
    if out._cap < 2 and out._grow() < 0:
        raise MemoryError("no memory for the drain's completion records")
    cdef uint8_t* hdr = ring._hdr
    cdef uint8_t* data = ring._data
    cdef uint64_t cap = ring.capacity
    cdef uint64_t start, consume, published, commit, avail = 0, n, dst, size
    cdef uint32_t st = 0
    cdef uint8_t raw[MO01_HEADER_LEN]
    cdef Mo01Header h
    cdef Mo01Status status = MO01_OK
    cdef bint short, use_pool = pool is not None, needs = False, record_headers = out._headers
    cdef bint has_flush = flush is not None
    cdef int stop = STOP_IDLE, failed
    cdef Py_ssize_t loaded_now = 0
    cdef uint64_t max_extent = spec.max_extent, alignment = spec.alignment
    cdef bint strict = spec.strict
    cdef list failure = []
    ring._busy += 1
    try:
        with nogil:
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
                        stop = STOP_PEER_FAULTED
                        break
                    if st != S_ACTIVE and st != S_CLOSED:
                        stop = STOP_BAD_STATE
                        break
                    if commit < consume or commit - consume > cap:
                        stop = STOP_BAD_CURSORS
                        break
                    avail = commit - consume
                    short = avail < MO01_HEADER_LEN if state._phase == IN_NEED_HEADER else avail == 0
                    if short:
                        if st == S_CLOSED:
                            if state._phase == IN_NEED_HEADER and avail == 0:
                                stop = STOP_CLOSED
                            elif state._phase == IN_NEED_HEADER:
                                stop = STOP_EOF_HEADER
                            else:
                                stop = STOP_EOF_PAYLOAD
                        break

                if state._phase == IN_NEED_HEADER:
                    ring_read(data, cap, consume, raw, MO01_HEADER_LEN)
                    status = mo01_parse(raw, &h)
                    if status == MO01_OK:
                        status = mo01_check(h.extent, h.sequence, max_extent, alignment, strict,
                                            state.expected_sequence)
                    if status != MO01_OK:
                        stop = STOP_BAD_HEADER
                        break
                    # Room for this object's header and loaded records, before anything is consumed.
                    if out._n + 2 > out._cap and out._grow() < 0:
                        stop = STOP_NOMEM
                        break
                    if use_pool:
                        if pool._head == pool._tail or pool._size[pool._head] < h.extent or (
                                pool.exact and pool._size[pool._head] != h.extent):
                            needs = True
                            break
                        dst = pool._addr[pool._head]
                        size = pool._size[pool._head]
                        pool._head += 1
                        pool.taken += 1
                    else:
                        with gil:
                            failed = _resolve(resolver, flush, state, &h, &dst, &size, failure)
                        if failed:
                            stop = STOP_ALLOC
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
                    if record_headers:
                        _record(out, REC_HEADER, state)
                    continue

                n = state.extent - state.copied
                if n:
                    if n > avail:
                        n = avail
                    if state._window:
                        if n > state._window - state._filled:
                            n = state._window - state._filled
                        ring_read(data, cap, consume, <uint8_t*><uintptr_t>(state._dst + state._filled), n)
                        state._filled += n
                    else:
                        ring_read(data, cap, consume, <uint8_t*><uintptr_t>(state._dst + state.copied), n)
                    consume += n
                    state.copied += n
                    # Release ring space as soon as it is copied: large objects need it to stream.
                    cr_store_release_u64(hdr + OFF_CONSUME, consume)
                    published = consume
                    if state._window and (state._filled == state._window or state.copied == state.extent):
                        with gil:
                            failed = _flush(flush, state, failure)
                        if failed:
                            stop = STOP_FLUSH
                            break
                        state._filled = 0
                if state.copied == state.extent:
                    if published != consume:
                        cr_store_release_u64(hdr + OFF_CONSUME, consume)
                        published = consume
                    state._phase = IN_NEED_HEADER
                    state.objects_loaded += 1
                    _record(out, REC_LOADED, state)
                    out.loaded += 1
                    out.loaded_bytes += state.extent
                    loaded_now += 1
                    if loaded_now == max_objects:
                        out.more = True
                        break
    finally:
        if published != consume:
            cr_store_release_u64(hdr + OFF_CONSUME, consume)
        ring._busy -= 1
    state.bytes_consumed += consume - start
    if needs:
        out.need = Completion(h.object_id, h.sequence, h.extent, h.flags)
    if stop != STOP_IDLE:
        _stopped(ring, state, spec, out, stop, st, commit, consume, avail, raw, &h, status, failure)
    if consume != start and state._phase < IN_FAULTED:
        out.writable = not (cr_fetch_or_u32(hdr + OFF_WAKE, W_WRITABLE) & W_WRITABLE)
    return 0


cdef int _stopped(Ring ring, IngressState state, ObjectSpec spec, Completions out, int stop, uint32_t st,
                  uint64_t commit, uint64_t consume, uint64_t avail, uint8_t* raw, Mo01Header* h,
                  Mo01Status status, list failure) except -1:
    # Stream alignment is lost on every stop but a clean close and a peer's own fault, so the producer must
    # stop too: fault the shared state.
    cdef uint64_t rid = ring.ring_id
    if stop == STOP_NOMEM:
        raise MemoryError("no memory for the drain's completion records")
    if stop == STOP_CLOSED:
        state._phase = IN_CLOSED
        out.end = DrainEnd("closed")
        return 0
    state._phase = IN_FAULTED
    if stop == STOP_PEER_FAULTED:
        out.end = DrainEnd("ring_fault", "ring_state_invalid", f"ring {rid} is faulted")
        return 0
    _fault_shared(ring._hdr)
    if stop == STOP_BAD_STATE:
        out.end = DrainEnd("ring_fault", "ring_state_invalid", f"ring {rid}: state {st} is not 1, 2 or 3")
    elif stop == STOP_BAD_CURSORS:
        out.end = DrainEnd("ring_fault", "ring_state_invalid", f"ring {rid}: commit {commit} and consume "
                           f"{consume} violate 0 <= commit - consume <= capacity {ring.capacity}")
    elif stop == STOP_EOF_HEADER:
        out.end = DrainEnd("failed", "eof_mid_object", f"ring {rid} closed {avail} bytes into an object header")
    elif stop == STOP_EOF_PAYLOAD:
        out.end = DrainEnd("failed", "eof_mid_object", f"ring {rid} closed after {state.copied} of "
                           f"{state.extent} payload bytes", state.object_id, state.sequence)
    elif stop == STOP_BAD_HEADER:
        exc = _failure(raw[:MO01_HEADER_LEN], spec, state.expected_sequence)
        known = status >= MO01_EXTENT_EXCEEDS_MAX
        out.end = DrainEnd("failed", exc.code, str(exc), h.object_id if known else None,
                           h.sequence if known else None)
    elif stop == STOP_ALLOC:
        out.end = DrainEnd("failed", "device_allocation_failed", failure[0], h.object_id, h.sequence)
    elif stop == STOP_FLUSH:
        out.end = DrainEnd("failed", "device_copy_failed", failure[0], state.object_id, state.sequence)
    return 0


def drain_batch(Ring ring not None, IngressState state not None, ObjectSpec spec not None,
                DestPool pool not None, Completions out not None, Py_ssize_t max_objects=0) -> int:
    """drain_ingress without Python per object: each valid header takes the pool's oldest destination (see
    DestPool), completions go into `out` (cleared first), and the loop runs with the GIL released. Returns the
    number of objects loaded. Stops early, header unconsumed, with `out.need` set when the pool has nothing
    that fits the next object; the caller refills and drains again (no new hint comes for those bytes)."""
    _drain(ring, state, spec, pool, None, None, out, max_objects)
    return out.loaded


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
    cdef Completions out = Completions()
    out._headers = True
    _drain(ring, state, spec, None, dst_resolver, flush, out, max_objects)
    return out.events()
