"""The model kinds, one entry each in `KINDS`: what a kind's worker loads it with, the requests it serves, its
limits and defaults, and the typed `runtime_config` it takes.

The daemon (config load, request checks), the supervisor (LOAD) and the worker (LOAD, dispatch) all read this
module, so it imports no tinygrad: a loader is named as "module:function" and imported by the worker on LOAD.
A new kind is its loader module plus one `Kind` here (README, "Adding things").
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any

from ._errors import InvalidRequest
from ._proto import POOLINGS, EmbedBatch, Generate, GeneratePacked, Rerank, WireMessage

EMBEDDING, RERANK, GENERATE = "embedding", "rerank", "generate"
DEFAULT_MAX_TOKENS = 256  # truncation of each encoder input, as sentence-transformers does
DEFAULT_CONTEXT = 2048  # a decoder's context in tokens unless runtime_config.max_context says otherwise
MAX_CONTEXT = 1 << 20
BACKENDS = ("fused", "graph")  # one C kernel per call (CPU only), or tinygrad-generated kernels (any device)
MAX_THREADS = 8  # the fused encoder's and decoder's cores per kernel: models/kernels/threads.h MAXT
AUTO_THREADS = 0  # `threads` left out: each step takes the node's work-conserving share of its cores (_cores.py)
CLS_ID, SEP_ID = 101, 102  # BERT's [CLS]/[SEP], unless the daemon's tokenizer says otherwise


def _int(name: str, value: Any, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ValueError(f"{name} must be an int within {lo}..{hi}, got {value!r}")
    return value


def _default_backend(device: str) -> str:
    return "fused" if device.split(":")[0] == "CPU" else "graph"


def _backend(name: str, value: Any) -> None:
    if value is not None and value not in BACKENDS:
        raise ValueError(f"{name} must be one of {', '.join(BACKENDS)}, got {value!r}")


@dataclass(frozen=True)
class RuntimeConfig:
    """A model's `runtime_config` table, checked when built: unknown keys and bad values are ValueErrors whose
    message starts with the key. On the wire it is the same map (LOAD's runtime_config); None is "not set"."""

    @classmethod
    def from_map(cls, raw: Mapping[str, Any]) -> RuntimeConfig:
        known = [f.name for f in fields(cls)]
        for k in raw:
            if k not in known:
                raise ValueError(f"{k}: unknown key (known: {', '.join(sorted(known)) or 'none'})")
        return cls(**raw)

    def backend(self, device: str) -> str | None:
        """Which kernels the worker runs on `device`: "fused" (C, CPU only) or "graph" (tinygrad-generated, what
        BEAM tunes); None for a kind without the choice."""
        return None

    def to_map(self) -> dict[str, Any]:
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None:  # an unset key is left to the worker's default, as it always was
                out[f.name] = [list(v) for v in value] if isinstance(value, tuple) else value
        return out


@dataclass(frozen=True)
class EncoderRuntime(RuntimeConfig):
    """embedding and rerank models: `encoder` (default: fused on CPU, graph elsewhere), the fused encoder's
    `threads`, and the graph encoder's `warmup_shapes`, (length, batch) pairs compiled under LOAD."""

    encoder: str | None = None
    threads: int | None = None
    warmup_shapes: tuple[tuple[int, int], ...] | None = None

    def backend(self, device: str) -> str:
        return self.encoder or _default_backend(device)

    def __post_init__(self) -> None:
        _backend("encoder", self.encoder)
        if self.threads is not None:
            _int("threads", self.threads, 1, MAX_THREADS)
        if self.warmup_shapes is not None:
            shapes = self.warmup_shapes
            if isinstance(shapes, str | bytes) or not isinstance(shapes, list | tuple) or not all(
                    isinstance(s, list | tuple) and len(s) == 2 and all(
                        isinstance(x, int) and not isinstance(x, bool) and x >= 1 for x in s) for s in shapes):
                raise ValueError(f"warmup_shapes must be a list of [length, batch] positive ints, got {shapes!r}")
            if not shapes:
                raise ValueError("warmup_shapes is empty")
            object.__setattr__(self, "warmup_shapes", tuple((int(a), int(b)) for a, b in shapes))


@dataclass(frozen=True)
class DecoderRuntime(RuntimeConfig):
    """generate models: `decoder` (default: fused on CPU, graph elsewhere), the fused decoder's `threads`, and
    `max_context`, the tokens the prompt and the new tokens share (capped by the GGUF's context_length)."""

    decoder: str | None = None
    threads: int | None = None
    max_context: int | None = None

    def backend(self, device: str) -> str:
        return self.decoder or _default_backend(device)

    def __post_init__(self) -> None:
        _backend("decoder", self.decoder)
        if self.threads is not None:
            _int("threads", self.threads, 1, MAX_THREADS)
        if self.max_context is not None:
            _int("max_context", self.max_context, 2, MAX_CONTEXT)

    @property
    def context(self) -> int:
        return DEFAULT_CONTEXT if self.max_context is None else self.max_context


@dataclass(frozen=True)
class Kind:
    """One model kind."""

    name: str
    requests: tuple[type[WireMessage], ...]  # the wire requests its worker serves
    formats: tuple[str, ...]  # the artifact formats its loader reads
    loader: str  # "module:function" (worker side, imports tinygrad): (LoadConfig, path, digest, verify, progress)
    runtime: type[RuntimeConfig]
    encoder: bool  # inputs are token ids cut at max_tokens by a tokenizer.json; CPU lanes run a replica per core

    def load(self) -> Callable[..., Any]:
        module, _, name = self.loader.partition(":")
        return getattr(importlib.import_module(module), name)  # type: ignore[no-any-return]


_ENCODERS = "trio_gpuworker.worker._loaders:load_encoder"
KINDS: dict[str, Kind] = {k.name: k for k in (
    Kind(EMBEDDING, (EmbedBatch, Rerank), ("safetensors",), _ENCODERS, EncoderRuntime, encoder=True),
    Kind(RERANK, (Rerank,), ("safetensors",), _ENCODERS, EncoderRuntime, encoder=True),
    Kind(GENERATE, (Generate, GeneratePacked), ("gguf",), "trio_gpuworker.worker._loaders:load_decoder", DecoderRuntime,
         encoder=False),
)}
MODEL_KINDS = tuple(KINDS)
ENCODER_KINDS = tuple(k for k, v in KINDS.items() if v.encoder)

# The API's requests (as error messages name them) and the wire request each becomes; tokenization takes any kind.
API_REQUESTS: dict[str, type[WireMessage] | None] = {
    "embeddings": EmbedBatch, "rerank": Rerank, "generation": Generate, "completions": Generate,
    "chat completions": Generate, "tokenization": None}


def serving(what: str) -> tuple[str, ...]:
    """The kinds that serve the API request `what`."""
    request = API_REQUESTS[what]
    return tuple(k for k, v in KINDS.items() if request is None or request in v.requests)


def check_serves(model: str, kind: str, what: str) -> None:
    """The one kind check of a request: InvalidRequest when model `model` (of `kind`) cannot answer `what`."""
    if kind not in serving(what):
        raise InvalidRequest(f"model {model!r} serves {kind}, not {what}")


def runtime_config(kind: str, raw: Mapping[str, Any] | RuntimeConfig) -> RuntimeConfig:
    """The kind's RuntimeConfig from a table (ValueError naming the key), or `raw` if it is one already."""
    cls = KINDS[kind].runtime
    if isinstance(raw, RuntimeConfig):
        if not isinstance(raw, cls):
            raise ValueError(f"a {kind} model takes a {cls.__name__}, not a {type(raw).__name__}")
        return raw
    try:
        return cls.from_map(raw)
    except TypeError as exc:  # a value of a type the checks did not expect
        raise ValueError(str(exc)) from exc


@dataclass(frozen=True)
class LoadConfig:
    """LOAD's runtime_config map, typed: the daemon's keys from the model's table and the kind's RuntimeConfig,
    flattened into one map on the wire (the shape it always had)."""

    kind: str
    runtime: RuntimeConfig
    max_tokens: int = DEFAULT_MAX_TOKENS
    beam: int = 0
    cls_id: int | None = None  # from the daemon's tokenizer, when it has one
    sep_id: int | None = None

    def to_map(self) -> dict[str, Any]:
        ids = {k: v for k, v in (("cls_id", self.cls_id), ("sep_id", self.sep_id)) if v is not None}
        return {"kind": self.kind, "max_tokens": self.max_tokens, "beam": self.beam, **ids, **self.runtime.to_map()}

    @classmethod
    def from_map(cls, raw: Mapping[str, Any]) -> LoadConfig:
        """ValueError (naming the key) for what this worker cannot load."""
        rest = dict(raw)
        kind = rest.pop("kind", EMBEDDING)
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
        own = {k: rest.pop(k) for k in ("max_tokens", "beam", "cls_id", "sep_id") if k in rest}
        for k in ("max_tokens", "cls_id", "sep_id"):
            if k in own:
                _int(k, own[k], 0, 1 << 31)
        return cls(kind=kind, runtime=runtime_config(kind, rest), **own)

    @property
    def ids(self) -> tuple[int, int]:
        return (CLS_ID if self.cls_id is None else self.cls_id, SEP_ID if self.sep_id is None else self.sep_id)


__all__ = ["API_REQUESTS", "BACKENDS", "CLS_ID", "DEFAULT_CONTEXT", "DEFAULT_MAX_TOKENS", "EMBEDDING",
           "ENCODER_KINDS", "GENERATE", "KINDS", "MAX_CONTEXT", "MAX_THREADS", "MODEL_KINDS", "POOLINGS", "RERANK",
           "SEP_ID", "DecoderRuntime", "EncoderRuntime", "Kind", "LoadConfig", "RuntimeConfig", "check_serves",
           "runtime_config", "serving"]
