"""The Supervisor's serving API: embed, rerank, generate, tokenize.

Every request is checked (`_requests`), admitted against its model's byte budget before any tokenization, has
its CPU work (tokenization, chat templates) run in a bounded thread pool, never on the loop, and is split into
frames that fit `max_frame`. Long work is split into micro-batches of at most `max_batch_items` rows, sent one
after the other from the caller's task: a caller that leaves (deadline, disconnect) stops the rest, and the
lane drains only the micro-batch in flight.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import trio

from .._config import ModelConfig, SupervisorConfig
from .._errors import DeadlineExceeded, InvalidRequest, ModelNotFound, RemoteProtocolError
from . import _requests as rq

if TYPE_CHECKING:
    from ..tokenization import EmbeddingTokenizer
    from ._admission import Scheduler, Ticket
    from ._batching import Batcher
    from ._dispatch import EmbedDispatch
    from ._lane import Lane

T = TypeVar("T")
# Tokenization and template threads at once, whatever the number of requests: half the CPUs, so the event
# loop always has a core (tokenizers' encode_batch fans out on its own pool besides).
CPU_THREADS = max(1, min(4, (os.cpu_count() or 2) // 2))


class ServingApi:
    config: SupervisorConfig
    scheduler: Scheduler | None  # admission byte budgets (the daemon's; the bare Python API runs without)
    batcher: Batcher
    dispatch: EmbedDispatch
    _tokenizers: dict[str, Any]
    _cpu: trio.CapacityLimiter  # CPU_THREADS tokens
    pick_lane: Callable[[str], Lane]  # the Supervisor's

    async def _off_loop(self, fn: Callable[[], T]) -> T:
        """Tokenization never runs on the loop, however small: `tokenizers` shares one rayon pool, so even a
        3-word encode_batch on the loop waits there for a large one that a thread is running."""
        return await trio.to_thread.run_sync(fn, limiter=self._cpu)

    def _admit(self, model: str, nbytes: int) -> AbstractContextManager[Ticket | None]:
        return self.scheduler.admit(model, nbytes) if self.scheduler is not None else nullcontext()

    @staticmethod
    def _deadline(timeout: float | None) -> float:
        if timeout is not None and (not isinstance(timeout, int | float) or isinstance(timeout, bool)
                                    or math.isnan(timeout) or timeout < 0):
            raise InvalidRequest(f"timeout must be a number of seconds >= 0, got {timeout!r}")
        return math.inf if timeout is None else trio.current_time() + timeout

    @staticmethod
    def _left(deadline: float, what: str, timeout: float | None) -> float | None:
        if math.isinf(deadline):
            return None
        left = deadline - trio.current_time()
        if left <= 0:
            raise DeadlineExceeded(f"{what} did not finish within {timeout:g} s")
        return left

    # --- tokenization --------------------------------------------------------------------------

    @staticmethod
    def _load_tokenizer(m: ModelConfig) -> EmbeddingTokenizer:
        from ..tokenization import EmbeddingTokenizer

        path = m.tokenizer_path or m.path.with_name("tokenizer.json")
        return EmbeddingTokenizer.from_file(path, m.max_tokens)

    def _tokenizer(self, model: str) -> EmbeddingTokenizer:
        tok = self._tokenizers.get(model)
        if tok is None:
            mc = self.config.model(model)
            if mc.kind not in ("embedding", "rerank"):
                raise ModelNotFound(f"{model!r} is not an encoder model")
            tok = self._tokenizers[model] = self._load_tokenizer(mc)
        return tok

    def tokenize(self, texts: list[str], *, model: str) -> list[np.ndarray]:
        mc = self.config.model(model)
        texts = rq.cap_texts(rq.check_texts(texts, "texts"), rq.char_cap(mc))
        rq.check_unicode(texts, "texts")
        return self._tokenizer(model).encode(texts)

    async def tokenize_async(self, texts: list[str], *, model: str) -> list[np.ndarray]:
        """Tokenize, off the event loop when the batch is large enough to stall it."""
        texts = rq.check_texts(texts, "texts")
        cap = rq.char_cap(self.config.model(model))
        await self._tokenizer_loaded(model)
        return await self._off_loop(lambda: self.tokenize(rq.cap_texts(texts, cap), model=model))

    async def _tokenizer_loaded(self, model: str) -> None:
        """Reading tokenizer.json takes long enough to stall the loop: the first use loads it in a thread."""
        if model not in self._tokenizers:
            await trio.to_thread.run_sync(self._tokenizer, model, limiter=self._cpu)

    def chat_tokenizer(self, model: str) -> Any:
        tok = self._tokenizers.get(model)
        if tok is None:
            from ..llm_tokenizer import ChatTokenizer

            tok = self._tokenizers[model] = ChatTokenizer.from_gguf(self.config.model(model).path)
        return tok

    # --- embeddings ----------------------------------------------------------------------------

    async def embed(self, texts: list[str], *, model: str, timeout: float | None = None,
                    pooling: str | None = None, normalize: bool | None = None) -> np.ndarray:
        """Embeddings of `texts` as an (n, dims) float32 array, in input order."""
        vecs, _ = await self.embed_counted(texts, model=model, timeout=timeout, pooling=pooling, normalize=normalize)
        return vecs

    async def embed_counted(self, texts: list[str], *, model: str, timeout: float | None = None,
                            pooling: str | None = None, normalize: bool | None = None) -> tuple[np.ndarray, int]:
        """`embed`, and the number of tokens the inputs took (usage)."""
        mc = rq.encoder_model(self.config.model(model), ("embedding",), "embeddings")
        texts = rq.check_texts(texts, "texts")
        pooling, normalize = rq.check_pooling(pooling, mc), rq.check_normalize(normalize, mc)
        deadline = self._deadline(timeout)
        if not texts:
            return np.zeros((0, self.dispatch.dims.get(model, 0)), dtype=np.float32), 0
        texts = rq.cap_texts(texts, rq.char_cap(mc))
        with self._admit(model, rq.id_bytes_bound(texts, mc.max_tokens)) as ticket:
            await self._tokenizer_loaded(model)
            rows = await self._off_loop(lambda: self.tokenize(texts, model=model))
            vecs = await self._embed_admitted(rows, model, pooling, normalize, deadline, timeout, ticket)
        return vecs, sum(len(r) for r in rows)

    async def embed_rows(self, rows: list[np.ndarray], *, model: str, pooling: str, normalize: bool,
                         timeout: float | None = None) -> np.ndarray:
        """Token-id rows -> embeddings, admitted against the model's queue budget (with the daemon's
        `scheduler`), batched with concurrent requests (with its `batcher`), in frames that fit."""
        mc = rq.encoder_model(self.config.model(model), ("embedding",), "embeddings")
        rows = rq.check_rows(rows)
        pooling, normalize = rq.check_pooling(pooling, mc), rq.check_normalize(normalize, mc)
        deadline = self._deadline(timeout)
        if not rows:
            return np.zeros((0, self.dispatch.dims.get(model, 0)), dtype=np.float32)
        with self._admit(model, rq.ID_BYTES * sum(len(r) for r in rows)) as ticket:
            return await self._embed_admitted(rows, model, pooling, normalize, deadline, timeout, ticket)

    async def _embed_admitted(self, rows: list[np.ndarray], model: str, pooling: str, normalize: bool,
                              deadline: float, timeout: float | None, ticket: Ticket | None) -> np.ndarray:
        chunks = rq.plan_chunks([len(r) for r in rows], max_items=self.config.max_batch_items,
                                max_bytes=self.config.max_frame)
        batcher = self.batcher
        if batcher.enabled and len(chunks) == 1:
            # batches hold at most max_batch_items rows, which config validation guarantees fit a frame
            return await batcher.embed(rows, model=model, pooling=pooling, normalize=normalize,
                                       timeout=self._left(deadline, "embedding request", timeout),
                                       on_settled=ticket.job if ticket else None)
        parts = []
        for a, b in chunks:  # one micro-batch at a time: a caller that leaves stops the rest
            left = self._left(deadline, f"embedding request on {model!r}", timeout)
            # rows were checked above and each chunk was planned to fit a frame: straight to the lane
            parts.append(await self.dispatch(rows[a:b], model=model, pooling=pooling, normalize=normalize,
                                             timeout=left, on_settled=ticket.job() if ticket else None))
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    async def embed_ids(self, rows: list[np.ndarray], *, model: str, pooling: str, normalize: bool,
                        timeout: float | None = None, on_settled: Callable[[], None] | None = None) -> np.ndarray:
        """One EMBED_BATCH: at most max_batch_items rows whose ids fit one frame (else RequestTooLarge)."""
        try:
            mc = rq.encoder_model(self.config.model(model), ("embedding",), "embeddings")
            rows = rq.check_rows(rows)
            pooling, normalize = rq.check_pooling(pooling, mc), rq.check_normalize(normalize, mc)
            if len(rq.plan_chunks([len(r) for r in rows], max_items=max(len(rows), 1),
                                  max_bytes=self.config.max_frame)) > 1:
                raise rq.RequestTooLarge(f"{len(rows)} rows of token ids do not fit one frame of "
                                         f"{self.config.max_frame} bytes (daemon.max_frame_mib)")
        except BaseException:
            if on_settled is not None:
                on_settled()
            raise
        return await self.dispatch(rows, model=model, pooling=pooling, normalize=normalize, timeout=timeout,
                                   on_settled=on_settled)

    # --- rerank --------------------------------------------------------------------------------

    async def rerank(self, query: str, documents: list[str], *, model: str,
                     timeout: float | None = None) -> tuple[np.ndarray, str]:
        """Relevance of each document to `query`, in input order, and the method used: `cross_encoder` for a
        rerank model, `bi_encoder_cosine` when `model` is an embedding model. Sent as RERANK requests of at
        most max_batch_items documents that fit a frame each."""
        mc = rq.encoder_model(self.config.model(model), ("rerank", "embedding"), "rerank")
        if not isinstance(query, str):
            raise InvalidRequest("query must be a string")
        docs = rq.check_texts(documents, "documents")
        deadline = self._deadline(timeout)
        if not docs:
            return np.zeros(0, dtype=np.float32), "none"
        texts = rq.cap_texts([query, *docs], rq.char_cap(mc))
        with self._admit(model, rq.id_bytes_bound(texts, mc.max_tokens)) as ticket:
            await self._tokenizer_loaded(model)
            q, *ids = await self._off_loop(lambda: self._encode_plain(model, mc, texts))
            chunks = rq.plan_chunks([len(d) for d in ids], max_items=self.config.max_batch_items,
                                    max_bytes=self.config.max_frame, fixed=len(q), what="documents")
            scores, method = [], "cross_encoder"
            for a, b in chunks:
                left = self._left(deadline, f"rerank on {model!r}", timeout)
                part, method = await self._rerank_ids(q, ids[a:b], model, left, ticket)
                scores.append(part)
        return np.concatenate(scores), method

    def _encode_plain(self, model: str, mc: ModelConfig, texts: list[str]) -> list[np.ndarray]:
        rq.check_unicode(texts, "query and documents")
        return [ids[: mc.max_tokens] for ids in self._tokenizer(model).encode_plain(texts)]

    async def _rerank_ids(self, q: np.ndarray, docs: list[np.ndarray], model: str, timeout: float | None,
                          ticket: Ticket | None) -> tuple[np.ndarray, str]:
        lane = self.pick_lane(model)
        raw = np.concatenate([q, *docs]).astype("<i4").tobytes()
        reply = await lane.call("RERANK", {"model_ref": model, "query_n_tokens": len(q),
                                           "candidates": [{"n_tokens": len(d)} for d in docs]}, raw,
                                timeout=timeout, on_settled=ticket.job() if ticket else None)
        if reply["n"] != len(docs) or len(reply.raw or b"") != 4 * len(docs):
            raise RemoteProtocolError(
                f"SCORES: n={reply['n']} raw_len={len(reply.raw or b'')} for {len(docs)} documents")
        return np.frombuffer(reply.raw, dtype="<f4").copy(), reply.get("method", "cross_encoder")

    # --- generation ----------------------------------------------------------------------------

    async def generate(self, prompt: str | None = None, *, model: str, messages: list[dict[str, str]] | None = None,
                       max_tokens: int = 16, grammar: str | None = None,
                       timeout: float | None = None) -> dict[str, Any]:
        """Greedy completion of `prompt`, or of `messages` through the model's chat template (daemon-side)."""
        mc = self.config.model(model)
        if mc.kind != "generate":
            raise InvalidRequest(f"model {model!r} serves {mc.kind}, not generation")
        max_tokens = rq.check_max_tokens(max_tokens)
        if grammar is not None and not isinstance(grammar, str):
            raise InvalidRequest("grammar must be a string")
        if (prompt is None) == (messages is None):
            raise InvalidRequest("give exactly one of prompt or messages")
        if messages is not None:
            messages = rq.check_messages(messages)
            texts = [m["content"] for m in messages] + [m["role"] for m in messages]
            extra = rq.CHAT_TEMPLATE_BYTES * len(messages)
        else:
            if not isinstance(prompt, str) or not prompt:
                raise InvalidRequest("prompt must be a non-empty string")
            texts, extra = [prompt], 0
        cap, n_chars = rq.gen_char_cap(mc), sum(map(len, texts))
        if n_chars > cap:
            raise rq.RequestTooLarge(f"the prompt has {n_chars} characters; model {model!r} takes at most {cap}")
        rq.check_unicode(texts, "messages" if messages is not None else "prompt")
        deadline = self._deadline(timeout)
        with self._admit(model, rq.id_bytes_bound(texts) + rq.ID_BYTES * extra) as ticket:
            tok = await trio.to_thread.run_sync(self.chat_tokenizer, model, limiter=self._cpu)

            def encode() -> np.ndarray:
                text = prompt if messages is None else tok.apply_chat_template(messages, add_generation_prompt=True)
                return np.asarray(tok.encode(text), dtype="<i4")

            ids = await self._off_loop(encode)
            fields: dict[str, Any] = {"model_ref": model, "max_tokens": max_tokens}
            if grammar:
                fields["grammar"] = grammar
            lane, left = self.pick_lane(model), self._left(deadline, f"generate on {model!r}", timeout)
            reply = await lane.call("GENERATE", fields, ids.tobytes(), timeout=left,
                                    on_settled=ticket.job() if ticket else None)
        return {"text": reply["text"], "n_prompt": reply["n_prompt"], "n_gen": reply["n_gen"],
                "finish_reason": reply["finish_reason"]}
