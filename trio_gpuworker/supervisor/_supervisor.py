"""The Supervisor: lanes in one nursery, model routing, tokenization, the Python API."""

from __future__ import annotations

import math
from contextlib import AsyncExitStack
from types import TracebackType
from typing import TYPE_CHECKING, Any

import numpy as np
import trio

from .._config import LaneConfig, ModelConfig, SupervisorConfig
from .._errors import (
    ClosedSupervisorError,
    InvalidRequest,
    ModelNotFound,
    NoLaneAvailable,
    RemoteProtocolError,
)
from ._arena import ArenaManager
from ._dataplane import DataPlane, arena_env
from ._events import EventBus
from ._jobs import LaneState, LoadSpec
from ._lane import Lane
from ._models import DigestCache, load_spec
from ._spawn import default_runtime_dir, workers_dir

if TYPE_CHECKING:
    from ..tokenization import EmbeddingTokenizer
    from ._admission import Scheduler
    from ._batching import Batcher

MAX_GEN_TOKENS = 64


class Supervisor:
    """`async with Supervisor(config) as sup: vecs = await sup.embed(texts, model="all-MiniLM-L6-v2")`"""

    def __init__(self, config: SupervisorConfig) -> None:
        self.config = config
        self.runtime_dir = config.runtime_dir or default_runtime_dir(None, config.state_dir)
        self.events = EventBus()
        self.lanes: dict[str, Lane] = {}
        self._tokenizers: dict[str, EmbeddingTokenizer] = {}
        self._dims: dict[str, int] = {}
        self._stack: AsyncExitStack | None = None
        self.arena: ArenaManager | None = None
        # attached by the daemon (gpuworkerd); the bare Python API runs without them
        self.scheduler: Scheduler | None = None  # admission byte budgets, drained lanes
        self.batcher: Batcher | None = None  # dynamic batching of concurrent embedding requests
        self.daemon: Any = None
        self.dataplane: DataPlane | None = None  # rings, objects and steps; None without an arena
        self._nursery: trio.Nursery | None = None
        self._closed = False

    # --- lifecycle -----------------------------------------------------------------------------

    async def __aenter__(self) -> Supervisor:
        cfg = self.config
        workers_dir(self.runtime_dir)
        cache = DigestCache(cfg.state_dir / "digests.json")
        specs = {m.id: await load_spec(m, cache) for m in cfg.models}
        self._stack = AsyncExitStack()
        if cfg.arena_bytes:
            self.arena = self._stack.enter_context(ArenaManager(cfg.arena_bytes))
        env, fds = arena_env(self.arena)
        self._nursery = await self._stack.enter_async_context(trio.open_nursery())
        try:
            for lane_cfg in cfg.lanes:
                lane = Lane(lane_cfg, cfg, self.runtime_dir, [specs[m] for m in lane_cfg.models], self.events,
                            arena_env=env, pass_fds=fds)
                self.lanes[lane.id] = lane
            if self.arena is not None:
                self.dataplane = DataPlane(self.lanes, self.arena, self.events)
            for lane in self.lanes.values():
                await self._nursery.start(lane.run)
        except BaseException as exc:
            await self._abort(exc)
            raise
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> bool | None:
        self.close()
        if exc is not None:
            await self._abort(exc)
            return None
        assert self._stack is not None
        return await self._stack.__aexit__(None, None, None)

    async def _abort(self, exc: BaseException) -> None:
        assert self._nursery is not None and self._stack is not None
        self.close()
        self._nursery.cancel_scope.cancel()  # workers are still killed and reaped: that path is shielded
        # the caller's exception propagates as itself, not wrapped in the nursery's ExceptionGroup
        await self._stack.__aexit__(None, None, None)

    def close(self) -> None:
        """Stop admitting; lanes finish what is queued and shut their workers down."""
        self._closed = True
        for lane in self.lanes.values():
            lane.close()

    @staticmethod
    def _load_tokenizer(m: ModelConfig) -> EmbeddingTokenizer:
        from ..tokenization import EmbeddingTokenizer


        path = m.tokenizer_path or m.path.with_name("tokenizer.json")
        return EmbeddingTokenizer.from_file(path, m.max_tokens)

    # --- routing -------------------------------------------------------------------------------

    def pick_lane(self, model: str) -> Lane:
        """The least loaded ready lane that serves `model`, is not quarantined and is not drained
        (`self.scheduler.drained`, when the daemon attached a scheduler)."""
        from ._admission import choose_lane

        if self._closed:
            raise ClosedSupervisorError("the supervisor is shutting down")
        self.config.model(model)
        scheduler = self.scheduler
        return choose_lane(model, self.lanes.values(), scheduler.drained if scheduler is not None else frozenset())

    def model_config(self, model: str) -> ModelConfig:
        return self.config.model(model)

    # --- API -----------------------------------------------------------------------------------

    def _tokenizer(self, model: str) -> EmbeddingTokenizer:
        tok = self._tokenizers.get(model)
        if tok is None:
            mc = self.config.model(model)
            if mc.kind not in ("embedding", "rerank"):
                raise ModelNotFound(f"{model!r} is not an encoder model")
            tok = self._tokenizers[model] = self._load_tokenizer(mc)
        return tok

    def tokenize(self, texts: list[str], *, model: str) -> list[np.ndarray]:
        return self._tokenizer(model).encode(texts)

    async def tokenize_async(self, texts: list[str], *, model: str) -> list[np.ndarray]:
        """Tokenize off the event loop when the batch is large enough to stall it."""
        if len(texts) > 64:
            return await trio.to_thread.run_sync(lambda: self.tokenize(texts, model=model))
        return self.tokenize(texts, model=model)

    async def embed(self, texts: list[str], *, model: str, timeout: float | None = None,
                    pooling: str | None = None, normalize: bool | None = None) -> np.ndarray:
        """Embeddings of `texts` as an (n, dims) float32 array, in input order."""
        mc = self.config.model(model)
        if mc.kind != "embedding":
            raise InvalidRequest(f"model {model!r} serves {mc.kind}, not embeddings")
        if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
            raise InvalidRequest("texts must be a list of strings")
        if not texts:
            return np.zeros((0, self._dims.get(model, 0)), dtype=np.float32)
        rows = await self.tokenize_async(texts, model=model)
        return await self.embed_rows(rows, model=model, timeout=timeout, pooling=pooling or mc.pooling,
                                     normalize=mc.normalize if normalize is None else normalize)

    async def embed_rows(self, rows: list[np.ndarray], *, model: str, pooling: str, normalize: bool,
                         timeout: float | None = None) -> np.ndarray:
        """Token-id rows -> embeddings, in EMBED_BATCH requests of at most max_batch_items rows.

        With the daemon's `scheduler` attached, the rows' bytes are admitted against the model's queue budget
        (OverCapacity when over it) until the vectors are back; with its `batcher` attached and enabled,
        concurrent requests share EMBED_BATCH requests."""
        from contextlib import nullcontext

        if not rows:
            return np.zeros((0, self._dims.get(model, 0)), dtype=np.float32)
        scheduler, batcher = self.scheduler, self.batcher
        nbytes = 4 * sum(len(r) for r in rows)
        with scheduler.admit(model, nbytes) if scheduler is not None else nullcontext():
            if batcher is not None and batcher.enabled:
                return await batcher.embed(rows, model=model, pooling=pooling, normalize=normalize, timeout=timeout)
            step = self.config.max_batch_items
            parts = [await self.embed_ids(rows[i:i + step], model=model, pooling=pooling, normalize=normalize,
                                          timeout=timeout) for i in range(0, len(rows), step)]
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    async def embed_ids(self, rows: list[np.ndarray], *, model: str, pooling: str, normalize: bool,
                        timeout: float | None = None) -> np.ndarray:
        lane = self.pick_lane(model)
        items = [{"id": i, "n_tokens": len(r)} for i, r in enumerate(rows)]
        raw = np.concatenate(rows).astype("<i4").tobytes()
        reply = await lane.call("EMBED_BATCH", {"model_ref": model, "pooling": pooling, "normalize": normalize,
                                                "items": items}, raw, timeout=timeout)
        n, dims = reply["n"], reply["dims"]
        if n != len(rows) or len(reply.raw or b"") != n * dims * 4:
            raise RemoteProtocolError(f"VECTORS: n={n} dims={dims} raw_len={len(reply.raw or b'')} "
                                      f"for {len(rows)} rows")
        self._dims[model] = dims
        return np.frombuffer(reply.raw, dtype="<f4").reshape(n, dims).copy()

    async def rerank(self, query: str, documents: list[str], *, model: str,
                     timeout: float | None = None) -> tuple[np.ndarray, str]:
        """Relevance of each document to `query`, in input order, and the method used: `cross_encoder` for a
        rerank model, `bi_encoder_cosine` when `model` is an embedding model."""
        mc = self.config.model(model)
        if mc.kind not in ("rerank", "embedding"):
            raise InvalidRequest(f"model {model!r} serves {mc.kind}, not rerank")
        if not isinstance(query, str) or not isinstance(documents, list) or not all(
                isinstance(d, str) for d in documents):
            raise InvalidRequest("query must be a string and documents a list of strings")
        if not documents:
            return np.zeros(0, dtype=np.float32), "none"
        tok = self._tokenizer(model)
        q, *docs = [ids[: mc.max_tokens] for ids in tok.encode_plain([query, *documents])]
        raw = np.concatenate([q, *docs]).astype("<i4").tobytes()
        lane = self.pick_lane(model)
        reply = await lane.call("RERANK", {"model_ref": model, "query_n_tokens": len(q),
                                           "candidates": [{"n_tokens": len(d)} for d in docs]}, raw, timeout=timeout)
        if reply["n"] != len(docs) or len(reply.raw or b"") != 4 * len(docs):
            raise RemoteProtocolError(
                f"SCORES: n={reply['n']} raw_len={len(reply.raw or b'')} for {len(docs)} documents")
        return np.frombuffer(reply.raw, dtype="<f4").copy(), reply.get("method", "cross_encoder")

    def chat_tokenizer(self, model: str) -> Any:
        tok = self._tokenizers.get(model)
        if tok is None:
            from ..llm_tokenizer import ChatTokenizer

            tok = self._tokenizers[model] = ChatTokenizer.from_gguf(self.config.model(model).path)
        return tok

    async def generate(self, prompt: str | None = None, *, model: str, messages: list[dict[str, str]] | None = None,
                       max_tokens: int = 16, grammar: str | None = None,
                       timeout: float | None = None) -> dict[str, Any]:
        """Greedy completion of `prompt`, or of `messages` through the model's chat template (daemon-side)."""
        mc = self.config.model(model)
        if mc.kind != "generate":
            raise InvalidRequest(f"model {model!r} serves {mc.kind}, not generation")
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or not 1 <= max_tokens <= MAX_GEN_TOKENS:
            raise InvalidRequest(f"max_tokens must be an integer in 1..{MAX_GEN_TOKENS}, got {max_tokens!r}")
        if (prompt is None) == (messages is None):
            raise InvalidRequest("give exactly one of prompt or messages")
        tok = await trio.to_thread.run_sync(self.chat_tokenizer, model)
        if messages is not None:
            if not isinstance(messages, list) or not messages or not all(
                    isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                    for m in messages):
                raise InvalidRequest("messages must be a non-empty list of {role, content} strings")
            prompt = tok.apply_chat_template(messages, add_generation_prompt=True)
        if not isinstance(prompt, str) or not prompt:
            raise InvalidRequest("prompt must be a non-empty string")
        ids = np.asarray(tok.encode(prompt), dtype="<i4")
        fields: dict[str, Any] = {"model_ref": model, "max_tokens": max_tokens}
        if grammar:
            fields["grammar"] = grammar
        reply = await self.pick_lane(model).call("GENERATE", fields, ids.tobytes(), timeout=timeout)
        return {"text": reply["text"], "n_prompt": reply["n_prompt"], "n_gen": reply["n_gen"],
                "finish_reason": reply["finish_reason"]}

    async def add_lane(self, cfg: LaneConfig, specs: list[LoadSpec]) -> Lane:
        """Start a lane that was not in the configuration at start-up (SIGHUP)."""
        if self._closed or self._nursery is None:
            raise ClosedSupervisorError("the supervisor is shutting down")
        if cfg.id in self.lanes:
            raise InvalidRequest(f"lane {cfg.id!r} exists")
        env, fds = arena_env(self.arena)
        lane = Lane(cfg, self.config, self.runtime_dir, specs, self.events, arena_env=env, pass_fds=fds)
        self.lanes[lane.id] = lane
        if self.dataplane is not None:
            lane.hooks.append(self.dataplane.on_lane_event)
        await self._nursery.start(lane.run)
        return lane

    async def remove_lane(self, lane_id: str) -> None:
        """Stop routing to a lane, let it finish what is queued, stop its worker, forget it."""
        lane = self.lanes.get(lane_id)
        if lane is None:
            raise NoLaneAvailable(f"no lane {lane_id!r}")
        if self.scheduler is not None:
            self.scheduler.drained.add(lane_id)
        lane.close()
        await lane.wait_state(LaneState.STOPPED)
        self.lanes.pop(lane_id, None)
        if self.scheduler is not None:
            self.scheduler.drained.discard(lane_id)

    def forget_tokenizer(self, model: str) -> None:
        """Drop a cached tokenizer (its model's settings changed); the next request loads it again."""
        self._tokenizers.pop(model, None)

    async def reload_lane(self, lane_id: str, timeout: float | None = None) -> None:
        """Ordered restart of one lane's worker (no strike); lifts its quarantine at once."""
        lane = self.lanes.get(lane_id)
        if lane is None:
            raise NoLaneAvailable(f"no lane {lane_id!r}")
        await lane.reload(timeout)

    def status(self) -> list[dict[str, Any]]:
        """Cached lane state; never touches a worker."""
        return [lane.status() for lane in self.lanes.values()]

    def subscribe(self) -> trio.MemoryReceiveChannel[dict[str, Any]]:
        return self.events.subscribe()

    async def wait_ready(self, timeout: float = math.inf) -> None:
        """Until every lane is ready (tests and start-up notification)."""
        with trio.fail_after(timeout):
            for lane in self.lanes.values():
                await lane.wait_state(LaneState.READY, LaneState.BUSY)
