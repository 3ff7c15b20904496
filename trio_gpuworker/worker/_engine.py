"""Request handlers that run off the event loop: LOAD, EMBED_BATCH, RERANK, GENERATE, UNLOAD, PING and the data
plane's control requests, dispatched by message class through one table (`Engine.handlers`).

tinygrad is imported on the first LOAD, so a fresh worker answers HELLO fast.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from .._digest import sha256_file
from .._errors import WorkerError
from .._kinds import EMBEDDING, KINDS, RERANK, LoadConfig
from .._proto import (
    ConfigureRole,
    EmbedBatch,
    Generate,
    GeneratePacked,
    InstallRing,
    Load,
    Loaded,
    Ping,
    Pong,
    ReleaseDeviceObject,
    Rerank,
    Scores,
    Text,
    Texts,
    UninstallRing,
    Unload,
    Unloaded,
    Vectors,
    WireMessage,
)
from ._genbatch import PackedGeneration
from ._generate import generate
from ._loaders import load_config

Progress = Callable[..., None]  # (completed, phase[, post=False: check for an abort only, send nothing])
Handler = Callable[[Any, Progress], WireMessage]  # a request's class -> its reply (a class too)


def split_rows(raw: bytes, lengths: list[int], allow_empty: bool = False) -> list[np.ndarray]:
    if len(raw) % 4 or sum(lengths) != len(raw) // 4:
        raise WorkerError("invalid_request",
                                 f"items name {sum(lengths)} ids, the raw frame holds {len(raw) / 4}")
    if not allow_empty and any(n == 0 for n in lengths):
        raise WorkerError("invalid_request", "an item has zero tokens")
    ids = np.frombuffer(raw, dtype="<i4").astype(np.int32)
    return np.split(ids, np.cumsum(lengths)[:-1]) if lengths else []


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


_PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_mb() -> float:
    """The current resident set (not the peak, which never goes down), from /proc/self/statm."""
    with open("/proc/self/statm", "rb") as f:
        return int(f.read().split()[1]) * _PAGE / (1 << 20)


class Engine:
    def __init__(self) -> None:
        self.models: dict[str, Any] = {}
        self.load_failures: dict[str, str] = {}  # model_ref -> why its last LOAD failed ("code: message")
        self.dataplane: Any = None  # WorkerDataPlane, set once the handshake gave us a generation
        self.post: Callable[[str, dict[str, Any]], None] | None = None  # queues a notice (TEXT_DELTA) to the daemon
        self.packed = PackedGeneration()  # GENERATE_PACKED's batches, kept between chunks
        # every request this engine serves, by class: a new request is its class plus one row here
        self.handlers: dict[type[WireMessage], Handler] = {
            Load: self.do_load,
            EmbedBatch: self.do_embed_batch,
            Rerank: self.do_rerank,
            Generate: self.do_generate,
            GeneratePacked: self.do_generate_packed,
            Unload: self.do_unload,
            Ping: self.do_ping,
            InstallRing: lambda msg, progress: self.dataplane.install_ring(msg),
            UninstallRing: lambda msg, progress: self.dataplane.uninstall_ring(msg),
            ConfigureRole: lambda msg, progress: self.dataplane.configure_role(msg),
            ReleaseDeviceObject: lambda msg, progress: self.dataplane.release(msg),
        }

    def handle(self, msg: WireMessage, progress: Progress) -> WireMessage:
        handler = self.handlers.get(type(msg))
        if handler is None:
            raise WorkerError("unsupported_request", f"this worker does not serve {msg.T}")
        return handler(msg, progress)

    def model(self, msg: EmbedBatch | Generate | GeneratePacked) -> Any:
        """The model `msg` names, if its kind serves that request (the registry's `requests`). The daemon checked
        the kind already (supervisor/_route.py, its one check); this is the worker's own, kept because a worker is
        a separate process that takes whatever arrives on its socket, and answers a wrong kind with a typed ERR."""
        m = self.models.get(msg.model_ref)
        if m is None:
            self.refuse_failed(msg.model_ref)
            raise WorkerError("model_not_loaded", f"model {msg.model_ref!r} is not loaded in this worker")
        if type(msg) not in KINDS[m.kind].requests:
            wanted = next(k for k, v in KINDS.items() if type(msg) in v.requests)
            raise WorkerError("invalid_request", f"model {msg.model_ref!r} is a {m.kind} model, not {wanted}")
        return m

    def refuse_failed(self, model_ref: str) -> None:
        """A request for a model whose LOAD failed says why (model_load_failed), not merely that it is absent."""
        if (why := self.load_failures.get(model_ref)) is not None:
            raise WorkerError("model_load_failed", f"model {model_ref!r} failed to load: {why}")

    def do_ping(self, msg: Ping, progress: Progress) -> Pong:
        return Pong(req_id=msg.req_id, rss_mb=round(rss_mb(), 1), models_loaded=sorted(self.models))

    def do_unload(self, msg: Unload, progress: Progress) -> Unloaded:
        self.packed.drop(msg.model_ref)
        self.load_failures.pop(msg.model_ref, None)
        if self.models.pop(msg.model_ref, None) is None:
            raise WorkerError("model_not_loaded", f"model {msg.model_ref!r} is not loaded")
        return Unloaded(req_id=msg.req_id)

    def do_load(self, msg: Load, progress: Progress) -> Loaded:
        model_ref = msg.model_ref or Path(msg.artifact_path).stem
        try:
            loaded = self._load_artifact(msg, progress)
        except WorkerError as exc:
            self.load_failures[model_ref] = str(exc)
            raise
        self.load_failures.pop(model_ref, None)
        return loaded

    def _load_artifact(self, msg: Load, progress: Progress) -> Loaded:
        t0 = time.perf_counter()
        path = Path(msg.artifact_path)
        if not path.is_file():
            raise WorkerError("artifact_invalid", f"artifact {path} does not exist")
        expected = msg.artifact_digest.lower()
        # hashed on its own thread (hashlib drops the GIL) while tinygrad imports and a cached model restores
        with ThreadPoolExecutor(1, thread_name_prefix="artifact-sha256") as pool:
            hashing = pool.submit(sha256_file, path)

            def verify() -> None:
                if (digest := hashing.result()) != expected:
                    raise WorkerError("artifact_invalid",
                                             f"sha256 of {path} is {digest}, expected {msg.artifact_digest}")

            try:
                model = self._load(msg, path, expected, verify, progress)
            except WorkerError as exc:
                if exc.code != "artifact_invalid":
                    verify()  # a wrong artifact is reported as such, whatever else failed
                raise
        model_ref = msg.model_ref or path.stem
        self.models[model_ref] = model
        return Loaded(req_id=msg.req_id, model_ref=model_ref, dims=model.dims,
                      cold_load_ms=round((time.perf_counter() - t0) * 1000.0, 1))

    def _load(self, msg: Load, path: Path, digest: str, verify: Callable[[], None], progress: Progress) -> Any:
        """Loaded and warmed under LOAD's window, not the first request's (or restored warm from the JIT cache)."""
        progress(1, "setup")
        cfg = load_config(EMBEDDING, msg.runtime_config)
        kind = KINDS[cfg.kind]
        if msg.format not in kind.formats:
            raise WorkerError("config_invalid", f"unsupported format/kind {msg.format!r}/{cfg.kind!r}")
        impl, detokenizer = kind.load()(cfg, path, digest, verify, lambda k: progress(1 + k, "setup"))
        return _Served(impl, cfg, detokenizer)

    def do_embed_batch(self, msg: EmbedBatch, progress: Progress) -> Vectors:
        m = self.model(msg)
        rows = split_rows(msg.raw, [it["n_tokens"] for it in msg.items])
        try:
            out = m.impl.embed(rows, msg.pooling, msg.normalize, lambda n: progress(n, "inference"))
        except ValueError as exc:
            raise WorkerError("invalid_request", str(exc)) from exc
        out = np.ascontiguousarray(out, dtype="<f4")
        return Vectors(req_id=msg.req_id, dims=int(out.shape[1]) if out.ndim == 2 else m.dims, n=len(rows),
                       raw=out.tobytes())

    def do_rerank(self, msg: Rerank, progress: Progress) -> Scores:
        """A cross-encoder scores composed pairs; an embedding model scores by bi-encoder cosine (labelled)."""
        m = self.models.get(msg.model_ref)
        if m is None:
            self.refuse_failed(msg.model_ref)
        if m is None or Rerank not in KINDS[m.kind].requests:
            raise WorkerError("model_not_loaded", f"no rerank or embedding model {msg.model_ref!r} loaded")
        q, *docs = split_rows(msg.raw, [msg.query_n_tokens] + [c["n_tokens"] for c in msg.candidates],
                             allow_empty=True)
        done = lambda n: progress(n, "inference")  # noqa: E731
        try:
            if m.kind == RERANK:
                pairs, types = compose_pairs(q, docs, m.cls_id, m.sep_id, m.max_tokens, m.roberta)
                scores, method = m.impl.score(pairs, types, done), "cross_encoder"
            else:
                wrap = lambda r: np.concatenate([[m.cls_id], r[: m.max_tokens - 2], [m.sep_id]]).astype(np.int32)  # noqa: E731
                vecs = m.impl.embed([wrap(q)] + [wrap(d) for d in docs], "mean", True, done)
                scores, method = vecs[1:] @ vecs[0], "bi_encoder_cosine"
        except ValueError as exc:
            raise WorkerError("invalid_request", str(exc)) from exc
        return Scores(req_id=msg.req_id, n=len(docs), method=method, raw=np.asarray(scores, dtype="<f4").tobytes())

    def do_generate(self, msg: Generate, progress: Progress) -> Text:
        m = self.model(msg)
        if msg.grammar:
            raise WorkerError("grammar_unsupported", "this worker does not constrain decoding by grammar")
        try:
            return generate(m, msg, progress, self.post)
        except ValueError as exc:
            raise WorkerError("invalid_request", str(exc)) from exc

    def do_generate_packed(self, msg: GeneratePacked, progress: Progress) -> Texts:
        m = self.model(msg)
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
