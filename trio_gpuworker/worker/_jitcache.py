"""Captured TinyJits persisted across worker generations, so a cold start skips lowering and JIT capture.

A tinygrad TinyJit capture pickles by design (CapturedJit.__reduce__): its linear program of compiled
kernels plus every Buffer it touches, weights included. One entry holds a model's device state (weights
and warmed JITs together, so weights are stored once and shared) and is keyed by everything that could
make it stale: the artifact's sha256, the device and the host CPU (kernels are built with -march=native),
the tinygrad and Python versions, the model module's own source, and the shapes. A different model file,
device or tinygrad version therefore names a different entry and can never load this one.

Layout of `<key>.jit`: MAGIC, an 8-byte header length, a JSON header (key fields, payload sha256, the
pickle's length and the out-of-band buffers' offsets), then the pickle and its page-aligned buffers. The
payload is checked against its sha256 before unpickling, and the caller checks the restored model
against a reference output stored with it; any mismatch discards the entry, which is then rebuilt.
Entries are written to a temporary file and renamed, so a reader never sees half an entry.

The cache directory is the daemon's state directory (GPUWORKER_JIT_CACHE); unpickling trusts it as
much as the daemon trusts its own state directory.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import mmap
import os
import pickle
import platform
import struct
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

MAGIC = b"GWJIT\x00\x01\n"
_LEN = struct.Struct("<Q")
_PAGE = mmap.PAGESIZE
ENV = "GPUWORKER_JIT_CACHE"
T = TypeVar("T")


class CacheEntryInvalid(Exception):
    """An entry that exists but cannot be trusted: truncated, corrupt, from another key, or unpicklable."""


def _host_fingerprint() -> str:
    """The CPU model and feature flags: CPU kernels are compiled for this host's instruction set."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or "unknown"
    wanted = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags", "Features"))]
    return hashlib.sha256("\n".join(sorted(set(wanted))).encode()).hexdigest()[:16]


def cache_key(artifact_digest: str, device: str, source_files: list[Path], extra: dict[str, Any]) -> dict[str, Any]:
    """Every input that decides what a capture contains. `extra` holds the model's shape configuration."""
    src = hashlib.sha256()
    for f in source_files:
        src.update(f.read_bytes())
    return {
        "artifact_sha256": artifact_digest.lower(),
        "device": device,
        "host": f"{platform.machine()}:{_host_fingerprint()}",
        "tinygrad": importlib.metadata.version("tinygrad"),
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


def save(path: Path, key: dict[str, Any], state: Any) -> int:
    """Pickle `state` with its tensor buffers out of band, page aligned; returns the bytes written."""
    buffers: list[pickle.PickleBuffer] = []
    body = pickle.dumps(state, protocol=5, buffer_callback=buffers.append)
    raws = [b.raw() for b in buffers]
    offsets, pos = [], len(body)
    for r in raws:
        pos = -(-pos // _PAGE) * _PAGE
        offsets.append([pos, r.nbytes])
        pos += r.nbytes
    digest = hashlib.sha256(body)
    for r in raws:
        digest.update(r)
    header = json.dumps({"key": key, "sha256": digest.hexdigest(), "pickle_len": len(body),
                         "buffers": offsets, "payload_len": pos}).encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(MAGIC + _LEN.pack(len(header)) + header)
            start = f.tell()
            f.write(body)
            for (off, _), r in zip(offsets, raws, strict=True):
                f.seek(start + off)
                f.write(r)
            f.truncate(start + pos)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    finally:
        for b in buffers:
            b.release()
    return len(header) + pos


def load(path: Path, key: dict[str, Any]) -> Any:
    """The unpickled state of a valid entry; None when there is none; CacheEntryInvalid when it is bad."""
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        return None
    if os.fstat(f.fileno()).st_size == 0:
        f.close()
        raise CacheEntryInvalid("empty entry")
    with f:
        # not closed explicitly: the unpickler may keep views of it alive; it unmaps once they are gone
        view = memoryview(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))
    try:
        return _decode(view, key)
    finally:
        view.release()


def _decode(view: memoryview, key: dict[str, Any]) -> Any:
    if bytes(view[: len(MAGIC)]) != MAGIC or len(view) < len(MAGIC) + _LEN.size:
        raise CacheEntryInvalid("not a jit cache entry (bad magic)")
    (hlen,) = _LEN.unpack(view[len(MAGIC) : len(MAGIC) + _LEN.size])
    start = len(MAGIC) + _LEN.size + hlen
    try:
        header = json.loads(bytes(view[len(MAGIC) + _LEN.size : start]))
        payload_len, pickle_len, offsets = int(header["payload_len"]), int(header["pickle_len"]), header["buffers"]
    except (ValueError, KeyError, TypeError) as exc:
        raise CacheEntryInvalid(f"unreadable header: {exc}") from exc
    if header.get("key") != json.loads(json.dumps(key)):  # compared as JSON holds it (tuples become lists)
        raise CacheEntryInvalid("entry was written for a different key")
    if len(view) - start != payload_len:
        raise CacheEntryInvalid(f"payload is {len(view) - start} bytes, header says {payload_len}")
    # every slice is released before the mmap closes (an exported mmap cannot close)
    parts = [view[start : start + pickle_len]] + [view[start + off : start + off + n] for off, n in offsets]
    try:
        digest = hashlib.sha256()
        for p in parts:
            digest.update(p)
        if digest.hexdigest() != header.get("sha256"):
            raise CacheEntryInvalid("payload sha256 mismatch")
        try:
            return pickle.loads(parts[0], buffers=parts[1:])
        except Exception as exc:  # hashes right but does not unpickle (e.g. classes that changed)
            raise CacheEntryInvalid(f"cannot unpickle: {type(exc).__name__}: {exc}") from exc
    finally:
        for p in parts:
            p.release()


def discard(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def load_or_build(key: dict[str, Any], build: Callable[[], T], probe: Callable[[T], np.ndarray],
                  log: Callable[[str], None]) -> tuple[T, str]:
    """(model, outcome): restored from the cache ("hit"), or built and then stored ("miss", or "rebuilt" after
    a bad entry was discarded; "off" without a cache directory). `probe` runs the model on a fixed input: its
    output is stored with the entry, and a restored model must reproduce it."""
    cache_dir = cache_dir_from_env()
    if cache_dir is None:
        return build(), "off"
    path, outcome = entry_path(cache_dir, key), "miss"
    try:
        state = load(path, key)
        if state is not None:
            model, reference = state
            try:
                out = probe(model)
            except Exception as exc:
                raise CacheEntryInvalid(f"restored model fails: {type(exc).__name__}: {exc}") from exc
            if out.shape != reference.shape or not np.allclose(out, reference, rtol=1e-5, atol=1e-6):
                raise CacheEntryInvalid(f"restored model's output differs by {np.abs(out - reference).max()}")
            return model, "hit"
    except CacheEntryInvalid as exc:
        log(f"jit cache: discarding {path.name}: {exc}")
        discard(path)
        outcome = "rebuilt"
    model = build()
    try:
        save(path, key, (model, probe(model)))
    except (OSError, pickle.PicklingError, TypeError) as exc:  # a cache that cannot be written costs only speed
        log(f"jit cache: cannot store {path.name}: {type(exc).__name__}: {exc}")
    return model, outcome
