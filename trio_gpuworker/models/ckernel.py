"""The one module of models/ that touches tinygrad's internals: it runs C source as a tinygrad kernel.

A custom kernel whose body is a PROGRAM (C source for tinygrad's clang pipeline) is compiled, cached in
CACHEDB, captured by TinyJit and replayed like any kernel tinygrad generates, but it only runs where tinygrad
compiles C (the CPU device). Sources come from models/csource.py.
"""

from __future__ import annotations

import ctypes
import functools

import numpy as np
from tinygrad import Device, Tensor, UOp
from tinygrad.renderer import Estimates
from tinygrad.uop.ops import KernelInfo, Ops, ProgramInfo


def kernel(name: str, src: str, outs: list[Tensor], ins: list[Tensor], inout: tuple[int, ...] = (),
           ops: int = 0, mem: int = 0) -> list[Tensor]:
    """Run C `src` (one function `name` taking the buffers of outs then ins, in order) as a tinygrad kernel;
    `inout` are the indices of outs that it also reads (a KV cache). `ops`/`mem` are the estimates DEBUG=2
    shows."""
    n, target = len(outs) + len(ins), Device[outs[0].device].renderer.target

    def fxn(*ps: UOp) -> UOp:
        sink = UOp.sink(arg=KernelInfo(name, estimates=Estimates(ops=ops, lds=mem, mem=mem)))
        info = ProgramInfo(name, (1, 1, 1), (1, 1, 1), (), tuple(range(n)), tuple(range(len(outs))),
                           inout + tuple(range(len(outs), n)), target)
        return UOp(Ops.PROGRAM, src=(sink, UOp(Ops.LINEAR, src=ps), UOp(Ops.SOURCE, arg=src)), arg=info)

    return outs[0].custom_kernel(*outs[1:], *ins, fxn=fxn)[: len(outs)]


def compile_object(src: str, cpu: str | None = None) -> bytes:
    """`src` compiled exactly as tinygrad's CPU device compiles a kernel (its clang command and flags): an ELF
    object, which the ctypes tests link into a shared library. `cpu` replaces `native` in -march (a test
    compiles for CPUs it does not have)."""
    compiler = Device["CPU"].renderer.compiler
    if cpu is not None:
        compiler = type(compiler)([compiler.arch, cpu])
    return compiler.compile(src)


@functools.cache
def _thread_functions() -> tuple[int, ...]:
    libc = ctypes.CDLL(None)
    fns = tuple(ctypes.cast(getattr(libc, f), ctypes.c_void_p).value or 0
                for f in ("pthread_create", "pthread_join", "sched_yield"))
    if not all(fns):
        raise RuntimeError("pthread_create, pthread_join or sched_yield is not in this process")
    return fns


def thread_table(threads: int) -> np.ndarray:
    """kernels/threads.h's thread_table: the addresses of pthread_create, pthread_join and sched_yield, then
    the threads wanted. A freestanding kernel links nothing, so it calls these through the table; the
    addresses hold for this process only, so the table is written where it runs, never stored."""
    return np.array([*_thread_functions(), threads], dtype=np.uint64)
