"""The CPU device's own helper programs, kept between workers.

Opening tinygrad's CPU device lowers and renders four small programs of its own (signal, wait, timestamp and the
worker loop) on every start: ~0.8 s of Python per worker process, about a fifth of a warm start, and paid by
every replica, standby and restart. CACHEDB only caches their clang step. They depend on nothing but tinygrad's
code and the host CPU, so the first worker on a machine stores their compiled form (tinygrad's TinyELF) here and
later ones load it instead of lowering again.

Each program is keyed by its name, the content hash of its AST (UOp.key, computed fresh in the opening process)
and the renderer's target; the file by the tinygrad version and host CPU (_kernelcache.host_key), and its pickle
by a sha256 over it, checked before it is unpickled. Anything that does not match is lowered as on a first start.
This is the one module that touches the CPU device's internals (ops_cpu.do_to_program, while the device opens).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import pickle
import threading
from pathlib import Path
from typing import Any

from ._kernelcache import host_key

FILE = "cpu_device.pkl"
_OPEN_LOCK = threading.Lock()  # the patch is process-wide while the device opens


class _Restored:
    """What CPUDevice.__init__ reads of do_to_program's result: its TinyELF."""

    def __init__(self, elf: Any) -> None:
        self.elf = elf

    def to_elf(self) -> Any:
        return self.elf


def _read(path: Path) -> dict[tuple[str, bytes, str], Any]:
    try:
        data = path.read_bytes()
    except OSError:
        return {}
    digest, sep, body = data.partition(b"\n")
    if not sep or hashlib.sha256(body).hexdigest().encode() != digest:
        return {}  # torn or altered: lowered again and rewritten
    try:
        stored = pickle.loads(body)
    except Exception:  # an unpicklable entry of another tinygrad: lowered again
        return {}
    if not isinstance(stored, dict) or stored.get("host_key") != host_key():
        return {}
    entries = stored.get("programs")
    return entries if isinstance(entries, dict) else {}


def _write(path: Path, programs: dict[tuple[str, bytes, str], Any]) -> None:
    body = pickle.dumps({"host_key": host_key(), "programs": programs}, protocol=pickle.HIGHEST_PROTOCOL)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}")
    with contextlib.suppress(OSError):
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        tmp.write_bytes(hashlib.sha256(body).hexdigest().encode() + b"\n" + body)
        os.replace(tmp, path)  # concurrent writers store the same programs: the last rename wins whole
    with contextlib.suppress(OSError):
        tmp.unlink()


def open_device(cache_dir: Path | None) -> tuple[int, int]:
    """Open tinygrad's default device; on CPU with a cache directory, with its helper programs restored from
    there (and stored there when they were not). Returns (programs restored, programs lowered)."""
    from tinygrad import Device

    if Device.DEFAULT != "CPU" or cache_dir is None:
        Device[Device.DEFAULT]
        return 0, 0
    from tinygrad.runtime import ops_cpu

    path = cache_dir / FILE
    stored = _read(path)
    fresh: dict[tuple[str, bytes, str], Any] = {}
    restored = 0
    real = ops_cpu.do_to_program

    def lower(ast: Any, renderer: Any) -> Any:
        nonlocal restored
        key = (str(ast.arg.name), bytes(ast.key), repr(renderer.target))
        if (elf := stored.get(key)) is not None:
            restored += 1
            return _Restored(elf)
        prg = real(ast, renderer)
        fresh[key] = prg.to_elf()
        return prg

    with _OPEN_LOCK:
        ops_cpu.do_to_program = lower
        try:
            Device["CPU"]
        finally:
            ops_cpu.do_to_program = real
    if fresh:
        _write(path, {**stored, **fresh})
    return restored, len(fresh)


__all__ = ["FILE", "open_device"]
