"""Device Bridge (docs/architecture.md, 'The worker side'): raw tinygrad allocations with bounds-checked range copies.

Every host<->device byte move of the worker's data plane goes through this module.

* CPU (`direct`): a tinygrad CPU buffer is an mmap with a stable host address. Ingress drains memcpy
  ring spans straight into it (`host_address`), and the range copies here are one ctypes.memmove
  each (a CFUNCTYPE call, so the GIL is released for the copy).
* Anything else (CUDA, NV, AMD, ...): the generic path. A host range is wrapped as a zero-copy
  "PYTHON" Buffer and copied with `Buffer.view(n, uint8, offset).copy_from(...)`, then the device is
  synchronized, so every copy here is complete when it returns (copies are synchronous).

tinygrad is imported when the first DeviceBridge is made, not with this module.
"""

from __future__ import annotations

import ctypes
import errno
import math
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from .._errors import CodedError

if TYPE_CHECKING:
    from tinygrad import Tensor

# numpy-style names accepted by as_tensor; each is also the tinygrad dtypes attribute name
DTYPE_NAMES = ("bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64", "float16",
               "bfloat16", "float32", "float64")


POOL_BYTES = 256 << 20  # recycled device memory kept per worker (CPU), bounded
PREFAULT_MIN = 64 << 10
MADV_POPULATE_WRITE = 23  # Linux 5.14; Python 3.11's mmap module does not name it


def _prefault(buf: Any) -> None:
    """Fault a fresh CPU buffer in with one madvise instead of one trap per 4 KiB page during the ingress
    copy (about 4x faster for 1 MiB here). Older kernels refuse it: the copy then faults pages as usual."""
    mapping = getattr(getattr(buf, "_buf", None), "meta", None)
    if hasattr(mapping, "madvise"):
        try:
            mapping.madvise(MADV_POPULATE_WRITE)
        except OSError:
            pass


class DeviceError(CodedError):
    """A device bridge failure; `code` is the snake_case wire reason (device_out_of_memory, device_copy_failed,
    device_allocation_failed, invalid_device_handle, invalid_input_handle, backend_free_failed)."""


class DeviceRangeError(DeviceError, ValueError):
    """A caller-side argument error: a copy range outside the allocation or its host buffer, a bad size or view."""


@dataclass(eq=False, slots=True)
class DeviceAlloc:
    """One device object: `buffer` is the tinygrad Buffer holding its nbytes (None when nbytes == 0, and after free).

    The bridge owns `buffer` exclusively; never deallocate or reuse it outside DeviceBridge.
    """

    nbytes: int
    device: str
    buffer: Any
    freed: bool = False

    def __repr__(self) -> str:
        return f"<DeviceAlloc {self.nbytes} B on {self.device}{' freed' if self.freed else ''}>"


def _mem_error(exc: BaseException) -> bool:
    if isinstance(exc, MemoryError):
        return True
    if isinstance(exc, OSError) and exc.errno == errno.ENOMEM:
        return True
    return isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()


def _host_range(obj: int | Any, n: int, writable: bool) -> tuple[int, Any]:
    """(address, keepalive) of the first n bytes of a host address or C-contiguous buffer; bounds-checked."""
    what = "destination" if writable else "source"
    if isinstance(obj, int) and not isinstance(obj, bool):
        if n and not 0 < obj < 1 << 64:
            raise DeviceRangeError("device_copy_failed", f"{what} address {obj:#x} is not a valid pointer")
        return obj, None
    try:
        mv = memoryview(obj)
    except TypeError as exc:
        raise DeviceRangeError(
            "device_copy_failed", f"{what} must be an address or a buffer, got {type(obj).__name__}"
        ) from exc
    if not mv.c_contiguous:
        raise DeviceRangeError("device_copy_failed", f"{what} buffer is not C-contiguous")
    if writable and mv.readonly:
        raise DeviceRangeError("device_copy_failed", f"{what} buffer is read-only")
    if n > mv.nbytes:
        raise DeviceRangeError("device_copy_failed", f"{what} buffer holds {mv.nbytes} bytes, copy needs {n}")
    if mv.nbytes == 0:
        return 0, mv
    arr = np.frombuffer(mv, dtype=np.uint8)  # raw bytes of any format/shape; read-only buffers too
    return arr.__array_interface__["data"][0], arr


class DeviceBridge:
    """Allocations, range copies and tensor views on one tinygrad device (default Device.DEFAULT).

    Not thread-safe (neither is tinygrad): call it from one thread at a time.
    """

    def __init__(self, device: str | None = None, *, generic: bool = False) -> None:
        from tinygrad import Device, Tensor, dtypes
        from tinygrad.device import Buffer
        from tinygrad.dtype import DType, strong_dtype
        from tinygrad.helpers import to_mv
        from tinygrad.uop.ops import UOp

        self._Buffer, self._Tensor, self._UOp, self._DType, self._dtypes = Buffer, Tensor, UOp, DType, dtypes
        self._to_mv, self._strong = to_mv, strong_dtype
        try:
            self.device: str = Device.canonicalize(device)
            self._dev = Device[self.device]
        except Exception as exc:
            raise DeviceError(
                "backend_init_failed", f"cannot open tinygrad device {device or Device.DEFAULT!r}: {exc}"
            ) from exc
        # direct: the buffer's memory is host memory at a stable address (tinygrad's CPU allocator mmaps it).
        # `generic=True` forces the Buffer.copy_from path even on CPU (tests, benchmarks).
        self.direct: bool = self.device.split(":")[0] == "CPU" and not generic
        # base Buffers behind live allocations: from_tensor must not hand out a second alloc over one of them
        # (recycled buffers stay in it while pooled: nothing references them, and an ingress burst takes them back
        # without a WeakSet entry each)
        self._owned: weakref.WeakSet[Any] = weakref.WeakSet()
        self._pool: dict[int, list[Any]] = {}  # freed, unreferenced buffers by size, reused by alloc_device
        self._pool_addr: dict[int, list[int]] = {}  # their host addresses (direct), in the same order
        self._poolable: weakref.WeakSet[Any] = weakref.WeakSet()  # made by alloc_device: sizes that recur
        self._pooled_bytes = 0
        self.pool_bytes = POOL_BYTES

    def __repr__(self) -> str:
        return f"<DeviceBridge {self.device} {'direct' if self.direct else 'generic'}>"

    # --- allocation ---------------------------------------------------------------------------

    def alloc_device(self, nbytes: int) -> DeviceAlloc:
        """A fresh nbytes-byte device allocation (contents undefined). 0 bytes allocates nothing."""
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 0:
            raise DeviceRangeError(
                "device_allocation_failed", f"allocation size must be a non-negative int, got {nbytes!r}"
            )
        if nbytes == 0:
            return DeviceAlloc(0, self.device, None)
        pooled = self._pool.get(nbytes)
        if pooled:
            buf = pooled.pop()
            self._pool_addr[nbytes].pop()
            self._pooled_bytes -= nbytes
            return DeviceAlloc(nbytes, self.device, buf)
        buf = self._Buffer(self.device, nbytes, self._dtypes.uint8)
        for attempt in (0, 1):
            try:
                buf.allocate()
                break
            except Exception as exc:
                if not _mem_error(exc):
                    raise DeviceError(
                        "device_allocation_failed", f"cannot allocate {nbytes} bytes on {self.device}: {exc}"
                    ) from exc
                if attempt or not hasattr(self._dev.allocator, "free_cache"):
                    raise DeviceError(
                        "device_out_of_memory", f"cannot allocate {nbytes} bytes on {self.device}: {exc}"
                    ) from exc
                # tinygrad's LRU allocator keeps freed buffers; its own flush-and-retry misses CPU mmap ENOMEM
                self._dev.allocator.free_cache()
        self._owned.add(buf)
        self._poolable.add(buf)
        if self.direct and nbytes >= PREFAULT_MIN:
            _prefault(buf)
        # a recycled LRU buffer may still be named by queued work; host writes are not ordered with the device queue
        if self.direct:
            self.synchronize()
        return DeviceAlloc(nbytes, self.device, buf)

    def alloc_mapped_many(self, nbytes: int, k: int) -> tuple[list[Any], np.ndarray]:
        """Up to k allocations of nbytes (direct only) as bare buffers, each to become a DeviceAlloc with `adopt`
        when it is used or freed, and their host addresses as uint64, for the ingress drain's DestPool. While the
        pool holds buffers of this size only those go out (a steady stream's released objects come back there, and
        a fresh one costs ~20 us), in bulk with their addresses; else k fresh ones, all or none."""
        pooled, addrs = self._pool.get(nbytes) or [], self._pool_addr.get(nbytes) or []
        take = k = min(k, len(pooled) or k)
        bufs, addresses = pooled[len(pooled) - take:], addrs[len(addrs) - take:]
        del pooled[len(pooled) - take:], addrs[len(addrs) - take:]
        self._pooled_bytes -= take * nbytes
        try:
            while len(bufs) < k:
                buf = self.alloc_device(nbytes).buffer
                bufs.append(buf)
                addresses.append(0 if buf is None else buf._buf.va_addr)  # zero bytes: no memory, address 0
        except BaseException:
            for buf in bufs:
                self.free_device(self.adopt(nbytes, buf))
            raise
        return bufs, np.array(addresses, np.uint64)

    def adopt(self, nbytes: int, buf: Any) -> DeviceAlloc:
        """The allocation over a buffer alloc_mapped_many handed out (once per buffer: it owns it from here)."""
        return DeviceAlloc(nbytes, self.device, buf)

    def free_device(self, alloc: DeviceAlloc) -> None:
        """Release an allocation. Memory still named by a live tensor (as_tensor, from_tensor) is freed when that
        tensor dies instead; either way the handle is dead at once. A second free raises invalid_device_handle."""
        self._live(alloc)
        buf, alloc.buffer, alloc.freed = alloc.buffer, None, True
        if buf is None:
            return
        unreferenced = buf._base is None and buf.is_allocated() and buf.uop_refcount == 0
        fits = self._pooled_bytes + alloc.nbytes <= self.pool_bytes
        if unreferenced and self.direct and fits and buf in self._poolable:
            # recycle: the next object of this size lands in memory that is already faulted in, so ingress
            # copies run at memcpy speed instead of paying a page fault per 4 KiB (unreferenced, so safe)
            self._pool.setdefault(alloc.nbytes, []).append(buf)
            self._pool_addr.setdefault(alloc.nbytes, []).append(buf._buf.va_addr)
            self._pooled_bytes += alloc.nbytes
            return
        self._owned.discard(buf)
        if unreferenced:
            try:
                buf.deallocate()
            except Exception as exc:
                raise DeviceError("backend_free_failed", f"freeing {alloc}: {exc}") from exc

    def trim(self) -> None:
        """Give every pooled (recycled) buffer back to the device allocator."""
        for bufs in self._pool.values():
            for buf in bufs:
                self._owned.discard(buf)
                buf.deallocate()
        self._pool.clear()
        self._pool_addr.clear()
        self._pooled_bytes = 0

    def _live(self, alloc: DeviceAlloc) -> DeviceAlloc:
        if not isinstance(alloc, DeviceAlloc) or alloc.freed:
            raise DeviceError("invalid_device_handle", f"{alloc!r} is not a live device allocation")
        if alloc.device != self.device:
            raise DeviceError(
                "invalid_device_handle", f"{alloc!r} belongs to device {alloc.device}, this bridge is {self.device}"
            )
        return alloc

    # --- range copies -------------------------------------------------------------------------

    def host_address(self, alloc: DeviceAlloc) -> int:
        """The host address of byte 0 (direct/CPU only; 0 for a 0-byte allocation). Valid until free_device; the
        bridge synchronizes in alloc_device and from_tensor, so the memory is quiescent when they return."""
        self._live(alloc)
        if not self.direct:
            raise DeviceError("device_copy_failed", f"{self.device} memory has no host address; use host_to_device")
        return 0 if alloc.buffer is None else int(alloc.buffer._buf.va_addr)

    def _check(self, alloc: DeviceAlloc, offset: int, n: int) -> None:
        self._live(alloc)
        for name, v in (("offset", offset), ("n", n)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise DeviceRangeError("device_copy_failed", f"{name} must be a non-negative int, got {v!r}")
        if offset + n > alloc.nbytes:
            raise DeviceRangeError("device_copy_failed", f"range [{offset}, {offset + n}) is outside {alloc!r}")

    def host_to_device(self, alloc: DeviceAlloc, offset: int, src: int | memoryview, n: int) -> None:
        """Copy n bytes from src (a host address, or a buffer holding >= n bytes) to alloc[offset:offset+n].
        Complete when it returns: the host bytes may be reused at once."""
        self._check(alloc, offset, n)
        addr, keep = _host_range(src, n, writable=False)
        if n == 0:
            return
        if self.direct:
            ctypes.memmove(int(alloc.buffer._buf.va_addr) + offset, addr, n)
            return
        try:
            self._view(alloc, offset, n).copy_from(
                self._Buffer("PYTHON", n, self._dtypes.uint8, opaque=self._to_mv(addr, n))
            )
            self._dev.synchronize()
        except Exception as exc:
            raise DeviceError(
                "device_copy_failed", f"host -> {self.device} copy of {n} bytes at {offset}: {exc}"
            ) from exc
        del keep

    def device_to_host(self, alloc: DeviceAlloc, offset: int, dst: int | memoryview, n: int) -> None:
        """Copy alloc[offset:offset+n] to dst (a host address, or a writable buffer holding >= n bytes).
        The host bytes are valid when it returns."""
        self._check(alloc, offset, n)
        addr, keep = _host_range(dst, n, writable=True)
        if n == 0:
            return
        if self.direct:
            ctypes.memmove(addr, int(alloc.buffer._buf.va_addr) + offset, n)
            return
        try:
            self._Buffer("PYTHON", n, self._dtypes.uint8, opaque=self._to_mv(addr, n)).copy_from(
                self._view(alloc, offset, n)
            )
            self._dev.synchronize()
        except Exception as exc:
            raise DeviceError(
                "device_copy_failed", f"{self.device} -> host copy of {n} bytes at {offset}: {exc}"
            ) from exc
        del keep

    def _view(self, alloc: DeviceAlloc, offset: int, n: int) -> Any:
        # Buffer.view does not bounds-check; _check did (offset + n <= nbytes, n > 0 so offset < nbytes)
        return alloc.buffer.view(n, self._dtypes.uint8, offset).ensure_allocated()

    def synchronize(self) -> None:
        """Wait for every queued operation on the device (copies and kernels)."""
        try:
            self._dev.synchronize()
        except Exception as exc:
            raise DeviceError("device_copy_failed", f"synchronizing {self.device}: {exc}") from exc

    # --- tensors ------------------------------------------------------------------------------

    def dtype(self, name: Any) -> Any:
        """tinygrad DType for a numpy-style name ("float32", "int32", ...) or a DType/np.dtype."""
        if isinstance(name, self._DType):
            return name
        if isinstance(name, np.dtype | type):
            name = np.dtype(name).name
        if not isinstance(name, str) or name not in DTYPE_NAMES:
            raise DeviceRangeError("invalid_input_handle", f"dtype {name!r} is not one of {', '.join(DTYPE_NAMES)}")
        return getattr(self._dtypes, name)

    def as_tensor(self, alloc: DeviceAlloc, dtype: str, shape: tuple[int, ...]) -> Tensor:
        """A Tensor over the allocation's memory without copying (the tensor keeps the memory alive)."""
        self._live(alloc)
        dt = self.dtype(dtype)
        shape = tuple(shape)
        if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            raise DeviceRangeError("invalid_input_handle", f"shape {shape!r} must be non-negative ints")
        numel = math.prod(shape)
        if numel * dt.itemsize != alloc.nbytes:
            raise DeviceRangeError(
                "invalid_input_handle",
                f"{dt.name}{list(shape)} needs {numel * dt.itemsize} bytes, {alloc!r} holds {alloc.nbytes}",
            )
        if numel == 0:
            return self._Tensor.empty(*shape, dtype=dt, device=self.device)
        buf = alloc.buffer if alloc.buffer.dtype == dt else alloc.buffer.view(numel, dt, 0)
        return self._Tensor(self._UOp.from_buffer(buf), device=self.device).reshape(shape)

    def from_tensor(self, t: Tensor) -> DeviceAlloc:
        """Realize t (contiguous, on this device) into an allocation holding t's row-major bytes.

        The allocation owns its memory exclusively: zero-copy when realizing t here makes a fresh whole buffer (t
        was an unrealized computation), otherwise one device-side copy (t already had a buffer: an input returned
        as-is, a weight, a JIT output, a slice or view, a const). Synchronized on return, so device_to_host /
        host_address read final bytes."""
        if isinstance(t.device, tuple):
            raise DeviceError("invalid_input_handle", f"multi-device tensor on {t.device} is not supported")
        try:
            if t.device != self.device:
                t = t.to(self.device)
            if t.dtype in self._dtypes.weaks:  # a Python-number const: store it as its default concrete dtype
                t = t.cast(self._strong(t.dtype))
            if t.numel() == 0:
                self.synchronize()
                return DeviceAlloc(0, self.device, None)
            # a buffer t already has may be shared (weights, JIT outputs, an input): only a fresh one is taken as is
            buf = None if self._buffer_of(t) is not None else self._buffer_of(t.contiguous().realize())
            if not self._takeable(buf, t):
                buf = self._buffer_of(t.clone(self.device).realize())
            if not self._takeable(buf, t):
                raise RuntimeError(f"realized {t.dtype.name}{list(t.shape)} has no buffer of its own ({buf!r})")
            self._dev.synchronize()
        except Exception as exc:
            if isinstance(exc, DeviceError):
                raise
            if _mem_error(exc):
                raise DeviceError("device_out_of_memory", f"materializing an output on {self.device}: {exc}") from exc
            raise DeviceError("device_copy_failed", f"materializing an output on {self.device}: {exc}") from exc
        self._owned.add(buf)
        return DeviceAlloc(buf.nbytes, self.device, buf)

    def _takeable(self, buf: Any, t: Tensor) -> bool:
        return buf is not None and buf._base is None and buf not in self._owned and buf.nbytes == t.nbytes()

    def _buffer_of(self, t: Tensor) -> Any:
        """The allocated Buffer t is a contiguous view of, else None (an unrealized graph, a non-contiguous view)."""
        try:
            buf = t.uop.buffer
        except Exception:
            return None
        return buf if isinstance(buf, self._Buffer) and buf.device == self.device and buf.is_allocated() else None
