"""Captured TinyJits persisted across worker generations, so a cold start skips lowering and JIT capture.

A tinygrad TinyJit capture pickles by design (CapturedJit.__reduce__): its linear program of compiled
kernels plus every Buffer it touches, weights included. One entry holds a model's device state (weights
and warmed JITs together, so weights are stored once and shared) and is keyed by everything that could
make it stale: the artifact's sha256, the device and the host CPU (kernels are built with -march=native),
the tinygrad and Python versions, the model module's own source, and the shapes. A different model file,
device or tinygrad version therefore names a different entry and can never load this one.

Layout of `<key>.jit`: MAGIC, an 8-byte header length, a JSON header (the key, the pickle's sha256 and the
data regions' sha256, their offsets), padding to a page, then the pickle and the page-aligned regions.
Device buffers are regions, restored as CPU buffers over a private copy-on-write mapping of the file
(weights are mapped, not copied). The pickle, which holds the compiled kernels, is verified before it is
unpickled; the regions are hashed while the caller replays a probe whose stored output the restored
model must reproduce. Any failure discards the entry, and the caller rebuilds it. Entries are written to
a temporary file and renamed, so a reader never sees half an entry and a mapped file never changes.

The cache directory is the daemon's state directory (GPUWORKER_JIT_CACHE); unpickling trusts it as
much as the daemon trusts its own state directory.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import io
import json
import mmap
import os
import pickle
import struct
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from .._errors import GpuWorkerError
from ._kernelcache import host_fingerprint, tinygrad_version

MAGIC = b"GWJIT\x00\x01\n"
_LEN = struct.Struct("<Q")
_PAGE = mmap.PAGESIZE
ENV = "GPUWORKER_JIT_CACHE"
T = TypeVar("T")


class CacheEntryInvalid(GpuWorkerError):
    """An entry that exists but cannot be trusted: truncated, corrupt, from another key, or unpicklable."""


def cache_key(artifact_digest: str, device: str, source_files: list[Path], extra: dict[str, Any]) -> dict[str, Any]:
    """Every input that decides what a capture contains. `extra` holds the model's shape configuration."""
    src = hashlib.sha256()
    for f in source_files:
        src.update(f.read_bytes())
    return {
        "artifact_sha256": artifact_digest.lower(),
        "device": device,
        "host": host_fingerprint(),
        "tinygrad": tinygrad_version(),
        "python": sys.version.split()[0],
        "code_sha256": src.hexdigest(),
        **extra,
    }


def entry_path(cache_dir: Path, key: dict[str, Any]) -> Path:
    name = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]
    return cache_dir / f"{name}.jit"


def cache_dir_from_env() -> Path | None:
    value = os.environ.get(ENV)
    return Path(value) if value else None


class _Pickler(pickle.Pickler):
    """Stores each allocated CPU device Buffer's bytes as a page-aligned region of the entry instead of in the
    pickle, so a restore maps them (copy-on-write) rather than copying them: weights cost no load time."""

    def __init__(self, file: Any, regions: list[memoryview], oob: list[int]) -> None:
        def out_of_band(b: pickle.PickleBuffer) -> None:  # e.g. numpy arrays: restored as views of the mapping
            oob.append(len(regions))
            regions.append(b.raw())

        super().__init__(file, protocol=5, buffer_callback=out_of_band)
        from tinygrad.device import Buffer

        self.buffer_type, self.regions, self.index = Buffer, regions, {}
        self.keep: list[Any] = []  # holds each stored Buffer, so no id() is reused during the dump

    def persistent_id(self, obj: Any) -> Any:
        if (type(obj) is not self.buffer_type or obj._base is not None or not obj.is_allocated()
                or not obj.device.startswith("CPU")):
            return None
        if (i := self.index.get(id(obj))) is None:
            i = self.index[id(obj)] = len(self.regions)
            self.regions.append(obj.as_memoryview(allow_zero_copy=True).cast("B"))
            self.keep.append(obj)
        return ("cpu_buffer", i, obj.device, obj.size, obj.dtype, obj.options, obj.uop_refcount)


class _Unpickler(pickle.Unpickler):
    def __init__(self, data: memoryview, regions: list[memoryview], addresses: list[int]) -> None:
        super().__init__(io.BytesIO(data), buffers=iter(regions))
        self.addresses, self.made = addresses, {}

    def persistent_load(self, pid: Any) -> Any:
        from dataclasses import replace

        from tinygrad.device import Buffer, BufferSpec

        tag, i, device, size, dtype, options, refcount = pid
        if tag != "cpu_buffer":
            raise pickle.UnpicklingError(f"unknown persistent id {tag!r}")
        if (buf := self.made.get(i)) is None:
            spec = replace(options or BufferSpec(), external_ptr=self.addresses[i])
            buf = self.made[i] = Buffer(device, size, dtype, options=spec, uop_refcount=refcount, preallocate=True)
        return buf


_MAPPINGS: list[mmap.mmap] = []  # restored device buffers point into these: they live as long as the process


def save(path: Path, key: dict[str, Any], state: Any) -> int:
    """Pickle `state` with device buffers and out-of-band buffers in page-aligned regions; the bytes written."""
    regions: list[memoryview] = []
    oob: list[int] = []
    f_body = io.BytesIO()
    _Pickler(f_body, regions, oob).dump(state)
    body = f_body.getbuffer()
    offsets, pos = [], len(body)
    for r in regions:
        pos = -(-pos // _PAGE) * _PAGE
        offsets.append([pos, r.nbytes])
        pos += r.nbytes
    digest = hashlib.sha256()
    for r in regions:
        digest.update(r)
    header = json.dumps({"key": key, "pickle_sha256": hashlib.sha256(body).hexdigest(),
                         "regions_sha256": digest.hexdigest(), "pickle_len": len(body),
                         "buffers": offsets, "out_of_band": oob, "payload_len": pos}).encode()
    start = _payload_start(len(header))
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(MAGIC + _LEN.pack(len(header)) + header)
            f.seek(start)
            f.write(body)
            for (off, _), r in zip(offsets, regions, strict=True):
                f.seek(start + off)
                f.write(r)
            f.truncate(start + pos)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return start + pos


def _payload_start(header_len: int) -> int:
    """The payload starts on a page boundary, so every region (and so every mapped buffer) is page aligned."""
    return -(-(len(MAGIC) + _LEN.size + header_len) // _PAGE) * _PAGE


def load(path: Path, key: dict[str, Any], check: Callable[[Any], Any] = lambda state: state) -> Any:
    """The unpickled state of a valid entry; None when there is none; CacheEntryInvalid when it is bad.

    The file is mapped private and writable: kernels may write restored buffers (activations, KV caches),
    which copies those pages and never touches the file. Entries are replaced by rename, never rewritten
    in place, so a mapped file never changes under a running worker.

    The pickle (which holds the compiled kernels) is verified before it is unpickled; the data regions are
    hashed on a second thread while `check(state)` runs (it may read them: they are plain data), and the
    entry counts as valid only when both pass. Returns check's result."""
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        return None
    except OSError as exc:  # unreadable: treated as bad, so the model is built (and the store may fail too)
        raise CacheEntryInvalid(f"cannot open: {exc}") from exc
    with f:
        st = os.fstat(f.fileno())
        # an entry runs as code (it is a pickle): only one this user wrote and nobody else can change
        if st.st_uid != os.getuid() or st.st_mode & 0o022:
            raise CacheEntryInvalid(f"owned by uid {st.st_uid} with mode {st.st_mode & 0o777:o}, not ours alone")
        if st.st_size < len(MAGIC) + _LEN.size:
            raise CacheEntryInvalid("truncated or empty entry")
        mm = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        # the data regions are hashed through a second, read-only mapping: `check` may already write the
        # private one (activations, KV caches), and the hash is of what the file holds
        pristine = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    view = memoryview(mm)
    try:
        state = _decode(view, mm, pristine, key, check)
    finally:
        view.release()
    _MAPPINGS.append(mm)
    return state


def _decode(view: memoryview, mm: mmap.mmap, pristine: mmap.mmap, key: dict[str, Any],
            check: Callable[[Any], Any]) -> Any:
    if bytes(view[: len(MAGIC)]) != MAGIC:
        raise CacheEntryInvalid("not a jit cache entry (bad magic)")
    (hlen,) = _LEN.unpack(view[len(MAGIC) : len(MAGIC) + _LEN.size])
    start = _payload_start(hlen)
    try:
        header = json.loads(bytes(view[len(MAGIC) + _LEN.size : len(MAGIC) + _LEN.size + hlen]))
        payload_len, pickle_len, offsets = int(header["payload_len"]), int(header["pickle_len"]), header["buffers"]
        oob = [int(i) for i in header["out_of_band"]]
    except (ValueError, KeyError, TypeError) as exc:
        raise CacheEntryInvalid(f"unreadable header: {exc}") from exc
    if header.get("key") != json.loads(json.dumps(key)):  # compared as JSON holds it (tuples become lists)
        raise CacheEntryInvalid("entry was written for a different key")
    if len(view) - start != payload_len:
        raise CacheEntryInvalid(f"payload is {len(view) - start} bytes, header says {payload_len}")
    parts = [view[start : start + pickle_len]] + [view[start + off : start + off + n] for off, n in offsets]
    try:
        if hashlib.sha256(parts[0]).hexdigest() != header.get("pickle_sha256"):
            raise CacheEntryInvalid("pickle sha256 mismatch")
        if any(not 0 <= i < len(offsets) for i in oob):
            raise CacheEntryInvalid("out-of-band buffer index outside the entry")
        # hashlib drops the GIL: this overlaps the unpickle and the check
        regions = _RegionHash(pristine, [(start + off, n) for off, n in offsets])
        base = ctypes.addressof(ctypes.c_char.from_buffer(mm))
        addresses = [base + start + off for off, _ in offsets]
        try:
            state = _Unpickler(parts[0], [parts[1 + i] for i in oob], addresses).load()
            result = check(state)
        except CacheEntryInvalid:
            regions.join()
            raise
        except Exception as exc:  # hashes right but does not unpickle (e.g. classes that changed)
            regions.join()
            raise CacheEntryInvalid(f"cannot unpickle: {type(exc).__name__}: {exc}") from exc
        if regions.join() != header.get("regions_sha256"):
            raise CacheEntryInvalid("payload sha256 mismatch (data regions)")
        return result
    finally:
        for p in parts:
            p.release()


class _RegionHash(threading.Thread):
    def __init__(self, mapping: mmap.mmap, spans: list[tuple[int, int]]) -> None:
        super().__init__(name="jitcache-verify", daemon=True)
        self.mapping, self.spans, self.digest = mapping, spans, ""
        self.start()

    def run(self) -> None:
        h = hashlib.sha256()
        with self.mapping, memoryview(self.mapping) as view:
            for off, n in self.spans:
                with view[off : off + n] as part:
                    h.update(part)
        self.digest = h.hexdigest()

    def join(self, timeout: float | None = None) -> str:  # type: ignore[override]
        super().join(timeout)
        return self.digest


SOFTWARE_FIELDS = ("tinygrad", "python", "code_sha256")


def read_key(path: Path) -> dict[str, Any] | None:
    """The key an entry's header names, or None when it has no readable header."""
    try:
        with open(path, "rb") as f:
            head = f.read(len(MAGIC) + _LEN.size)
            if len(head) < len(MAGIC) + _LEN.size or head[: len(MAGIC)] != MAGIC:
                return None
            (hlen,) = _LEN.unpack(head[len(MAGIC) :])
            key = json.loads(f.read(hlen))["key"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return key if isinstance(key, dict) else None


def evict_stale(cache_dir: Path, key: dict[str, Any]) -> list[Path]:
    """Removes entries for the same model, device and host written by other software (tinygrad, Python or this
    code): this software can never load them, and each holds a full copy of the weights."""
    mine = json.loads(json.dumps(key))
    same = [f for f in mine if f not in SOFTWARE_FIELDS and f in ("artifact_sha256", "device", "host", "kind")]
    gone = []
    for entry in cache_dir.glob("*.jit"):
        other = read_key(entry)
        if other is None or other == mine:
            continue
        if all(other.get(f) == mine[f] for f in same) and any(other.get(f) != mine.get(f) for f in SOFTWARE_FIELDS):
            discard(entry)
            gone.append(entry)
    return gone


def discard(path: Path) -> None:
    with contextlib.suppress(OSError):  # a cache we cannot clean costs only speed
        os.unlink(path)


def load_or_build(key: dict[str, Any], build: Callable[[], T], probe: Callable[[T], np.ndarray],
                  log: Callable[[str], None], verify: Callable[[], None] = lambda: None) -> tuple[T, str]:
    """(model, outcome): restored from the cache ("hit"), or built and then stored ("miss", or "rebuilt" after
    a bad entry was discarded; "off" without a cache directory). `probe` runs the model on a fixed input: its
    output is stored with the entry, and a restored model must reproduce it. `verify` checks the artifact
    (its errors propagate): before a build, and after a restore, which does not read the artifact."""
    cache_dir = cache_dir_from_env()
    if cache_dir is None:
        verify()
        return build(), "off"
    path, outcome = entry_path(cache_dir, key), "miss"
    def check(state: Any) -> T:
        model, reference = state
        try:
            out = probe(model)
        except Exception as exc:
            raise CacheEntryInvalid(f"restored model fails: {type(exc).__name__}: {exc}") from exc
        if out.shape != reference.shape or not np.allclose(out, reference, rtol=1e-5, atol=1e-6):
            raise CacheEntryInvalid(f"restored model's output differs by {np.abs(out - reference).max()}")
        return model

    try:
        if (model := load(path, key, check)) is not None:
            verify()
            return model, "hit"
    except CacheEntryInvalid as exc:
        log(f"jit cache: discarding {path.name}: {exc}")
        discard(path)
        outcome = "rebuilt"
    verify()  # before the artifact is read: a wrong file is never built, nor stored under this key
    model = build()
    try:
        save(path, key, (model, probe(model)))
        for stale in evict_stale(cache_dir, key):
            log(f"jit cache: removed {stale.name}, written by other software for this model")
    except (OSError, pickle.PicklingError, TypeError) as exc:  # a cache that cannot be written costs only speed
        log(f"jit cache: cannot store {path.name}: {type(exc).__name__}: {exc}")
    return model, outcome
