"""The one module of models/ that touches tinygrad's internals: it runs C source as a tinygrad kernel.

A custom kernel whose body is a PROGRAM (C source for tinygrad's clang pipeline) is compiled, cached in
CACHEDB, captured by TinyJit and replayed like any kernel tinygrad generates, but it only runs where tinygrad
compiles C (the CPU device). Sources come from models/csource.py.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from typing import Any

import numpy as np
from tinygrad import Device, Tensor, UOp
from tinygrad.device import Buffer
from tinygrad.renderer import Estimates
from tinygrad.uop.ops import KernelInfo, Ops, ProgramInfo

from .._cores import step_threads


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


class Replay:
    """A captured TinyJit of one compiled program, run straight through the program's runtime with the buffers the
    capture bound. TinyJit's own replay rewrites its captured graph on every call: for the fused decoder's one-kernel
    step that cost about 1.4 ms a step (SmolLM2-135M on a Zen 4 core: 5.1 ms a step against 3.8 ms), as much as a
    quarter of the step. `of` gives None for a JIT not yet captured, or one whose graph is anything but one
    program on one device (the JIT's replay then stays the way)."""

    def __init__(self, run: Any, args: list[Any], launch: dict[str, Any], out: memoryview) -> None:
        self._run, self._args, self._launch = run, args, launch
        self.out = out  # the program's first output buffer, as the capture bound it

    @staticmethod
    def of(jit: Any, inputs: list[Tensor]) -> Replay | None:
        from tinygrad.engine.realize import get_runtime, resolve_params

        captured = getattr(jit, "captured", None)
        if captured is None or len(calls := captured.linear.src) != 1 or calls[0].src[0].op is not Ops.PROGRAM:
            return None
        call, ast = calls[0], calls[0].src[0]
        device = call.src[1].device
        resolved = resolve_params(call, tuple(t.uop.base for t in inputs))
        bufs = [resolved[i].buffer for i in ast.arg.globals]
        if not isinstance(device, str) or not all(isinstance(b, Buffer) for b in bufs):
            return None
        args = [b.ensure_allocated().get_buf(device) for b in bufs]
        global_size, local_size = ast.arg.launch_dims({})
        launch = {"global_size": global_size, "local_size": local_size, "vals": ast.arg.vals({})}
        return Replay(get_runtime(device, ast), args, launch, bufs[0].as_memoryview(force_zero_copy=True))

    def __call__(self) -> memoryview:
        self._run(*self._args, **self._launch)
        return self.out


def compile_object(src: str, cpu: str | None = None) -> bytes:
    """`src` compiled exactly as tinygrad's CPU device compiles a kernel (its clang command and flags): an ELF
    object, which the ctypes tests link into a shared library. `cpu` replaces `native` in -march (a test
    compiles for CPUs it does not have)."""
    compiler = Device["CPU"].renderer.compiler
    if cpu is not None:
        compiler = type(compiler)([compiler.arch, cpu])
    return compiler.compile(src)


HOST_TABLE_WORDS = 5  # kernels/threads.h host_table: four function addresses, then the threads wanted
_HOST_FUNCTIONS = (("pthread_create", "c"), ("pthread_join", "c"), ("sched_yield", "c"), ("expf", "m"))


@functools.cache
def _host_functions() -> tuple[int, ...]:
    libs = {"c": ctypes.CDLL(None), "m": ctypes.CDLL(ctypes.util.find_library("m") or "libm.so.6")}
    fns = tuple(ctypes.cast(getattr(libs[lib], f), ctypes.c_void_p).value or 0 for f, lib in _HOST_FUNCTIONS)
    if not all(fns):
        raise RuntimeError(f"{', '.join(f for f, _ in _HOST_FUNCTIONS)} are not all in this process")
    return fns


def host_table(threads: int) -> np.ndarray:
    """kernels/threads.h's host_table: the addresses of pthread_create, pthread_join, sched_yield and expf,
    then the threads wanted (`threads`, or AUTO_THREADS: the worker's share of the node's cores now, _cores.py).
    A kernel calls these through the table and links nothing: tinygrad's loader resolves a libc or libm call as
    a 32-bit displacement, wrong once the kernel lands over 2 GiB from the library. The addresses hold for this
    process only, so the table is written where it runs, never stored."""
    table = np.array([*_host_functions(), step_threads(threads)], dtype=np.uint64)
    assert table.shape == (HOST_TABLE_WORDS,)
    return table
