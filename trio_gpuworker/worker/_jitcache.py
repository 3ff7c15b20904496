"""Captured TinyJits persisted across worker generations, so a cold start skips lowering and JIT capture. This is the
one module that touches the tinygrad internals the cache needs (worker/_jitfile.py holds the files).

A captured TinyJit pickles by design (CapturedJit.__reduce__): its linear program of compiled kernels plus the
BUFFER UOps it runs on, weights included. An entry pickles a whole model, or one more graph of a model whose entry
is already stored (a part): a part refers to the objects of that entry instead of storing them again, so a model
can grow by one shape at a time, each compiled once per machine.

**Identity.** A BUFFER UOp is hash-consed on (dtype, size, device, slot), and its slot comes from a counter that is
local to one process. Unpickled as they were, the builder's slots would alias whatever buffer of that size the
restoring process gets from its own counter, before or after the restore: a later tensor would write the restored
weights, or an earlier one would take the restored graph over. So every device BUFFER is stored with its index in
the entry and unpickled under a fresh slot drawn from this process's counter (one per stored slot), and each restore
checks that every buffer any restored graph runs on is one this entry (or the entry it extends) created.

**Probe.** Replaying every captured graph at each restore would cost about one forward pass per shape (seconds for
an encoder's ~20 shapes), so the writer does it once: with the payload on disk it restores a second copy from the
file, exactly as a reader does, replays every captured graph of both on fixed inputs (floats 1, integers 0 since they
may be indices, variables at their minimum),
and stores the entry only when every output is bit for bit the same; the digests go in the header.

Device buffers are regions of the entry, restored as CPU buffers over a private copy-on-write mapping of the file
(weights are mapped, not copied), but for memory the model placed itself (a buffer stored with an external pointer:
the fused decoder's weights on huge pages, _hugepages.py), which is copied into a mapping of the same kind. The cache
directory is the daemon's state directory (GPUWORKER_JIT_CACHE);
unpickling trusts it as much as the daemon trusts its own state directory.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import pickle
from pathlib import Path
from typing import Any

import numpy as np
from tinygrad import Tensor, dtypes
from tinygrad.device import Buffer, BufferSpec
from tinygrad.dtype import _to_np_dtype
from tinygrad.engine.jit import CapturedJit, _TinyJit
from tinygrad.engine.realize import get_call_arg_uops, get_runtime
from tinygrad.nn.state import get_parameters
from tinygrad.uop.ops import Ops, ParamArg, UOp, UOpMetaClass, buffers

from .. import _hugepages
from ._jitfile import CacheEntryInvalid, Mapped, open_entry, write_entry


class Stored:
    """One entry as this process holds it: its BUFFER UOps and device buffers by index in the entry, so a part can
    refer to them, and the digest that names it (a part records the digest of the entry it extends)."""

    def __init__(self, digest: str = "") -> None:
        self.digest = digest
        self.uops: dict[int, UOp] = {}
        self.bufs: dict[int, Buffer] = {}
        self.refs: dict[int, tuple[str, int]] = {}  # id(obj) -> its persistent id in a part
        self.realized: set[int] = set()  # indices of the UOps stored with their buffer

    def add_uop(self, i: int, u: UOp, realized: bool) -> None:
        self.uops[i], self.refs[id(u)] = u, ("entry_uop", i)
        if realized:
            self.realized.add(i)

    def add_buf(self, i: int, b: Buffer) -> None:
        self.bufs[i], self.refs[id(b)] = b, ("entry_buf", i)


def _device_buffer(u: UOp) -> bool:
    """A BUFFER with device storage (not a Variable, nor a kernel's LOCAL/REG scratch): what the slot identifies."""
    return u.op is Ops.BUFFER and isinstance(u.arg, ParamArg) and u.arg.device is not None


def _buffer_uop(*args: Any) -> UOp:
    raise pickle.UnpicklingError("a JIT cache entry unpickles only through worker/_jitcache.py")


def _captured_jit(*args: Any) -> CapturedJit:
    raise pickle.UnpicklingError("a JIT cache entry unpickles only through worker/_jitcache.py")


def _program_uop(*args: Any) -> UOp:
    raise pickle.UnpicklingError("a JIT cache entry unpickles only through worker/_jitcache.py")


def _runnable(prg: UOp) -> tuple[UOp, ...]:
    """A compiled kernel's sources as far as running it needs them: its kernel info (name, estimates), its
    parameters (the ELF's signature), its source text and its binary. The kernel's AST and linearized program, most
    of an entry's UOps, are left out: unpickling them cost ~10 us each. Its key (a hash over all of it, ~5 ms to
    compute) is stored beside it: it names the kernel's loaded runtime."""
    if len(prg.src) != 4 or prg.src[0].op is not Ops.SINK or prg.src[3].op is not Ops.BINARY:
        return prg.src
    sink, lin, source, binary = prg.src
    params = tuple(u for u in lin.src if u.op is Ops.PARAM)
    return UOp(Ops.SINK, sink.dtype, (), sink.arg), UOp(Ops.LINEAR, lin.dtype, params, lin.arg), source, binary


_RESIDENT: list[Any] = []  # restored buffers copied to huge pages: they live as long as the process, as mappings do


class _Pickler(pickle.Pickler):
    """CPU device buffers go to page-aligned regions (restored by mapping, not copying); BUFFER UOps are stored with
    their index so they unpickle under fresh slots; objects of the extended entry are stored as references."""

    def __init__(self, file: Any, regions: list[memoryview], oob: list[int], mine: Stored, base: Stored | None) -> None:
        def out_of_band(b: pickle.PickleBuffer) -> None:  # e.g. numpy arrays: restored as views of the mapping
            oob.append(len(regions))
            regions.append(b.raw())

        super().__init__(file, protocol=5, buffer_callback=out_of_band)
        self.regions, self.mine, self.base = regions, mine, base
        self.jits: list[CapturedJit] = []
        self.keep: list[Any] = []  # holds each stored Buffer, so no id() is reused during the dump

    def persistent_id(self, obj: Any) -> Any:
        if self.base is not None and (ref := self.base.refs.get(id(obj))) is not None:
            if ref[0] == "entry_uop" and ref[1] not in self.base.realized and obj.realized is not None:
                raise pickle.PicklingError("a graph runs on a buffer of the model realized after its entry was stored")
            return ref
        if type(obj) is not Buffer or obj._base is not None or not obj.device.startswith("CPU"):
            return None
        if not obj.is_allocated():
            return None
        if (i := self.mine.refs.get(id(obj))) is None:
            self.mine.add_buf(i := len(self.regions), obj)
            self.regions.append(obj.as_memoryview(allow_zero_copy=True).cast("B"))
            self.keep.append(obj)
        else:
            i = i[1]
        return ("cpu_buffer", i, obj.device, obj.size, obj.dtype, obj.options, obj.uop_refcount)

    def reducer_override(self, obj: Any) -> Any:
        t = type(obj)
        if t is UOp and _device_buffer(obj):
            buf = obj.realized
            self.mine.add_uop(i := len(self.mine.uops), obj, buf is not None)
            return _buffer_uop, (i, obj.op, obj.dtype, obj.src, obj.arg, obj.tag, obj.metadata, buf)
        if t is UOp and obj.op is Ops.PROGRAM:
            return _program_uop, (obj.op, obj.dtype, _runnable(obj), obj.arg, obj.tag, obj.metadata, obj.key)
        if t is CapturedJit:
            self.jits.append(obj)
            # _written_uops (a graph walk, ~0.1-1 s) is not part of CapturedJit's own pickle
            return _captured_jit, (len(self.jits) - 1, obj.ret, obj._linear, obj.expected_names,
                                   obj.expected_input_info, obj._written_uops)
        if t is _TinyJit and obj.captured is None:  # not captured yet: restored as a fresh one, traced on use
            return _TinyJit, (obj.fxn, None, obj.prune)
        return NotImplemented


class _Unpickler(pickle.Unpickler):
    def __init__(self, entry: Mapped, mine: Stored, base: Stored | None) -> None:
        super().__init__(io.BytesIO(entry.pickle), buffers=iter(entry.out_of_band()))
        self.entry, self.mine, self.base = entry, mine, base
        self.slots: dict[int, int] = {}  # the writer's slot -> a fresh one from this process's counter
        self.jits: dict[int, CapturedJit] = {}

    def find_class(self, module: str, name: str) -> Any:
        if module == __name__ and name == "_buffer_uop":
            return self._buffer_uop
        if module == __name__ and name == "_captured_jit":
            return self._captured_jit
        if module == __name__ and name == "_program_uop":
            return self._program_uop
        return super().find_class(module, name)

    def persistent_load(self, pid: Any) -> Any:
        tag, i, *rest = pid
        if tag in ("entry_uop", "entry_buf"):
            found = None if self.base is None else (self.base.uops if tag == "entry_uop" else self.base.bufs).get(i)
            if found is None:
                raise pickle.UnpicklingError(f"{tag} {i} is not in the entry this part extends")
            return found
        if tag != "cpu_buffer":
            raise pickle.UnpicklingError(f"unknown persistent id {tag!r}")
        if (buf := self.mine.bufs.get(i)) is None:
            device, size, dtype, options, refcount = rest
            at = self.entry.addresses[i]
            if options is not None and options.external_ptr is not None:
                # memory of the model's own (a fused decoder's weights on huge pages, _hugepages.py) is copied
                # into a mapping like it, not left on the file's pages
                mm, at = _hugepages.copied(at, size * dtype.itemsize)
                _RESIDENT.append(mm)
            spec = dataclasses.replace(options or BufferSpec(), external_ptr=at)
            buf = Buffer(device, size, dtype, options=spec, uop_refcount=refcount, preallocate=True)
            self.mine.add_buf(i, buf)
        return buf

    def _buffer_uop(self, i: int, op: Ops, dtype: Any, src: tuple[UOp, ...], arg: ParamArg, tag: Any,
                    metadata: Any, buf: Buffer | None) -> UOp:
        if (slot := self.slots.get(arg.slot)) is None:
            slot = self.slots[arg.slot] = next(UOp.unique_num)
        arg = dataclasses.replace(arg, slot=slot)
        if (held := UOpMetaClass.ucache.get((op, dtype, src, arg, tag))) is not None and held() is not None:
            raise CacheEntryInvalid(f"restored buffer {i} would alias a live buffer of this process")
        u = UOp(op, dtype, src, arg, tag, metadata, buf)
        if buf is not None and buffers.get(u) is not buf:
            raise CacheEntryInvalid(f"restored buffer {i} is not bound to its stored memory")
        self.mine.add_uop(i, u, buf is not None)
        return u

    @staticmethod
    def _program_uop(op: Ops, dtype: Any, src: tuple[UOp, ...], arg: Any, tag: Any, metadata: Any,
                     key: bytes) -> UOp:
        u = UOp(op, dtype, src, arg, tag, metadata)
        u.__dict__.setdefault(UOp.key.nm, key)  # where recursive_property keeps it
        return u

    def _captured_jit(self, i: int, ret: Any, linear: UOp, names: list[Any], info: list[Any],
                      written: set[UOp]) -> CapturedJit:
        jit = CapturedJit(ret, linear, names, info)
        jit.__dict__["_written_uops"] = written  # where functools.cached_property keeps its value
        self.jits[i] = jit
        return jit


def _check_identities(jits: list[CapturedJit], mine: Stored, base: Stored | None) -> None:
    """Every device buffer a restored graph runs on is one this entry, or the entry it extends, restored."""
    known = {id(u) for u in mine.uops.values()} | ({id(u) for u in base.uops.values()} if base else set())
    for n, jit in enumerate(jits):
        for call in jit._linear.src:
            for arg in get_call_arg_uops(call):
                for u in arg.toposort():
                    if _device_buffer(u) and id(u) not in known:
                        raise CacheEntryInvalid(f"restored graph {n} runs on a buffer the entry does not hold: {u.arg}")


def _prime(jits: list[CapturedJit]) -> None:
    """What a restored graph's first replay would do once, done now rather than in the first request: load its
    compiled kernels, bind the buffer views its kernels run on, read its outputs once (which compiles the copy that
    reads them) and move numpy inputs of its shapes to the device once (which readies tinygrad's scheduler)."""
    for jit in jits:
        for call in jit._linear.src:
            for arg in get_call_arg_uops(call):
                if arg.op is not Ops.PARAM and not (arg.src and arg.src[0].op is Ops.PARAM):
                    arg.buffer.ensure_allocated()
            if call.src[0].op is Ops.PROGRAM:
                device = call.src[1].device
                for d in device if isinstance(device, tuple) else (device,):
                    get_runtime(d, call.src[0])
        for t in get_parameters(jit.ret):
            t.numpy()
        inputs = [Tensor(np.zeros(shape, _to_np_dtype(dtype)), device=device)  # a caller's numpy inputs
                  for shape, (_, variables, dtype, device) in zip(_input_shapes(jit), jit.expected_input_info,
                                                                   strict=True)
                  if not variables and all(isinstance(d, int) for d in shape)]
        if inputs:
            Tensor.realize(*inputs)  # together, as the JIT realizes a call's inputs


def _input_sizes(jit: CapturedJit) -> list[int]:
    """The number of elements of each input buffer a captured graph takes (its parameters' sizes)."""
    sizes: dict[int, int] = {}
    for call in jit._linear.src:
        for arg in get_call_arg_uops(call):
            p = arg if arg.op is Ops.PARAM else arg.src[0] if arg.src and arg.src[0].op is Ops.PARAM else None
            if p is not None and p.arg.slot >= 0 and p.arg.name is None:
                sizes[p.arg.slot] = p.max_numel()
    return [sizes.get(i, 1) for i in range(len(jit.expected_input_info))]


def _input_shapes(jit: CapturedJit) -> list[tuple[Any, ...]]:
    """The shape of each input as the caller passed it (the view of its buffer), else its buffer's."""
    out: list[tuple[Any, ...]] = []
    for (view, *_), n in zip(jit.expected_input_info, _input_sizes(jit), strict=True):
        try:
            out.append(view.shape)
        except RuntimeError:  # the buffer itself (a NOOP in place of the base has no shape)
            out.append((n,))
    return out


def _replay(jit: CapturedJit) -> str:
    """sha256 of the outputs of one replay of a captured graph on fixed inputs, its variables at their minimum."""
    var_vals: dict[str, int] = {}
    for call in jit._linear.src:
        if (prg := call.src[0]).op is Ops.PROGRAM:
            var_vals.update({v.expr: int(v.vmin) for v in prg.arg.vars if v.expr not in prg.arg.runtimevars})
    # ones where they are floats (a zero would hide weights), zeros where they may be indices (ids, positions)
    inputs = [Tensor.full((n,), 1 if dtypes.is_float(dt) else 0, dtype=dt, device=dev).contiguous().realize()
              for n, (_, _, dt, dev) in zip(_input_sizes(jit), jit.expected_input_info, strict=True)]
    jit([t.uop.base for t in inputs], var_vals)
    h = hashlib.sha256()
    for t in get_parameters(jit.ret):
        if (b := t.uop.base.realized) is not None:
            h.update(b.as_memoryview())
    return h.hexdigest()


def save(path: Path, key: dict[str, Any], state: Any, base: Stored | None = None) -> Stored:
    """Stores `state` (a part of the entry `base` when given); what this process now holds of the entry."""
    regions: list[memoryview] = []
    oob: list[int] = []
    body = io.BytesIO()
    mine = Stored()
    pickler = _Pickler(body, regions, oob, mine, base)
    pickler.dump(state)

    def probe(copy: Mapped) -> dict[str, Any]:
        twin = _Unpickler(copy, Stored(), base)
        twin.load()
        jits = [twin.jits[i] for i in range(len(pickler.jits))]
        _check_identities(jits, twin.mine, base)
        _prime(jits)
        digests = [_replay(j) for j in pickler.jits]
        for n, (jit, want) in enumerate(zip(jits, digests, strict=True)):
            if _replay(jit) != want:
                raise CacheEntryInvalid(f"captured graph {n} restored from the entry computes differently")
        return {"probe": digests, "extends": base.digest if base else None}

    write_entry(path, key, body.getbuffer(), regions, oob, probe)
    mine.digest = hashlib.sha256(body.getbuffer()).hexdigest()
    return mine


def load(path: Path, key: dict[str, Any], base: Stored | None = None) -> tuple[Any, Stored] | None:
    """The state of a valid entry (a part of `base` when given) and what this process holds of it; None when there
    is none; CacheEntryInvalid when it is bad (the caller discards it)."""
    entry = open_entry(path, key)
    if entry is None:
        return None
    try:
        if entry.header.get("extends") != (base.digest if base else None):
            raise CacheEntryInvalid("part of another entry than the one restored")
        mine = Stored(entry.header["pickle_sha256"])
        unpickler = _Unpickler(entry, mine, base)
        try:
            state = unpickler.load()
            if len(unpickler.jits) != len(entry.header.get("probe") or ()):
                raise CacheEntryInvalid("the entry holds other graphs than its writer probed")
            _check_identities(list(unpickler.jits.values()), mine, base)
            _prime(list(unpickler.jits.values()))
        except CacheEntryInvalid:
            raise
        except Exception as exc:  # hashes right but does not restore (e.g. classes that changed)
            raise CacheEntryInvalid(f"cannot restore: {type(exc).__name__}: {exc}") from exc
    finally:
        digest = entry.hashing.join() if entry.hashing is not None else ""  # the thread ends before we return
    if digest != entry.header.get("regions_sha256"):
        raise CacheEntryInvalid("payload sha256 mismatch (data regions)")
    return state, mine
