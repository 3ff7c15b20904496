"""The Supervisor's serving API: embed, rerank, generate, tokenize.

Every request is checked (`_requests`), admitted against its model's byte budget before any tokenization, has
its CPU work (tokenization, chat templates) run in a bounded thread pool, never on the loop, and is split into
frames that fit `max_frame`. Long work is split into micro-batches of at most `max_batch_items` rows, sent one
after the other from the caller's task: a caller that leaves (deadline, disconnect) stops the rest, and the
lane drains only the micro-batch in flight.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import trio

from .._config import ModelConfig, SupervisorConfig
from .._errors import InvalidRequest, ModelNotFound
from .._kinds import GENERATE, RERANK
from .._proto import EmbedBatch, Rerank, Vectors
from . import _generate
from . import _requests as rq
from ._generate import OnDelta
from ._route import EMBEDDINGS, RERANKING, Flight, Q, R, Route, serving_model

if TYPE_CHECKING:
    from ..tokenization import EmbeddingTokenizer
    from ._admission import Scheduler
    from ._batching import Batcher
    from ._dispatch import EmbedDispatch
    from ._gate import ModelGate
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
    gate: ModelGate  # orders each model's requests around a change of its settings

    async def _off_loop(self, fn: Callable[[], T]) -> T:
        """Tokenization never runs on the loop, however small: `tokenizers` shares one rayon pool, so even a
        3-word encode_batch on the loop waits there for a large one that a thread is running."""
        return await trio.to_thread.run_sync(fn, limiter=self._cpu)

    def _flight(self, route: Route[Q, R], model: str) -> Flight[Q, R]:
        """One request of `route`'s kind on `model`: the model is looked up and its kind checked here."""
        return Flight(route, self.config, self.scheduler, self.pick_lane, model, self.gate)

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
            if not mc.encoder:
                raise ModelNotFound(f"{model!r} is not an encoder model")
            tok = self._tokenizers[model] = self._load_tokenizer(mc)
        return tok

    def tokenize(self, texts: list[str], *, model: str) -> list[np.ndarray]:
        """`texts` as embedding model `model`'s token ids, one int32 array each (on the calling thread)."""
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
        """Decoder model `model`'s tokenizer with its chat template, loaded once."""
        tok = self._tokenizers.get(model)
        if tok is None:
            from ..llm_tokenizer import ChatTokenizer

            tok = self._tokenizers[model] = ChatTokenizer.from_gguf(self.config.model(model).path)
        return tok

    async def tokenize_text(self, prompt: str | None = None, *, model: str,
                            messages: list[dict[str, str]] | None = None, add_special_tokens: bool = True,
                            add_generation_prompt: bool = True) -> tuple[list[int], int]:
        """The token ids the model would be sent for `prompt` (or, for a generate model, for `messages` through
        its chat template), untruncated, and the most it takes (max_tokens, or the generate model's context).
        `add_special_tokens`: an encoder's [CLS]/[SEP], a generate model's BOS where its GGUF asks for one."""
        mc = self.config.model(model)
        add_special = rq.check_flag(add_special_tokens, "add_special_tokens", True)
        add_prompt = rq.check_flag(add_generation_prompt, "add_generation_prompt", True)
        if (prompt is None) == (messages is None):
            raise InvalidRequest("give exactly one of prompt or messages")
        if messages is not None:
            if mc.kind != GENERATE:
                raise InvalidRequest(f"model {model!r} serves {mc.kind}: messages need a chat template")
            messages = rq.check_messages(messages)
            texts = [m["content"] for m in messages] + [m["role"] for m in messages]
        else:
            texts = rq.check_texts([prompt], "prompt")
        what = "prompt" if messages is None else "messages"
        cap = rq.char_cap(mc) if mc.encoder else rq.gen_char_cap(mc)
        rq.refuse_long_texts(["".join(texts)], [what], cap, model)
        rq.check_unicode(texts, what)
        if not mc.encoder:
            tok = await trio.to_thread.run_sync(self.chat_tokenizer, model, limiter=self._cpu)

            def encode() -> list[int]:
                text = prompt if messages is None else tok.apply_chat_template(messages, add_prompt)
                return list(tok.encode(text, add_special=add_special))

            return await self._off_loop(encode), rq.gen_context(mc)
        await self._tokenizer_loaded(model)
        ids = await self._off_loop(lambda: self._tokenizer(model).encode_full(texts, special=add_special)[0])
        return ids.tolist(), mc.max_tokens

    async def detokenize(self, ids: list[int], *, model: str) -> str:
        """The text of token ids, special tokens included."""
        mc = self.config.model(model)
        if isinstance(ids, str) or not isinstance(ids, list | tuple | np.ndarray):
            raise InvalidRequest("tokens must be a list of token ids")
        if not mc.encoder:
            chat = await trio.to_thread.run_sync(self.chat_tokenizer, model, limiter=self._cpu)
            vocab, decode = chat.tokenizer.get_vocab_size(with_added_tokens=True), chat.decode
        else:
            await self._tokenizer_loaded(model)
            tok = self._tokenizer(model)
            vocab, decode = tok.vocab_size, tok.decode

        def run() -> str:
            row = rq.check_token_rows([ids], vocab, "tokens")[0] if len(ids) else np.zeros(0, np.int32)
            return str(decode(row.tolist()))

        return await self._off_loop(run)

    # --- embeddings ----------------------------------------------------------------------------

    async def embed(self, texts: list[str], *, model: str, timeout: float | None = None,
                    pooling: str | None = None, normalize: bool | None = None) -> np.ndarray:
        """Embeddings of `texts` as an (n, dims) float32 array, in input order."""
        vecs, _ = await self.embed_counted(texts, model=model, timeout=timeout, pooling=pooling, normalize=normalize)
        return vecs

    async def embed_counted(self, texts: list[str] | list[list[int]], *, model: str, timeout: float | None = None,
                            pooling: str | None = None, normalize: bool | None = None, truncate: bool = True,
                            dimensions: int | None = None) -> tuple[np.ndarray, int]:
        """`embed`, and the number of tokens the inputs took (usage).

        `texts` may instead be token-id inputs (each a list of ints), embedded as given: no [CLS]/[SEP] is added
        (`tokenize` returns them with). Inputs longer than the model's max_tokens are cut there, or refused with
        RequestTooLarge naming the input when `truncate` is false. `dimensions` (one of the model's
        matryoshka_dims) keeps the leading dimensions of each vector, renormalized when `normalize` is on."""
        flight = self._flight(EMBEDDINGS, model)
        mc = flight.mc
        is_ids, items = rq.check_inputs(texts, "input")
        pooling, normalize = rq.check_pooling(pooling, mc), rq.check_normalize(normalize, mc)
        truncate = rq.check_flag(truncate, "truncate", True)
        dims = rq.check_dimensions(dimensions, mc)
        flight.start(timeout)
        if not items:
            return np.zeros((0, dims or self.dispatch.dims.get(model, 0)), dtype=np.float32), 0
        if is_ids:
            nbytes = rq.ID_BYTES * sum(min(len(r), mc.max_tokens) for r in items)
        else:
            if not truncate:
                rq.refuse_long_texts(items, [f"input[{i}]" for i in range(len(items))], rq.char_cap(mc), model)
            items = rq.cap_texts(items, rq.char_cap(mc))
            nbytes = rq.id_bytes_bound(items, mc.max_tokens)
        async with flight.admit(nbytes) as ticket:
            await self._tokenizer_loaded(model)
            encode = self._id_rows if is_ids else self._text_rows
            rows = await self._off_loop(lambda: encode(items, model, mc.max_tokens, truncate))
            vecs = await self._embed_admitted(rows, flight, pooling, normalize)
            n_tokens = sum(len(r) for r in rows)
            if ticket is not None:
                ticket.count_tokens(n_tokens)
        return rq.cut_dimensions(vecs, dims, normalize, model), n_tokens

    def _text_rows(self, texts: list[str], model: str, cap: int, truncate: bool) -> list[np.ndarray]:
        rq.check_unicode(texts, "input")
        tok = self._tokenizer(model)
        rows, cut = tok.encode_checked(texts)
        if cut and not truncate:
            raise rq.too_many_tokens(f"input[{cut[0]}]", len(tok.encode_full([texts[cut[0]]])[0]), cap, model)
        return rows

    def _id_rows(self, items: list[Any], model: str, cap: int, truncate: bool) -> list[np.ndarray]:
        rows = rq.check_token_rows(items, self._tokenizer(model).vocab_size, "input")
        if not truncate and (over := [i for i, r in enumerate(rows) if len(r) > cap]):
            raise rq.too_many_tokens(f"input[{over[0]}]", len(rows[over[0]]), cap, model)
        return [r[:cap] for r in rows]

    async def embed_rows(self, rows: list[np.ndarray], *, model: str, pooling: str, normalize: bool,
                         timeout: float | None = None) -> np.ndarray:
        """Token-id rows -> embeddings, admitted against the model's queue budget (with the daemon's
        `scheduler`), batched with concurrent requests (with its `batcher`), in frames that fit."""
        flight = self._flight(EMBEDDINGS, model)
        rows = rq.check_rows(rows)
        pooling, normalize = rq.check_pooling(pooling, flight.mc), rq.check_normalize(normalize, flight.mc)
        flight.start(timeout)
        if not rows:
            return np.zeros((0, self.dispatch.dims.get(model, 0)), dtype=np.float32)
        async with flight.admit(rq.ID_BYTES * sum(len(r) for r in rows)):
            return await self._embed_admitted(rows, flight, pooling, normalize)

    async def _embed_admitted(self, rows: list[np.ndarray], flight: Flight[EmbedBatch, Vectors], pooling: str,
                              normalize: bool) -> np.ndarray:
        model, ticket = flight.model, flight.ticket
        chunks = rq.plan_chunks([len(r) for r in rows], max_items=self.config.max_batch_items,
                                max_bytes=self.config.max_frame)
        batcher, timing = self.batcher, flight.timing()
        started = timing.started if timing is not None else None
        if batcher.enabled and len(chunks) == 1:
            # batches hold at most max_batch_items rows, which config validation guarantees fit a frame
            return await batcher.embed(rows, model=model, pooling=pooling, normalize=normalize,
                                       timeout=flight.left("embedding request"),
                                       on_settled=ticket.job if ticket else None, on_started=started)
        parts = []
        for a, b in chunks:  # one micro-batch at a time: a caller that leaves stops the rest
            left = flight.left(f"embedding request on {model!r}")
            # rows were checked above and each chunk was planned to fit a frame: straight to the lane
            parts.append(await self.dispatch(rows[a:b], model=model, pooling=pooling, normalize=normalize,
                                             timeout=left, on_settled=flight.settled(), on_started=started))
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    async def embed_ids(self, rows: list[np.ndarray], *, model: str, pooling: str, normalize: bool,
                        timeout: float | None = None, on_settled: Callable[[], None] | None = None) -> np.ndarray:
        """One EMBED_BATCH: at most max_batch_items rows whose ids fit one frame (else RequestTooLarge)."""
        try:
            mc = serving_model(self.config, model, EMBEDDINGS)
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
        scores, method, _ = await self.rerank_counted(query, documents, model=model, timeout=timeout)
        return scores, method

    async def rerank_counted(self, query: str, documents: list[str], *, model: str, timeout: float | None = None,
                             truncate: bool = True, max_tokens_per_doc: int | None = None,
                             ) -> tuple[np.ndarray, str, int]:
        """`rerank`, and the number of tokens of the query and documents sent (usage). Each document is cut to
        `max_tokens_per_doc` tokens when given. What does not fit the model (the pair [CLS] query [SEP] doc [SEP]
        for a cross-encoder, each text with [CLS]/[SEP] for a bi-encoder) is cut by the worker, or refused with
        RequestTooLarge naming it when `truncate` is false."""
        flight = self._flight(RERANKING, model)
        mc = flight.mc
        if not isinstance(query, str):
            raise InvalidRequest("query must be a string")
        docs = rq.check_texts(documents, "documents")
        truncate = rq.check_flag(truncate, "truncate", True)
        per_doc = rq.check_count(max_tokens_per_doc, "max_tokens_per_doc")
        flight.start(timeout)
        if not docs:
            return np.zeros(0, dtype=np.float32), "none", 0
        texts = [query, *docs]
        if not truncate:
            rq.refuse_long_texts(texts, ["query", *(f"documents[{i}]" for i in range(len(docs)))], rq.char_cap(mc),
                                 model)
        texts = rq.cap_texts(texts, rq.char_cap(mc))
        async with flight.admit(rq.id_bytes_bound(texts, mc.max_tokens)) as ticket:
            await self._tokenizer_loaded(model)
            q, *ids = await self._off_loop(lambda: self._encode_rerank(model, mc, texts, truncate, per_doc))
            chunks = rq.plan_chunks([len(d) for d in ids], max_items=self.config.max_batch_items,
                                    max_bytes=self.config.max_frame, fixed=len(q), what="documents")
            scores, method = [], "cross_encoder"
            for a, b in chunks:
                docs_ids = ids[a:b]
                reply = await flight.call(
                    Rerank(model_ref=model, query_n_tokens=len(q), candidates=[{"n_tokens": len(d)} for d in docs_ids],
                           raw=np.concatenate([q, *docs_ids]).astype("<i4").tobytes()), f"rerank on {model!r}")
                scores.append(np.frombuffer(reply.raw, dtype="<f4").copy())
                method = reply.method or "cross_encoder"
            n_tokens = len(q) + sum(len(d) for d in ids)
            if ticket is not None:
                ticket.count_tokens(n_tokens)
        return np.concatenate(scores), method, n_tokens

    def _encode_rerank(self, model: str, mc: ModelConfig, texts: list[str], truncate: bool,
                       per_doc: int | None) -> list[np.ndarray]:
        rq.check_unicode(texts, "query and documents")
        tok = self._tokenizer(model)
        ids, cut = tok.encode_checked(texts, special=False)  # each at most max_tokens
        if per_doc is not None:
            ids = [ids[0], *(d[:per_doc] for d in ids[1:])]
        if not truncate:
            # a text the tokenizer cut is longer than max_tokens: not counted (None), unless max_tokens_per_doc
            # cut it shorter since
            lengths = [len(x) if i not in cut or (i and per_doc is not None and per_doc <= mc.max_tokens) else None
                       for i, x in enumerate(ids)]
            specials = tok.pair_specials if mc.kind == RERANK else tok.single_specials
            rq.check_rerank_fit(lengths, pair=mc.kind == RERANK, specials=specials, cap=mc.max_tokens, model=model)
        return ids

    # --- generation ----------------------------------------------------------------------------

    async def generate(self, prompt: str | None = None, *, model: str, messages: list[dict[str, str]] | None = None,
                       max_tokens: int = 16, grammar: str | None = None, timeout: float | None = None,
                       temperature: float | None = None, top_p: float | None = None, top_k: int | None = None,
                       seed: int | None = None, stop: str | list[str] | None = None, logprobs: int | None = None,
                       on_delta: OnDelta | None = None) -> dict[str, Any]:
        """Completion of `prompt`, or of `messages` through the model's chat template (daemon-side): greedy at
        temperature 0 (the default), else sampled (seeded: reproducible). `stop`: up to 4 strings that end the
        text before them. `logprobs`: per generated token its log probability and that many alternatives.
        `on_delta({text, n_gen, logprobs?})` streams the text as it is generated; the deltas joined are the
        answer's text. Returns {text, n_prompt, n_gen, finish_reason[, logprobs]}."""
        return await _generate.generate(
            self, prompt, model=model, messages=messages, max_tokens=max_tokens, grammar=grammar, timeout=timeout,
            sampling=_generate.Sampling(temperature, top_p, top_k, seed, stop, logprobs), on_delta=on_delta)
