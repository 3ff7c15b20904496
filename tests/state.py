"""The test session's own state directory: the compiled-kernel cache (CACHEDB) and the JIT cache that tests share, so
kernels compile once per session. Created at first import, removed when the session ends (tests/conftest.py); the
checkout's own `.state/` is never written."""

from __future__ import annotations

import tempfile
from pathlib import Path

SESSION_STATE = Path(tempfile.mkdtemp(prefix="gw-tests-state-"))
SESSION_CACHE = SESSION_STATE / "cache"  # what a worker gets under its state directory (supervisor/_spawn.py)
SESSION_CACHE.mkdir()
