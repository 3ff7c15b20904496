"""The Engine base class (docs/engines.md): five methods a subclass overrides, and the table that turns each
protocol-v3 request into a call of one of them and its result into the reply."""

from __future__ import annotations

import functools
import inspect
import os
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from .._digest import sha256_file
from .._errors import WorkerError
from .._proto import (
    EXT_CANCEL,
    EXT_GRAMMAR,
    EXT_LONG,
    EXT_POOLING,
    EXT_SAMPLING,
    EXT_STREAM,
    V3_MAX_GEN_TOKENS,
    EmbedBatch,
    Generate,
    Load,
    Loaded,
    Ping,
    Pong,
    Rerank,
    Scores,
    Text,
    Unload,
    Unloaded,
    Vectors,
    WireMessage,
)
from .._token_ids import prompt_ids, split_rows
from ._api import (
    Context,
    EmbedRequest,
    GenerateRequest,
    Generation,
    LoadRequest,
    Ranking,
    Reporter,
    RerankRequest,
    UnloadRequest,
)

Handler = Callable[[Any, Reporter], WireMessage]  # a request's class -> its reply (a class too)
_PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_mb() -> float:
    """The current resident set (not the peak, which never goes down), from /proc/self/statm."""
    with open("/proc/self/statm", "rb") as f:
        return int(f.read().split()[1]) * _PAGE / (1 << 20)


class _Verifier:
    """LoadRequest.verify: the artifact's sha256, hashed on its own thread (hashlib drops the GIL), checked once."""

    def __init__(self, hashing: Future[str], path: Path, expected: str) -> None:
        self.hashing, self.path, self.expected = hashing, path, expected
        self.checked = False

    def __call__(self) -> None:
        if self.checked:
            return
        if (digest := self.hashing.result()) != self.expected.lower():
            raise WorkerError("artifact_invalid", f"sha256 of {self.path} is {digest}, expected {self.expected}")
        self.checked = True


class Engine:
    """An inference engine served over protocol v3 (docs/engines.md). Override the methods for the requests it
    serves: `embed`, `rerank`, `generate` (a plain method, or a generator that yields text), and `load` / `unload`
    for models that hold something. Each runs on the server's one compute thread, one request at a time, and gets
    the request and a Context. Raise WorkerError(code, message) for an ERR of that code, ValueError for a request
    the model cannot serve (ERR invalid_request)."""

    name: ClassVar[str] = "engine"  # HELLO's engine.engine
    version: ClassVar[str] = "0"  # HELLO's engine.version
    sampling: ClassVar[bool] = False  # `generate` honours temperature, top_p, top_k, seed, stop and logprobs
    grammars: ClassVar[bool] = False  # `generate` constrains its tokens by `grammar` (the GRAMMAR extension)
    max_new_tokens: ClassVar[int] = V3_MAX_GEN_TOKENS  # the most tokens `generate` makes per request
    # the EMBED_BATCH poolings `embed` serves: protocol v3's mean and cls, or also max and lasttoken
    poolings: ClassVar[tuple[str, ...]] = ("mean", "cls")

    # --- the five methods ------------------------------------------------------------------------

    def load(self, request: LoadRequest, ctx: Context) -> Any:
        """Make `request.artifact_path` servable; return the model (any object) the other methods receive. The
        default keeps nothing: the model is None."""
        return None

    def embed(self, request: EmbedRequest, ctx: Context) -> np.ndarray:
        """An (items x dims) float array, row i for `request.token_ids[i]`."""
        raise WorkerError("unsupported_request", f"{type(self).__name__} does not embed")

    def rerank(self, request: RerankRequest, ctx: Context) -> Ranking | np.ndarray | list[float]:
        """One score per candidate (bare, or a Ranking that names its method)."""
        raise WorkerError("unsupported_request", f"{type(self).__name__} does not rerank")

    def generate(self, request: GenerateRequest, ctx: Context) -> Generation | str | Iterator[str]:
        """The generated text: a Generation (or a str), or, written as a generator, each token's text in turn
        (streamed to a caller that asked; it may `return` a Generation at its end)."""
        raise WorkerError("unsupported_request", f"{type(self).__name__} does not generate")

    def unload(self, request: UnloadRequest, ctx: Context) -> None:
        """Release `request.model`; the default has nothing to release."""

    # --- what the server asks ----------------------------------------------------------------------

    def extensions(self) -> frozenset[str]:
        """The protocol extensions HELLO advertises, from what the class implements: cancellation with any
        `generate`, streaming with a generator `generate`, sampling, long generation and the poolings beyond mean
        and cls as the class says."""
        found: set[str] = set()
        if type(self).embed is not Engine.embed and {"max", "lasttoken"} & set(self.poolings):
            found.add(EXT_POOLING)
        generate = type(self).generate
        if generate is not Engine.generate:
            found.add(EXT_CANCEL)
            if inspect.isgeneratorfunction(generate):
                found.add(EXT_STREAM)
            if self.sampling:
                found.add(EXT_SAMPLING)
            if self.grammars:
                found.add(EXT_GRAMMAR)
            if self.max_new_tokens > V3_MAX_GEN_TOKENS:
                found.add(EXT_LONG)
        return frozenset(found)

    @functools.cached_property
    def models(self) -> dict[str, Any]:
        """The loaded models by model_ref: what `load` returned."""
        return {}

    @functools.cached_property
    def load_failures(self) -> dict[str, str]:
        """model_ref -> why its last LOAD failed ("code: message"); a request for it says so (model_load_failed)."""
        return {}

    @functools.cached_property
    def handlers(self) -> dict[type[WireMessage], Handler]:
        """Every request this engine serves, by message class: LOAD, UNLOAD and PING always, the others when
        their method is overridden. A subclass that serves more messages adds rows."""
        table: dict[type[WireMessage], Handler] = {Load: self._serve_load, Unload: self._serve_unload,
                                                   Ping: self._serve_ping}
        for cls, method, handler in ((EmbedBatch, "embed", self._serve_embed),
                                     (Rerank, "rerank", self._serve_rerank),
                                     (Generate, "generate", self._serve_generate)):
            if getattr(type(self), method) is not getattr(Engine, method):
                table[cls] = handler
        return table

    def handle(self, msg: WireMessage, report: Reporter) -> WireMessage:
        """One request's reply (on the compute thread); ERR unsupported_request for one nobody serves."""
        handler = self.handlers.get(type(msg))
        if handler is None:
            raise WorkerError("unsupported_request", f"this worker does not serve {msg.T}")
        return handler(msg, report)

    def model(self, model_ref: str) -> Any:
        """The loaded model `model_ref`: ERR model_load_failed when its LOAD failed, model_not_loaded when absent."""
        if model_ref not in self.models:
            if (why := self.load_failures.get(model_ref)) is not None:
                raise WorkerError("model_load_failed", f"model {model_ref!r} failed to load: {why}")
            raise WorkerError("model_not_loaded", f"model {model_ref!r} is not loaded in this worker")
        return self.models[model_ref]

    # --- requests to calls, results to replies -------------------------------------------------------

    def _serve_ping(self, msg: Ping, report: Reporter) -> Pong:
        return Pong(req_id=msg.req_id, rss_mb=round(rss_mb(), 1), models_loaded=sorted(self.models))

    def _serve_load(self, msg: Load, report: Reporter) -> Loaded:
        t0 = time.perf_counter()
        model_ref = msg.model_ref or Path(msg.artifact_path).stem
        try:
            model = self._load_verified(msg, model_ref, Context(msg.req_id, report, "setup"))
        except WorkerError as exc:
            self.load_failures[model_ref] = str(exc)
            raise
        self.load_failures.pop(model_ref, None)
        self.models[model_ref] = model
        return Loaded(req_id=msg.req_id, model_ref=model_ref, dims=int(getattr(model, "dims", 0) or 0),
                      cold_load_ms=round((time.perf_counter() - t0) * 1000.0, 1))

    def _load_verified(self, msg: Load, model_ref: str, ctx: Context) -> Any:
        path = Path(msg.artifact_path)
        if not path.is_file():
            raise WorkerError("artifact_invalid", f"artifact {path} does not exist")
        with ThreadPoolExecutor(1, thread_name_prefix="artifact-sha256") as pool:
            verify = _Verifier(pool.submit(sha256_file, path), path, msg.artifact_digest)
            request = LoadRequest(model_ref, path, msg.artifact_digest.lower(), msg.format, msg.runtime_config,
                                  verify)
            try:
                model = self.load(request, ctx)
            except WorkerError as exc:
                if exc.code != "artifact_invalid":
                    verify()  # a wrong artifact is reported as such, whatever else failed
                raise
            verify()
        return model

    def _serve_unload(self, msg: Unload, report: Reporter) -> Unloaded:
        self.load_failures.pop(msg.model_ref, None)
        if msg.model_ref not in self.models:
            raise WorkerError("model_not_loaded", f"model {msg.model_ref!r} is not loaded")
        model = self.models.pop(msg.model_ref)
        self.unload(UnloadRequest(msg.model_ref, model), Context(msg.req_id, report, "control"))
        return Unloaded(req_id=msg.req_id)

    def _serve_embed(self, msg: EmbedBatch, report: Reporter) -> Vectors:
        model = self.model(msg.model_ref)
        rows = split_rows(msg.raw, [it["n_tokens"] for it in msg.items])
        request = EmbedRequest(msg.model_ref, model, rows, msg.pooling, msg.normalize)
        out = np.ascontiguousarray(_served(self.embed, request, Context(msg.req_id, report)), dtype="<f4")
        dims = int(out.shape[1]) if out.ndim == 2 else int(getattr(model, "dims", 0) or 0)
        return Vectors(req_id=msg.req_id, dims=dims, n=len(rows), raw=out.tobytes())

    def _serve_rerank(self, msg: Rerank, report: Reporter) -> Scores:
        model = self.model(msg.model_ref)
        lengths = [msg.query_n_tokens] + [c["n_tokens"] for c in msg.candidates]
        query, *docs = split_rows(msg.raw, lengths, allow_empty=True)
        out = _served(self.rerank, RerankRequest(msg.model_ref, model, query, docs), Context(msg.req_id, report))
        ranking = out if isinstance(out, Ranking) else Ranking(out)
        return Scores(req_id=msg.req_id, n=len(docs), method=ranking.method,
                      raw=np.asarray(ranking.scores, dtype="<f4").tobytes())

    def _serve_generate(self, msg: Generate, report: Reporter) -> Text:
        model = self.model(msg.model_ref)
        if msg.grammar and EXT_GRAMMAR not in self.extensions():
            raise WorkerError("grammar_unsupported", "this worker does not constrain decoding by grammar")
        request = GenerateRequest(msg.model_ref, model, prompt_ids(msg.raw), msg.max_tokens, bool(msg.stream),
                                  msg.temperature, msg.top_p, msg.top_k, msg.seed,
                                  None if msg.stop is None else list(msg.stop), msg.logprobs, msg.prompt_logprobs,
                                  msg.grammar or None)
        ctx = Context(msg.req_id, report)
        out = _served(self._generation, request, ctx)
        ids = np.asarray(out.token_ids, dtype="<i4")
        return Text(req_id=msg.req_id, text=out.text, n_prompt=len(request.prompt),
                    n_gen=len(ids) if out.n_gen is None else out.n_gen, finish_reason=out.finish_reason,
                    logprobs=out.logprobs, prompt_logprobs=out.prompt_logprobs, raw=ids.tobytes())

    def _generation(self, request: GenerateRequest, ctx: Context) -> Generation:
        out = self.generate(request, ctx)
        if isinstance(out, Generation):
            return out
        if isinstance(out, str):
            return Generation(out)
        return _streamed(out, request, ctx)


def _served(method: Callable[[Any, Context], Any], request: Any, ctx: Context) -> Any:
    """An engine method's result; a ValueError (a request the model cannot serve) is ERR invalid_request."""
    try:
        return method(request, ctx)
    except ValueError as exc:
        raise WorkerError("invalid_request", str(exc)) from exc


def _streamed(pieces: Iterator[str], request: GenerateRequest, ctx: Context) -> Generation:
    """A generator `generate`: each piece is one token's text, a TEXT_DELTA when the caller streams and PROGRESS
    when not; it is stopped at max_tokens. Its own Generation, if it returns one, is the reply."""
    text: list[str] = []
    try:
        while len(text) < request.max_tokens:
            try:
                piece = next(pieces)
            except StopIteration as end:
                if isinstance(end.value, Generation):
                    return end.value
                break
            text.append(piece)
            if request.stream:
                ctx.delta(piece)
            else:
                ctx.progress()
    finally:
        close = getattr(pieces, "close", None)
        if close is not None:
            close()
    finish = "length" if len(text) >= request.max_tokens else "stop"
    return Generation("".join(text), finish_reason=finish, n_gen=len(text))


__all__ = ["Engine", "Handler", "rss_mb"]
