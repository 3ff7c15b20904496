"""Model artifacts: digests (hashed once, cached by size and mtime) and LOAD specs."""

from __future__ import annotations

import json
import os
from pathlib import Path

import trio

from .._config import ModelConfig
from .._digest import sha256_file
from .._errors import ConfigError
from .._kinds import LoadConfig
from ._jobs import LoadSpec


class DigestCache:
    """sha256 of artifacts keyed by (path, size, mtime_ns), persisted under the state directory."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self._cache: dict[str, str] = json.loads(path.read_text())
        except (OSError, ValueError):
            self._cache = {}

    def _key(self, artifact: Path) -> str:
        st = artifact.stat()
        return f"{os.fspath(artifact)}:{st.st_size}:{st.st_mtime_ns}"

    async def digest(self, artifact: Path) -> str:
        key = self._key(artifact)
        if key not in self._cache:
            self._cache[key] = await trio.to_thread.run_sync(sha256_file, artifact)
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(self._cache, indent=0))
            tmp.replace(self.path)
        return self._cache[key]


def tokenizer_file(model: ModelConfig) -> Path | None:
    """The encoder's tokenizer.json, if it has one (the daemon tokenizes; workers receive ids only)."""
    path = model.tokenizer_path or model.path.with_name("tokenizer.json")
    return path if model.encoder and path.is_file() else None


def special_ids(model: ModelConfig) -> dict[str, int]:
    """[CLS]/[SEP] ids from the daemon's tokenizer, so workers compose rerank pairs without one."""
    path = tokenizer_file(model)
    if path is None:
        return {}
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.fspath(path))
    ids = {"cls_id": tok.token_to_id("[CLS]"), "sep_id": tok.token_to_id("[SEP]")}
    return {k: v for k, v in ids.items() if v is not None}


async def load_spec(model: ModelConfig, cache: DigestCache) -> LoadSpec:
    if not model.path.is_file():
        raise ConfigError(f"models.{model.id}.path: artifact {model.path} does not exist")
    digest = model.digest or await cache.digest(model.path)
    # reading tokenizer.json stalls the loop: a thread, and only when there is one to read
    ids = await trio.to_thread.run_sync(special_ids, model) if tokenizer_file(model) is not None else {}
    rc = LoadConfig(model.kind, model.runtime_config, model.max_tokens, model.beam, **ids)
    return LoadSpec(model.id, model.path, digest.lower(), model.format, rc.to_map())
