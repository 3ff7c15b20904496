"""C kernels on their own, through ctypes: the source models/csource.py builds, compiled by the very compiler
command and flags tinygrad's CPU device uses (models/ckernel.compile_object), then linked into a shared library."""

from __future__ import annotations

import ctypes
import struct
import subprocess
import tempfile
from dataclasses import make_dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from trio_gpuworker.models import ckernel, csource

TEST_KERNELS = resources.files("tests.support") / "kernels"


def build(name: str, *specs: Any, cpu: str | None = None) -> ctypes.CDLL:
    """Kernel file `name` (tests/support/kernels first, then the package's) with the defines of `specs`, as a library;
    `cpu` as in ckernel.compile_object (this host's by default)."""
    src = csource.source(name, *specs, dirs=(TEST_KERNELS,))
    obj = ckernel.compile_object(src, cpu)
    assert not imports(obj), f"{name} calls outside itself: {imports(obj)} (kernels/threads.h host_table)"
    with tempfile.TemporaryDirectory(prefix="ckernel-") as tmp:
        o, so = Path(tmp) / "k.o", Path(tmp) / "k.so"
        o.write_bytes(obj)
        subprocess.run(["clang", "-shared", "-nostdlib", "-o", str(so), str(o)], check=True)
        return ctypes.CDLL(str(so))  # the mapping outlives the file


def _symbols(obj: bytes) -> tuple[list[tuple[str, int, int]], list[int]]:
    """An ELF64 object's symbols as (name, section index, value), and the indices of its PROGBITS sections."""
    shoff, = struct.unpack_from("<Q", obj, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", obj, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", obj, shoff + i * shentsize) for i in range(shnum)]
    syms = []
    for _, kind, _, _, off, size, link, _, _, entsize in sections:
        if kind != 2:  # SHT_SYMTAB
            continue
        strtab = sections[link][4]
        for at in range(off + entsize, off + size, entsize):  # entry 0 is the null symbol
            name, _, _, shndx, value = struct.unpack_from("<IBBHQ", obj, at)
            if name:
                syms.append((obj[strtab + name: obj.index(b"\0", strtab + name)].decode(), shndx, value))
    return syms, [i for i, sh in enumerate(sections) if sh[1] == 1]  # SHT_PROGBITS


def imports(obj: bytes) -> set[str]:
    """The symbols an ELF64 object leaves undefined: what tinygrad's loader would link against libc or libm
    (kernels/threads.h says why a kernel must leave none)."""
    return {name for name, shndx, _ in _symbols(obj)[0] if shndx == 0}


def entry_first(obj: bytes, name: str) -> bool:
    """Whether function `name` starts the object's first PROGBITS section: tinygrad's CPU device lays those out in
    order and calls the first byte of the image, whatever the kernel's name."""
    syms, progbits = _symbols(obj)
    return (name, progbits[0], 0) in syms


def ptr(a: np.ndarray) -> ctypes.c_void_p:
    assert a.flags.c_contiguous
    return ctypes.c_void_p(a.ctypes.data)


def spec(**values: int | float) -> Any:
    """A frozen dataclass instance of ad-hoc defines for a test entry point (csource.defines reads it)."""
    return make_dataclass("Spec", list(values), frozen=True)(**values)


def _host_has(*flags: str) -> bool:
    with open("/proc/cpuinfo") as f:
        have = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    return all(flag in have for flag in flags)


# `cpu` parameters: the AVX2 path runs here too when this CPU has AVX-512 (and the AVX-512 path is this host's,
# when it has it)
ISAS = [pytest.param(None, id="native"),
        pytest.param("x86-64-v3", id="avx2", marks=pytest.mark.skipif(not _host_has("avx2", "fma"),
                                                                   reason="this CPU runs no AVX2"))]
