"""The tinygrad engine (docs/engines.md): an Engine whose models are the registry's kinds (_kinds.py), plus the
requests of the PACKED extension and the data plane, served through the same table (`Engine.handlers`).

tinygrad is imported on the first LOAD, so a fresh worker answers HELLO fast.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

from .._errors import WorkerError
from .._kinds import EMBEDDING, KINDS, RERANK, LoadConfig
from .._proto import (
    EXTENSIONS,
    ConfigureRole,
    EmbedBatch,
    Generate,
    GeneratePacked,
    InstallRing,
    ReleaseDeviceObject,
    Rerank,
    Texts,
    UninstallRing,
    WireMessage,
)
from .._token_ids import split_rows
from ..engine import (
    Context,
    EmbedRequest,
    GenerateRequest,
    Generation,
    LoadRequest,
    Ranking,
    RerankRequest,
    UnloadRequest,
)
from ..engine import Engine as BaseEngine
from ._genbatch import PackedGeneration
from ._generate import generate
from ._loaders import load_config


def truncate_pair(n_a: int, n_b: int, budget: int) -> tuple[int, int]:
    """Hugging Face tokenizers' longest_first for a pair: the shorter side keeps up to half the budget
    (the lower half; on a tie the first side is the shorter), the other side takes the rest."""
    if n_a + n_b <= budget:
        return n_a, n_b
    if n_a > n_b:
        keep_b = min(n_b, budget // 2)
        return budget - keep_b, keep_b
    keep_a = min(n_a, budget // 2)
    return keep_a, budget - keep_a


def compose_pairs(query: np.ndarray, docs: list[np.ndarray], cls_id: int, sep_id: int,
                  max_tokens: int, roberta: bool = False) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """[CLS] query [SEP] doc [SEP] with token types 0.../1..., truncated to max_tokens like the tokenizer; with
    `roberta`, XLM-RoBERTa's <s> query </s></s> doc </s>, every token of type 0 (it has one type)."""
    middle = [sep_id, sep_id] if roberta else [sep_id]
    pairs, types = [], []
    for doc in docs:
        nq, nd = truncate_pair(len(query), len(doc), max_tokens - 2 - len(middle))
        ids = np.concatenate([[cls_id], query[:nq], middle, doc[:nd], [sep_id]]).astype(np.int32)
        pairs.append(ids)
        types.append(np.concatenate([np.zeros(nq + 1 + len(middle), np.int32),
                                     np.full(nd + 1, 0 if roberta else 1, np.int32)]))
    return pairs, types


class Engine(BaseEngine):
    """tinygrad's models behind the engine server; every extension of protocol v3 advertised."""

    name: ClassVar[str] = "tinygrad"
    version: ClassVar[str] = "0.14.0"

    def __init__(self) -> None:
        self.models: dict[str, Any] = {}
        self.dataplane: Any = None  # WorkerDataPlane, set once the handshake gave us a generation
        self.packed = PackedGeneration()  # GENERATE_PACKED's batches, kept between chunks
        # the base's requests, then the PACKED extension's and the data plane's: a new request is its class plus
        # one row here
        self.handlers.update({
            GeneratePacked: self.do_generate_packed,
            InstallRing: lambda msg, progress: self.dataplane.install_ring(msg),
            UninstallRing: lambda msg, progress: self.dataplane.uninstall_ring(msg),
            ConfigureRole: lambda msg, progress: self.dataplane.configure_role(msg),
            ReleaseDeviceObject: lambda msg, progress: self.dataplane.release(msg),
        })

    def extensions(self) -> frozenset[str]:
        return frozenset(EXTENSIONS)

    def served(self, model_ref: str, request: type[WireMessage]) -> Any:
        """The model `model_ref`, if its kind serves `request` (the registry's `requests`). The daemon checked the
        kind already (supervisor/_route.py, its one check); this is the worker's own, kept because a worker is a
        separate process that takes whatever arrives on its socket, and answers a wrong kind with a typed ERR."""
        m = self.model(model_ref)
        if request not in KINDS[m.kind].requests:
            wanted = next(k for k, v in KINDS.items() if request in v.requests)
            raise WorkerError("invalid_request", f"model {model_ref!r} is a {m.kind} model, not {wanted}")
        return m

    def load(self, request: LoadRequest, ctx: Context) -> _Served:
        """Loaded and warmed under LOAD's window, not the first request's (or restored warm from the JIT cache)."""
        ctx.progress(1, "setup")
        cfg = load_config(EMBEDDING, request.runtime_config)
        kind = KINDS[cfg.kind]
        if request.format not in kind.formats:
            raise WorkerError("config_invalid", f"unsupported format/kind {request.format!r}/{cfg.kind!r}")
        impl, detokenizer = kind.load()(cfg, request.artifact_path, request.artifact_digest, request.verify,
                                        lambda k: ctx.progress(1 + k))
        return _Served(impl, cfg, detokenizer)

    def unload(self, request: UnloadRequest, ctx: Context) -> None:
        self.packed.drop(request.model_ref)

    def embed(self, request: EmbedRequest, ctx: Context) -> np.ndarray:
        m = self.served(request.model_ref, EmbedBatch)
        return m.impl.embed(request.token_ids, request.pooling, request.normalize, ctx.progress)

    def rerank(self, request: RerankRequest, ctx: Context) -> Ranking:
        """A cross-encoder scores composed pairs; an embedding model scores by bi-encoder cosine (labelled)."""
        m = request.model
        if Rerank not in KINDS[m.kind].requests:
            raise WorkerError("model_not_loaded", f"no rerank or embedding model {request.model_ref!r} loaded")
        q, docs = request.query, request.candidates
        if m.kind == RERANK:
            pairs, types = compose_pairs(q, docs, m.cls_id, m.sep_id, m.max_tokens, m.roberta)
            return Ranking(m.impl.score(pairs, types, ctx.progress), "cross_encoder")
        wrap = lambda r: np.concatenate([[m.cls_id], r[: m.max_tokens - 2], [m.sep_id]]).astype(np.int32)  # noqa: E731
        vecs = m.impl.embed([wrap(q)] + [wrap(d) for d in docs], "mean", True, ctx.progress)
        return Ranking(vecs[1:] @ vecs[0], "bi_encoder_cosine")

    def generate(self, request: GenerateRequest, ctx: Context) -> Generation:
        return generate(self.served(request.model_ref, Generate), request, ctx)

    def do_generate_packed(self, msg: GeneratePacked, progress: Any) -> Texts:
        m = self.served(msg.model_ref, GeneratePacked)
        try:
            return self.packed.run(m, msg, progress)
        except ValueError as exc:
            raise WorkerError("invalid_request", str(exc)) from exc


class _Served:
    """A loaded model plus what the engine needs to know of it."""

    def __init__(self, impl: Any, cfg: LoadConfig, detokenizer: Any = None) -> None:
        self.impl = impl
        self.kind = cfg.kind
        self.dims = int(impl.dims) if KINDS[cfg.kind].encoder and hasattr(impl, "dims") else 0
        encoder = impl.cfg if KINDS[cfg.kind].encoder else None  # models/bert.py BertConfig
        self.roberta = encoder is not None and encoder.roberta
        # the daemon's [CLS]/[SEP] (from its tokenizer), or XLM-RoBERTa's <s>/</s> from the model's config
        self.cls_id, self.sep_id = encoder.special_ids if self.roberta else cfg.ids
        self.max_tokens = cfg.max_tokens
        self.detokenizer = detokenizer  # a decoder's: ids in, text out
        self._grammars: Any = None

    @property
    def grammars(self) -> Any:
        """A decoder's compiled grammars (models/constraint.py), made on its first grammar."""
        if self._grammars is None:
            from ..models.constraint import Grammars

            self._grammars = Grammars(self.detokenizer.tokenizer, self.impl.vocab_size, self.impl.eos_ids)
        return self._grammars


__all__ = ["Engine", "compose_pairs", "split_rows", "truncate_pair"]
