"""Memory that a decode step streams through, on transparent huge pages where the kernel gives them.

A decode step reads every weight of the model once. Over 4 KiB pages that is a TLB miss every 4 KiB (about 200,000
a token for a 1 B-parameter Q4_K_M model), and the CPU's prefetchers stop at each page's end; over 2 MiB pages it is
one miss per 2 MiB. docs/performance.md gives what it is worth to the fused decoder.

Linux backs private anonymous memory advised MADV_HUGEPAGE with huge pages when
/sys/kernel/mm/transparent_hugepage/enabled is `always` or `madvise` (the usual default); elsewhere the advice is
ignored and the memory is ordinary pages, which is correct, only slower. tinygrad's CPU buffers are shared
anonymous memory, which takes huge pages only where shmem_enabled allows them (usually never), and the JIT cache's
restored buffers map its file: so the fused decoder's weights are copied into these mappings, at LOAD and at a
restore (worker/_jitfile.py).

No tinygrad here: the worker's cache files use it too.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap

HUGE_PAGE = 2 << 20

def mapping(size: int) -> tuple[mmap.mmap, int]:
    """A private anonymous mapping of at least `size` bytes, advised huge pages, and its address. The caller keeps
    the mapping for as long as anything may use the address."""
    mm = mmap.mmap(-1, max(size, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
                   prot=mmap.PROT_READ | mmap.PROT_WRITE)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        with contextlib.suppress(OSError):  # a kernel without transparent huge pages
            mm.madvise(mmap.MADV_HUGEPAGE)
    probe = ctypes.c_char.from_buffer(mm)
    address = ctypes.addressof(probe)
    del probe  # no export left, so the mapping goes when its last reference does
    return mm, address


def copied(address: int, size: int) -> tuple[mmap.mmap, int]:
    """A copy of `size` bytes at `address` in a mapping of its own (see mapping), and the copy's address."""
    mm, at = mapping(size)
    ctypes.memmove(at, address, size)
    return mm, at
