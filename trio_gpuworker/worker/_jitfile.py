"""The JIT cache's files: entry layout and verification, keys, names, locks and eviction. No tinygrad here:
worker/_jitcache.py pickles and restores what an entry holds.

Layout of `<name>.jit`: MAGIC, the header's offset and length (two u64), the payload from the first page on (a
pickle, then page-aligned data regions), then a JSON header: the key, the pickle's and the regions' sha256, their
offsets, and what the writer adds once the payload is on disk (the probe's digests). Entries are written to a
temporary file and renamed, so a reader never sees half an entry and a mapped file never changes.

The pickle (which holds compiled kernels) is verified before anything unpickles it; the data regions are hashed on a
second thread, from a read-only mapping, while the restore runs, and count only once that hash matches too.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import hashlib
import json
import mmap
import os
import struct
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .._errors import GpuWorkerError
from .._worker_env import JIT_CACHE
from ._kernelcache import host_fingerprint, tinygrad_version

MAGIC = b"GWJIT\x00\x02\n"
_HEAD = struct.Struct("<QQ")  # the header's offset and length
PAGE = mmap.PAGESIZE
ENV = JIT_CACHE
SOFTWARE_FIELDS = ("tinygrad", "python", "code_sha256")
_POLL_S = 0.05


class CacheEntryInvalid(GpuWorkerError):
    """An entry that exists but cannot be trusted: truncated, corrupt, from another key, or unrestorable."""


def cache_key(artifact_digest: str, device: str, source_files: list[Path], extra: dict[str, Any]) -> dict[str, Any]:
    """Every input that decides what an entry holds. `extra` holds the model's kind and configuration."""
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


@dataclass
class Mapped:
    """An entry's payload, mapped private and writable: restored buffers point into it, and kernels that write them
    (activations, KV caches) copy only their own pages, never touching the file."""

    mm: mmap.mmap
    header: dict[str, Any]
    pickle: memoryview
    regions: list[memoryview]  # the data regions, by index
    addresses: list[int]  # where each region starts in this process
    hashing: _RegionHash | None = None
    views: list[memoryview] = field(default_factory=list)

    def out_of_band(self) -> list[memoryview]:
        return [self.regions[i] for i in self.header["out_of_band"]]

    def release_views(self) -> None:
        """Drops this object's memoryviews of the mapping (restored buffers hold addresses, not views)."""
        for v in (self.pickle, *self.regions, *self.views):
            v.release()


_MAPPINGS: list[mmap.mmap] = []  # restored device buffers point into these: they live as long as the process


def _layout(view: memoryview, header: dict[str, Any]) -> tuple[memoryview, list[memoryview]]:
    pickle_len, offsets = int(header["pickle_len"]), header["buffers"]
    if any(not 0 <= int(i) < len(offsets) for i in header["out_of_band"]):
        raise CacheEntryInvalid("out-of-band buffer index outside the entry")
    regions = [view[PAGE + int(off): PAGE + int(off) + int(n)] for off, n in offsets]
    if any(len(r) != int(n) for r, (_, n) in zip(regions, offsets, strict=True)):
        raise CacheEntryInvalid("a data region lies outside the entry")
    return view[PAGE: PAGE + pickle_len], regions


def _mapped(f: Any, header: dict[str, Any], hash_regions: bool) -> Mapped:
    mm = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    view = memoryview(mm)
    try:
        pick, regions = _layout(view, header)
    except (KeyError, TypeError, ValueError) as exc:
        view.release()
        raise CacheEntryInvalid(f"unreadable header: {exc}") from exc
    base = ctypes.addressof(ctypes.c_char.from_buffer(mm))
    addresses = [base + PAGE + int(off) for off, _ in header["buffers"]]
    hashing = None
    if hash_regions:  # through a second, read-only mapping: the private one may be written by then
        pristine = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        hashing = _RegionHash(pristine, [(PAGE + int(off), int(n)) for off, n in header["buffers"]])
    _MAPPINGS.append(mm)
    return Mapped(mm, header, pick, regions, addresses, hashing, [view])


def open_entry(path: Path, key: dict[str, Any]) -> Mapped | None:
    """A valid-looking entry, mapped, with its pickle verified and its regions being hashed; None when there is none;
    CacheEntryInvalid when it is bad. The caller restores from it, then compares hashing.join() with the header's
    regions_sha256."""
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
        header = _read_header(f, st.st_size)
        if header.get("key") != json.loads(json.dumps(key)):  # compared as JSON holds it (tuples become lists)
            raise CacheEntryInvalid("entry was written for a different key")
        entry = _mapped(f, header, hash_regions=True)
    if hashlib.sha256(entry.pickle).hexdigest() != header.get("pickle_sha256"):
        if entry.hashing is not None:
            entry.hashing.join()  # the thread finishes before the caller drops the entry
        raise CacheEntryInvalid("pickle sha256 mismatch")
    return entry


def _read_header(f: Any, size: int) -> dict[str, Any]:
    head = f.read(len(MAGIC) + _HEAD.size)
    if len(head) < len(MAGIC) + _HEAD.size or size < PAGE:
        raise CacheEntryInvalid("truncated or empty entry")
    if head[: len(MAGIC)] != MAGIC:
        raise CacheEntryInvalid("not a jit cache entry of this version (bad magic)")
    offset, length = _HEAD.unpack(head[len(MAGIC):])
    if offset + length != size or offset < PAGE:
        raise CacheEntryInvalid(f"header at {offset}+{length} does not end the {size}-byte entry")
    f.seek(offset)
    try:
        header = json.loads(f.read(length))
        if int(header["payload_len"]) != offset - PAGE:
            raise ValueError(f"payload is {offset - PAGE} bytes, header says {header['payload_len']}")
    except (ValueError, KeyError, TypeError) as exc:
        raise CacheEntryInvalid(f"unreadable header: {exc}") from exc
    if not isinstance(header, dict):
        raise CacheEntryInvalid("unreadable header: not an object")
    return header


def write_entry(path: Path, key: dict[str, Any], body: memoryview, regions: list[memoryview], oob: list[int],
                finish: Callable[[Mapped], dict[str, Any]]) -> int:
    """Writes an entry; the bytes written. `finish` gets the written payload mapped as a reader maps it (a second
    copy: the writer's own objects are untouched) and returns what the header adds; it may raise, and then nothing
    is stored. The file appears under `path` only whole."""
    offsets, pos = [], len(body)
    for r in regions:
        pos = -(-pos // PAGE) * PAGE
        offsets.append([pos, r.nbytes])
        pos += r.nbytes
    digest = hashlib.sha256()
    for r in regions:
        digest.update(r)
    header: dict[str, Any] = {"key": key, "pickle_sha256": hashlib.sha256(body).hexdigest(),
                              "regions_sha256": digest.hexdigest(), "pickle_len": len(body), "buffers": offsets,
                              "out_of_band": oob, "payload_len": pos}
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w+b") as f:
            f.write(MAGIC + _HEAD.pack(0, 0))
            f.seek(PAGE)
            f.write(body)
            for (off, _), r in zip(offsets, regions, strict=True):
                f.seek(PAGE + off)
                f.write(r)
            f.truncate(PAGE + pos)
            f.flush()
            copy = _mapped(f, header, hash_regions=False)
            try:
                header.update(finish(copy))
            finally:
                copy.release_views()
                with contextlib.suppress(OSError, ValueError):  # the copy's pages are not needed any more
                    copy.mm.madvise(mmap.MADV_DONTNEED)
            blob = json.dumps(header).encode()
            f.seek(PAGE + pos)
            f.write(blob)
            f.seek(len(MAGIC))
            f.write(_HEAD.pack(PAGE + pos, len(blob)))
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return PAGE + pos + len(blob)


class _RegionHash(threading.Thread):
    def __init__(self, mapping: mmap.mmap, spans: list[tuple[int, int]]) -> None:
        super().__init__(name="jitcache-verify", daemon=True)
        self.mapping, self.spans, self.digest = mapping, spans, ""
        self.start()

    def run(self) -> None:  # hashlib drops the GIL: this overlaps the unpickle
        h = hashlib.sha256()
        with self.mapping, memoryview(self.mapping) as view:
            for off, n in self.spans:
                with view[off: off + n] as part:
                    h.update(part)
        self.digest = h.hexdigest()

    def join(self, timeout: float | None = None) -> str:  # type: ignore[override]
        super().join(timeout)
        return self.digest


def read_key(path: Path) -> dict[str, Any] | None:
    """The key an entry's header names, or None when it has no readable header."""
    try:
        with open(path, "rb") as f:
            key = _read_header(f, os.fstat(f.fileno()).st_size)["key"]
    except (OSError, KeyError, CacheEntryInvalid):
        return None
    return key if isinstance(key, dict) else None


def evict_stale(cache_dir: Path, key: dict[str, Any]) -> list[Path]:
    """Removes entries for the same model, device and host written by other software (tinygrad, Python or this
    code): this software can never load them, and they can be large."""
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


class Locks:
    """Exclusive named locks shared by every worker of one cache directory, so replicas starting together build an
    entry once: byte-range locks on one file, one byte per name. POSIX drops a process's locks on a file when it
    closes any descriptor of it, so each process keeps one descriptor per lock file, and locks are per process (one
    compute thread per worker takes them)."""

    _fds: dict[Path, int] = {}

    def __init__(self, path: Path) -> None:
        self.path = path

    def _fd(self) -> int:
        if (fd := self._fds.get(self.path)) is None:
            self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd = self._fds[self.path] = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        return fd

    @staticmethod
    def _offset(name: str) -> int:
        return int(hashlib.sha256(name.encode()).hexdigest()[:10], 16)

    def try_take(self, name: str) -> bool:
        try:
            fcntl.lockf(self._fd(), fcntl.LOCK_EX | fcntl.LOCK_NB, 1, self._offset(name))
        except (BlockingIOError, PermissionError):
            return False
        return True

    def release(self, name: str) -> None:
        fcntl.lockf(self._fd(), fcntl.LOCK_UN, 1, self._offset(name))

    @contextlib.contextmanager
    def held(self, name: str, wait_s: float) -> Iterator[bool]:
        """Holds `name`, waiting at most `wait_s` for another worker to release it; yields whether it got it (past
        the wait the caller goes on without it: duplicate work, never a hung LOAD)."""
        deadline = time.monotonic() + wait_s
        while not (got := self.try_take(name)) and time.monotonic() < deadline:
            time.sleep(_POLL_S)
        try:
            yield got
        finally:
            if got:
                self.release(name)
