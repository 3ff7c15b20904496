"""sha256 of artifacts, read in chunks (the daemon caches it; workers re-check before loading)."""

from __future__ import annotations

import hashlib
from pathlib import Path

HASH_CHUNK = 4 << 20


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()
