"""Two real processes over one memfd ring: random chunking, wake hints on a socket, checksums.

The parent produces and the child consumes; each side blocks on the socketpair for the other's
hint (never spins), exactly as the daemon's pump and the worker do.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import random
import socket
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cython_ring import EgressState, ObjectSpec, Ring, write_egress

OFFSET = 4096  # a lease that does not start at the arena's beginning
RING_ID = 3
HINT_TIMEOUT_S = 30.0
SPEC_WIRE = {"kind": "tensor", "max_extent": 1 << 22, "alignment": 8, "dtype": "uint8", "shape": [],
             "sequence_policy": "strict"}

CHILD = textwrap.dedent(
    """
    import ctypes, hashlib, json, mmap, random, socket, sys
    from cython_ring import IngressState, ObjectSpec, Ring, STATE_CLOSED, drain_ingress

    mode, mem_fd, sock_fd, size, offset, ring_id, capacity, seed = sys.argv[1:9]
    arena = mmap.mmap(int(mem_fd), int(size))
    ring = Ring.attach(arena, int(offset), expected_ring_id=int(ring_id), expected_capacity=int(capacity))
    sock = socket.socket(fileno=int(sock_fd))
    sock.settimeout(30.0)
    rng = random.Random(int(seed))

    def wait_hint():
        if not sock.recv(64):
            sys.exit("producer went away")

    def consume_bytes():
        digest, total, buf = hashlib.sha256(), 0, bytearray(1 << 20)
        while True:
            wait_hint()
            while True:  # drain until no progress
                closed = ring.state == STATE_CLOSED
                n = min(ring.readable, rng.randint(1, len(buf)))
                if not n:
                    # about to wait: arm the hint, then look once more so a commit in between is not missed.
                    # Clearing only here (not before every look) keeps hints to one per wait, so neither
                    # side's socket fills with hints the other is too busy to read.
                    ring.clear_readable()
                    closed = ring.state == STATE_CLOSED
                    n = min(ring.readable, rng.randint(1, len(buf)))
                if not n:
                    if closed:
                        return f"{total} {digest.hexdigest()}"
                    break
                ring.copy_out(buf, 0, n)
                digest.update(memoryview(buf)[:n])
                total += n
                if ring.mark_writable():
                    sock.send(b"W")

    def consume_objects():
        state, spec, pending, lines = IngressState(), ObjectSpec.from_wire(json.loads(sys.argv[9])), {}, []

        def resolve(object_id, sequence, extent):
            buf = bytearray(max(extent, 1))
            view = (ctypes.c_char * len(buf)).from_buffer(buf)
            pending[object_id] = (buf, view)
            return ctypes.addressof(view), extent

        while state.phase != "closed":
            wait_hint()
            for event in drain_ingress(ring, state, spec, resolve):
                if event[0] == "loaded":
                    _, object_id, sequence, extent, flags = event
                    buf, view = pending.pop(object_id)
                    del view
                    lines.append(f"{object_id} {sequence} {extent} {flags} "
                                 f"{hashlib.sha256(buf[:extent]).hexdigest()}")
                elif event[0] == "writable":
                    sock.send(b"W")
                elif event[0] != "header" and event[0] != "closed":
                    sys.exit(f"unexpected event {event}")
        return "\\n".join(lines)

    print(consume_bytes() if mode == "bytes" else consume_objects(), flush=True)
    ring.release()
    """
)


class Link:
    """The parent's end: the shared ring, the hint socket and the child process."""

    def __init__(self, ring: Ring, sock: socket.socket, proc: subprocess.Popen[str]) -> None:
        self.ring, self.sock, self.proc = ring, sock, proc

    def wait_writable(self) -> None:
        if not self.sock.recv(64):
            _, err = self.proc.communicate(timeout=HINT_TIMEOUT_S)
            pytest.fail(f"consumer exited early: {err}")

    def hint_readable(self) -> None:
        if self.ring.mark_readable():
            self.sock.send(b"R")

    def finish(self) -> str:
        self.ring.close()
        self.hint_readable()
        out, err = self.proc.communicate(timeout=60)
        assert self.proc.returncode == 0, err
        return out.strip()


@contextmanager
def child(mode: str, capacity: int, seed: int) -> Iterator[Link]:
    size = OFFSET + 128 + capacity
    mem_fd = os.memfd_create("ring-test")
    ours, theirs = socket.socketpair()
    arena: mmap.mmap | None = None
    try:
        os.ftruncate(mem_fd, size)
        arena = mmap.mmap(mem_fd, size)
        ring = Ring.init(arena, OFFSET, RING_ID, capacity)
        args = [mode, mem_fd, theirs.fileno(), size, OFFSET, RING_ID, capacity, seed, json.dumps(SPEC_WIRE)]
        proc = subprocess.Popen([sys.executable, "-c", CHILD, *map(str, args)], pass_fds=(mem_fd, theirs.fileno()),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        theirs.close()
        ours.settimeout(HINT_TIMEOUT_S)
        try:
            with ring:
                yield Link(ring, ours, proc)
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.communicate()
    finally:
        ours.close()
        theirs.close()
        if arena is not None:
            arena.close()
        os.close(mem_fd)


def produce_bytes(link: Link, data: bytes, chunks: list[int]) -> None:
    ring, pos, i = link.ring, 0, 0
    while pos < len(data):
        want = min(chunks[i % len(chunks)], len(data) - pos)
        i += 1
        n = min(ring.writable, want)
        if not n:
            ring.clear_writable()  # arm the hint, then look again so a consume in between is not missed
            n = min(ring.writable, want)
        if not n:
            link.wait_writable()
            continue
        pos += ring.copy_in(data, pos, n)
        link.hint_readable()


# Small rings force many hint round trips (~100 us each); sizes scale with the ring to bound time.
CAPACITIES = st.sampled_from([64, 4096, 1 << 16])
PROCESS_SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROCESS_SETTINGS
@given(ring_and_size=CAPACITIES.flatmap(lambda c: st.tuples(st.just(c), st.integers(0, min(1 << 20, 64 * c)))),
       chunks=st.lists(st.integers(1, 1 << 17), min_size=1, max_size=6), seed=st.integers(0, 2**32))
def test_bytes_cross_processes_intact(ring_and_size: tuple[int, int], chunks: list[int], seed: int) -> None:
    capacity, size = ring_and_size
    data = random.Random(seed).randbytes(size)
    with child("bytes", capacity, seed) as link:
        produce_bytes(link, data, chunks)
        assert link.finish() == f"{size} {hashlib.sha256(data).hexdigest()}"
        assert link.ring.commit == link.ring.consume == size


def test_large_transfer_cross_processes() -> None:
    # 64 MiB through a 1 MiB ring: the copies above the GIL threshold, both sides busy at once.
    data = np.random.default_rng(7).integers(0, 256, 64 << 20, dtype=np.uint8).tobytes()
    with child("bytes", 1 << 20, 11) as link:
        produce_bytes(link, data, [1 << 20, 300_000, 4096, 777_777])
        assert link.finish() == f"{len(data)} {hashlib.sha256(data).hexdigest()}"


@PROCESS_SETTINGS
@given(ring_and_sizes=CAPACITIES.flatmap(
           lambda c: st.tuples(st.just(c), st.lists(st.integers(0, c // 2).map(lambda n: 8 * n), max_size=10))),
       seed=st.integers(0, 2**32))
def test_objects_cross_processes_intact(ring_and_sizes: tuple[int, list[int]], seed: int) -> None:
    # Objects up to 4x the ring: most stream through in several drains.
    capacity, sizes = ring_and_sizes
    rng = np.random.default_rng(seed)
    objects = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
    egress = EgressState(ObjectSpec.from_wire(SPEC_WIRE))
    with child("objects", capacity, seed) as link:
        for sequence, src in enumerate(objects):
            flags = 1 if sequence == len(objects) - 1 else 0
            while True:
                _, hint = write_egress(link.ring, egress, 1000 + sequence, sequence, src.ctypes.data,
                                       src.nbytes, flags)
                if hint:
                    link.sock.send(b"R")
                if not egress.busy:
                    break
                link.wait_writable()
        lines = link.finish().splitlines()
    expected = [f"{1000 + i} {i} {o.nbytes} {int(i == len(objects) - 1)} {hashlib.sha256(o).hexdigest()}"
                for i, o in enumerate(objects)]
    assert lines == expected
