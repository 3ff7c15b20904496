"""The fused kernels link nothing (kernels/threads.h host_table). tinygrad's loader resolves a call to libm as a
32-bit displacement from the kernel's pages, so a kernel that called expf directly jumped to anywhere once
those pages landed over 2 GiB from libm: CI's pytest process, with torch and several models mapped, crashed
with SIGSEGV in tests/test_llama_batched.py. Both checks here failed on that kernel."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from tests.ckernels import imports
from tests.reference_llama import gguf_path
from trio_gpuworker.models import ckernel
from trio_gpuworker.models.llama_fused import STEPS, FusedLlamaLM

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("cpu", [None, "x86-64-v3", "x86-64-v4"], ids=["native", "avx2", "avx512"])
def test_every_decoder_step_compiles_to_an_object_that_imports_nothing(cpu: str | None) -> None:
    """On this host's ISA and on both vector paths of the kernels (a CI host may have AVX-512 when this has not)."""
    lm = FusedLlamaLM.load(gguf_path(), max_context=512, warmup=False)
    for t in STEPS:
        assert imports(ckernel.compile_object(lm.source(t), cpu)) == set(), f"step T={t}"


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
