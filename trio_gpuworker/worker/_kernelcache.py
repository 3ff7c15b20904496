"""tinygrad's own kernel cache (CACHEDB) and what compiled kernels depend on: the tinygrad version and the host CPU.

tinygrad keys a compiled CPU kernel by its source and "-march=native" only, so a state directory moved to
another CPU or tinygrad would serve it binaries built for something else; and a corrupt database makes
every compile fail, so the lane would crash-loop. check_kernel_cache runs before tinygrad opens it.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import os
import platform
from pathlib import Path


def host_fingerprint() -> str:
    """The machine and a digest of its CPU model and feature flags."""
    return f"{platform.machine()}:{_cpu_fingerprint()}"


def host_key() -> str:
    """What compiled CPU kernels depend on beyond their source: tinygrad's version and the host's CPU."""
    return f"tinygrad {tinygrad_version()} {host_fingerprint()}"


def check_kernel_cache(db: Path) -> str | None:
    """Moves tinygrad's kernel cache aside when it is corrupt (tinygrad would fail every compile on it, and
    the lane would crash-loop) or was stamped for another tinygrad or CPU: tinygrad keys compiled kernels by
    source and "-march=native" only. Runs before tinygrad opens it. Returns what was done, if anything."""
    import sqlite3

    stamp = db.with_name(db.name + ".stamp")
    try:
        have = stamp.read_text()
    except OSError:
        have = None  # a cache from before stamps: adopted as this host's
    why = None
    if have is not None and have != host_key():
        why = f"built for {have!r}"
    elif db.exists():
        try:
            with contextlib.closing(sqlite3.connect(db, timeout=60)) as conn:
                if (res := conn.execute("PRAGMA quick_check").fetchone()[0]) != "ok":
                    why = f"corrupt: {res}"
        except sqlite3.DatabaseError as exc:
            why = f"corrupt: {exc}"
    if why is not None:
        for suffix in ("", "-wal", "-shm"):
            with contextlib.suppress(FileNotFoundError):
                os.replace(f"{db}{suffix}", f"{db}.bad{suffix}")
    if have != host_key():
        with contextlib.suppress(OSError):
            stamp.write_text(host_key())
    return why


def _cpu_fingerprint() -> str:
    """The CPU model and feature flags: CPU kernels are compiled for this host's instruction set."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or "unknown"
    wanted = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags", "Features"))]
    return hashlib.sha256("\n".join(sorted(set(wanted))).encode()).hexdigest()[:16]


def tinygrad_version() -> str:
    try:
        return importlib.metadata.version("tinygrad")
    except importlib.metadata.PackageNotFoundError:  # a source checkout: its own files are the version
        import tinygrad

        return "src:" + hashlib.sha256(Path(tinygrad.__file__).parent.joinpath("helpers.py").read_bytes()).hexdigest()
