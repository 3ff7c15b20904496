"""The fused decoder runs wherever its kernels are mapped (kernels/threads.h host_table). tinygrad's loader
resolves a call to libm as a 32-bit displacement from the kernel's pages, so a kernel that called expf directly
jumped to anywhere once those pages landed over 2 GiB from libm: CI's pytest process, with torch and several models
mapped, crashed with SIGSEGV in tests/test_llama_batched.py, and so does this test on that kernel (exit -11). That
no kernel object imports a symbol is checked in tests/test_bert_kernels.py."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from tests.support.reference_llama import gguf_path

pytestmark = pytest.mark.slow


# Reserves address space right below what is mapped once tinygrad has loaded libm, so the kernels compiled after
# it are mapped further down (mmap places top-down): over 2 GiB from libm, short of 4 GiB (where the loader's
# struct.pack would raise rather than write a wrong displacement). PROT_NONE and MAP_NORESERVE: never committed.
# The child checks that premise: the reservation lies between libm's expf and whatever is mapped after it.
FAR_FROM_LIBM = textwrap.dedent("""
    import ctypes, ctypes.util, mmap, sys
    import numpy as np
    from tinygrad import Device
    Device["CPU"]
    libc = ctypes.CDLL(None)
    libc.mmap.restype, libc.mmap.argtypes = ctypes.c_void_p, (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                                              ctypes.c_int, ctypes.c_int, ctypes.c_long)
    size = 5 << 29
    gap = libc.mmap(None, size, 0, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | 0x4000, -1, 0)  # PROT_NONE, NORESERVE
    expf = ctypes.cast(ctypes.CDLL(ctypes.util.find_library("m")).expf, ctypes.c_void_p).value
    assert gap not in (None, ctypes.c_void_p(-1).value) and expf - gap > 2 << 30, (hex(gap), hex(expf))
    from trio_gpuworker.models.llama_fused import FusedLlamaLM
    lm = FusedLlamaLM.load(sys.argv[1], max_context=64, warmup=False)
    ids, reason = lm.generate(np.array([1, 504, 3458, 314], np.int32), 4, ignore_eos=True)
    print(len(ids), reason)
""")


def test_the_decoder_runs_with_its_kernels_over_2_gib_from_libm() -> None:
    proc = subprocess.run([sys.executable, "-c", FAR_FROM_LIBM, str(gguf_path())], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, f"exit {proc.returncode}: {proc.stderr[-3000:]}"
    assert proc.stdout.split()[-2:] == ["4", "length"]
