"""The test session's own state directory: the compiled-kernel cache (CACHEDB) and the JIT cache that tests share, so
kernels compile once per session. Created at first import, removed when the session ends (tests/conftest.py), or at
exit by a process outside pytest that made it (a benchmark borrowing tests/support); the checkout's own `.state/`
is never written. A child process of the session that imports this (a multiprocessing
"spawn" child imports its test module) shares the session's directory instead of making one nobody removes.

Also the session's short-lived directories with short paths (`short_dir`: a Unix socket's path must stay under 108
bytes, which pytest's tmp_path does not promise), removed with it."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

_ENV = "GPUWORKER_TESTS_SESSION_STATE"
_MADE_HERE = _ENV not in os.environ
SESSION_STATE = Path(os.environ.get(_ENV) or tempfile.mkdtemp(prefix="gw-tests-state-"))
os.environ[_ENV] = str(SESSION_STATE)
if _MADE_HERE:  # a process outside pytest (a benchmark that borrows tests/support) removes it at exit too
    atexit.register(shutil.rmtree, SESSION_STATE, ignore_errors=True)
SESSION_CACHE = SESSION_STATE / "cache"  # what a worker gets under its state directory (supervisor/_spawn.py)
SESSION_CACHE.mkdir(exist_ok=True)
SHORT_DIRS: list[Path] = []


def short_dir(prefix: str) -> Path:
    """A fresh directory directly under the system's temporary directory (a daemon's runtime directory, where its
    workers' sockets go), removed when the session ends."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    SHORT_DIRS.append(path)
    return path
