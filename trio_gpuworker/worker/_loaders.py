"""Model loading for LOAD: weights plus warmed (captured) JITs, restored from the JIT cache when it holds a
valid entry for this exact artifact, device and code (worker/_jitcache.py), else built and then stored.

Runs on the compute thread; tinygrad is imported here, on the first LOAD.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from .._errors import GpuWorkerError
from . import _jitcache

ModelProgress = Callable[[int], None]


class LoadError(GpuWorkerError):
    """A model that cannot be loaded; `code` is a wire code (config_invalid)."""

    def __init__(self, code: str, msg: str) -> None:
        super().__init__(msg)
        self.code = code


def _log(line: str) -> None:
    print(line, file=sys.stderr)  # the lane's log ring


def _cached(path: Path, digest: str, kind: str, modules: tuple[str, ...], extra: dict[str, Any],
            build: Callable[[], Any], probe: Callable[[Any], np.ndarray], verify: Callable[[], None]) -> Any:
    from tinygrad import Device

    sources = [Path(sys.modules[m].__file__ or "") for m in (*modules, __name__, _jitcache.__name__)]
    key = _jitcache.cache_key(digest, Device.DEFAULT, sources, {"kind": kind, **extra})
    try:
        impl, outcome = _jitcache.load_or_build(key, build, probe, _log, verify)
    except (ValueError, KeyError, TypeError) as exc:
        raise LoadError("config_invalid", f"cannot load {path}: {exc}") from exc
    _log(f"worker: {kind} model {path.name}: jit cache {outcome}")
    return impl


def load_bert(kind: str, path: Path, config: dict[str, Any], rc: dict[str, Any], digest: str,
              verify: Callable[[], None], progress: ModelProgress) -> Any:
    """An encoder with the (length, batch) shapes of runtime_config `warmup_shapes` (default (16, 1)) captured."""
    if kind == "embedding":
        from ..models.bert import BertEncoder as cls
    elif kind == "rerank":
        from ..models.cross_encoder import BertCrossEncoder as cls
    else:
        raise LoadError("config_invalid", f"safetensors artifacts serve embedding or rerank, not {kind!r}")
    max_tokens = int(rc.get("max_tokens", 256))
    try:
        shapes = [(int(length), int(batch)) for length, batch in rc.get("warmup_shapes", [[16, 1]])]
        if not shapes:
            raise ValueError("warmup_shapes is empty")
    except (ValueError, TypeError) as exc:
        raise LoadError("config_invalid", f"warmup_shapes: {exc}") from exc

    def build() -> Any:
        impl = cls.load(path, config, max_tokens=max_tokens)
        impl.warmup(shapes, progress)
        return impl

    def probe(impl: Any) -> np.ndarray:  # a fixed, non-trivial input in the first warm-up shape
        length, batch = shapes[0]
        rows = [(np.arange(length, dtype=np.int32) * 7 + 101 + j) % impl.cfg.vocab_size for j in range(batch)]
        return impl._run(rows, None, impl._width(), None)

    extra = {"config": config, "max_tokens": max_tokens, "shapes": shapes}
    modules = (cls.__module__, "trio_gpuworker.models.bert", "trio_gpuworker.models._jitstate")
    return _cached(path, digest, kind, modules, extra, build, probe, verify)


def load_llama(path: Path, digest: str, verify: Callable[[], None], progress: ModelProgress) -> tuple[Any, Any]:
    """(decoder with its prefill and decode graphs captured, detokenizer): both restored from one entry."""
    from ..llm_tokenizer import ChatTokenizer
    from ..models.llama import DEFAULT_CONTEXT, LlamaLM

    def build() -> tuple[Any, Any]:
        lm = LlamaLM.load(path, warmup=False)
        lm.warmup(progress)
        return lm, ChatTokenizer.from_gguf(path)  # ids in, text out: no tokenization in the worker

    def probe(built: tuple[Any, Any]) -> np.ndarray:  # a restore must reproduce the decode graph's answer
        return np.asarray([built[0].probe()], dtype=np.int64)

    extra = {"max_context": DEFAULT_CONTEXT}
    modules = ("trio_gpuworker.models.llama", "trio_gpuworker.models._jitstate", "trio_gpuworker.llm_tokenizer")
    return _cached(path, digest, "generate", modules, extra, build, probe, verify)
