"""The Supervisor's serving API: embed, rerank, generate, tokenize.

Every request is one typed request (_api_requests.py), checked when it is built, whether from the Python
arguments of `embed`, `rerank` and `generate` or from an HTTP body. It is admitted against its model's byte
budget before any tokenization, has its CPU work (tokenization, chat templates) run in a bounded thread pool,
never on the loop, and is split into frames that fit `max_frame`. Long work is split into micro-batches of at
most `max_batch_items` rows, sent one after the other from the caller's task: a caller that leaves (deadline,
disconnect) stops the rest, and the lane drains only the micro-batch in flight.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import _api_checks as ck
from .._api_requests import CompletionRequest, EmbeddingsRequest, RerankRequest, serving_model
from .._config import ModelConfig, SupervisorConfig
from .._errors import InvalidRequest
from .._kinds import GENERATE, RERANK
from .._proto import EmbedBatch, Vectors
from . import _completion
from . import _requests as rq
from ._completion import OnDelta
from ._route import EMBEDDINGS, GENERATION, RERANKING, Flight, Q, R, Route
from ._tokenizers import Tokenizers

if TYPE_CHECKING:
    from ..llm_tokenizer import ChatTokenizer
    from ._admission import Scheduler
    from ._batching import Batcher
    from ._dispatch import EmbedDispatch
    from ._gate import ModelGate
    from ._lane import Lane



class ServingApi:
    config: SupervisorConfig
    scheduler: Scheduler | None  # admission byte budgets (the daemon's; the bare Python API runs without)
    batcher: Batcher
    dispatch: EmbedDispatch
    tokenizers: Tokenizers  # each model's, run off the loop
    pick_lane: Callable[[str], Lane]  # the Supervisor's
    gate: ModelGate  # orders each model's requests around a change of its settings

    def _flight(self, route: Route[Q, R], mc: ModelConfig) -> Flight[Q, R]:
        """One request of `route`'s kind on `mc`, the model its request looked up and kind-checked."""
        return Flight(route, mc, self.scheduler, self.pick_lane, self.gate)

    # --- tokenization --------------------------------------------------------------------------

    def tokenize(self, texts: list[str], *, model: str) -> list[np.ndarray]:
        """`texts` as embedding model `model`'s token ids, one int32 array each (on the calling thread)."""
        mc = self.config.model(model)
        texts = rq.cap_texts(ck.check_texts(texts, "texts"), ck.char_cap(mc))
        ck.check_unicode(texts, "texts")
        return self.tokenizers.encoder(model).encode(texts)

    async def tokenize_async(self, texts: list[str], *, model: str) -> list[np.ndarray]:
        """Tokenize, off the event loop when the batch is large enough to stall it."""
        texts = ck.check_texts(texts, "texts")
        cap = ck.char_cap(self.config.model(model))
        await self.tokenizers.encoder_loaded(model)
        return await self.tokenizers.off_loop(lambda: self.tokenize(rq.cap_texts(texts, cap), model=model))

    def chat_tokenizer(self, model: str) -> ChatTokenizer:
        """A generate model's tokenizer and chat template."""
        return self.tokenizers.chat(model)

    async def tokenize_text(self, prompt: str | None = None, *, model: str,
                            messages: list[dict[str, str]] | None = None, add_special_tokens: bool = True,
                            add_generation_prompt: bool = True) -> tuple[list[int], int]:
        """The token ids the model would be sent for `prompt` (or, for a generate model, for `messages` through
        its chat template), untruncated, and the most it takes (max_tokens, or the generate model's context).
        `add_special_tokens`: an encoder's [CLS]/[SEP], a generate model's BOS where its GGUF asks for one."""
        mc = self.config.model(model)
        add_special = ck.check_flag(add_special_tokens, "add_special_tokens", True)
        add_prompt = ck.check_flag(add_generation_prompt, "add_generation_prompt", True)
        if (prompt is None) == (messages is None):
            raise InvalidRequest("give exactly one of prompt or messages")
        if messages is not None:
            if mc.kind != GENERATE:
                raise InvalidRequest(f"model {model!r} serves {mc.kind}: messages need a chat template")
            messages = ck.check_messages(messages)
            texts = [m["content"] for m in messages] + [m["role"] for m in messages]
        else:
            texts = ck.check_texts([prompt], "prompt")
        what = "prompt" if messages is None else "messages"
        cap = ck.char_cap(mc) if mc.encoder else ck.gen_char_cap(mc)
        ck.refuse_long_texts(["".join(texts)], [what], cap, model)
        ck.check_unicode(texts, what)
        if not mc.encoder:
            tok = await self.tokenizers.chat_loaded(model)

            def encode() -> list[int]:
                text = prompt if messages is None else tok.apply_chat_template(messages, add_prompt)
                return list(tok.encode(text, add_special=add_special))

            return await self.tokenizers.off_loop(encode), await _completion.context_of(mc, self.tokenizers)
        encoder = await self.tokenizers.encoder_loaded(model)
        ids = await self.tokenizers.off_loop(lambda: encoder.encode_full(texts, special=add_special)[0])
        return ids.tolist(), mc.max_tokens

    async def model_len(self, model: str) -> int:
        """The most tokens the model takes: a generate model's context (its max_context, at most its GGUF's
        context_length), an encoder's max_tokens."""
        mc = self.config.model(model)
        return mc.max_tokens if mc.encoder else await _completion.context_of(mc, self.tokenizers)

    async def detokenize(self, ids: list[int], *, model: str) -> str:
        """The text of token ids, special tokens included."""
        mc = self.config.model(model)
        if isinstance(ids, str) or not isinstance(ids, list | tuple | np.ndarray):
            raise InvalidRequest("tokens must be a list of token ids")
        if not mc.encoder:
            chat = await self.tokenizers.chat_loaded(model)
            vocab, decode = chat.tokenizer.get_vocab_size(with_added_tokens=True), chat.decode
        else:
            tok = await self.tokenizers.encoder_loaded(model)
            vocab, decode = tok.vocab_size, tok.decode

        def run() -> str:
            row = rq.check_token_rows([ids], vocab, "tokens")[0] if len(ids) else np.zeros(0, np.int32)
            return str(decode(row.tolist()))

        return await self.tokenizers.off_loop(run)

    # --- embeddings ----------------------------------------------------------------------------

    async def embed(self, texts: list[str], *, model: str, timeout: float | None = None,
                    pooling: str | None = None, normalize: bool | None = None) -> np.ndarray:
        """Embeddings of `texts` as an (n, dims) float32 array, in input order."""
        vecs, _ = await self.embed_counted(texts, model=model, timeout=timeout, pooling=pooling, normalize=normalize)
        return vecs

    async def embed_counted(self, texts: list[str] | list[list[int]], *, model: str, timeout: float | None = None,
                            pooling: str | None = None, normalize: bool | None = None, truncate: bool = True,
                            dimensions: int | None = None) -> tuple[np.ndarray, int]:
        """`embed`, and the number of tokens the inputs took (usage): see `EmbeddingsRequest` for the arguments."""
        request = EmbeddingsRequest(models=self.config, model=model, input=texts, pooling=pooling,
                                    normalize=normalize, truncate=truncate, dimensions=dimensions)
        return await self.embeddings(request, timeout=timeout)

    async def embeddings(self, request: EmbeddingsRequest, *, timeout: float | None = None
                         ) -> tuple[np.ndarray, int]:
        """The vectors of `request`'s inputs as an (n, dims) float32 array, in input order, and the number of tokens
        they took. Token-id inputs are embedded as given: no [CLS]/[SEP] is added (`tokenize` returns them with)."""
        flight, mc, model = self._flight(EMBEDDINGS, request.mc), request.mc, request.model
        items, truncate = request.input, request.truncate
        flight.start(timeout)
        if not items:
            return np.zeros((0, request.dimensions or self.dispatch.dims.get(model, 0)), dtype=np.float32), 0
        if request.is_ids:
            nbytes = rq.ID_BYTES * sum(min(len(r), mc.max_tokens) for r in items)
        else:
            if not truncate:
                ck.refuse_long_texts(items, [f"input[{i}]" for i in range(len(items))], ck.char_cap(mc), model)
            items = rq.cap_texts(items, ck.char_cap(mc))
            nbytes = rq.id_bytes_bound(items, mc.max_tokens)
        async with flight.admit(nbytes) as ticket:
            await self.tokenizers.encoder_loaded(model)
            encode = self._id_rows if request.is_ids else self._text_rows
            rows = await self.tokenizers.off_loop(lambda: encode(items, model, mc.max_tokens, truncate))
            vecs = await self._embed_admitted(rows, flight, request.pooling, request.normalize)
            n_tokens = sum(len(r) for r in rows)
            if ticket is not None:
                ticket.count_tokens(n_tokens)
        return rq.cut_dimensions(vecs, request.dimensions, request.normalize, model), n_tokens

    def _text_rows(self, texts: list[str], model: str, cap: int, truncate: bool) -> list[np.ndarray]:
        ck.check_unicode(texts, "input")
        tok = self.tokenizers.encoder(model)
        rows, cut = tok.encode_checked(texts)
        if cut and not truncate:
            raise rq.too_many_tokens(f"input[{cut[0]}]", len(tok.encode_full([texts[cut[0]]])[0]), cap, model)
        return rows

    def _id_rows(self, items: list[Any], model: str, cap: int, truncate: bool) -> list[np.ndarray]:
        rows = rq.check_token_rows(items, self.tokenizers.encoder(model).vocab_size, "input")
        if not truncate and (over := [i for i, r in enumerate(rows) if len(r) > cap]):
            raise rq.too_many_tokens(f"input[{over[0]}]", len(rows[over[0]]), cap, model)
        return [r[:cap] for r in rows]

    async def embed_rows(self, rows: list[np.ndarray], *, model: str, pooling: str, normalize: bool,
                         timeout: float | None = None) -> np.ndarray:
        """Token-id rows -> embeddings, admitted against the model's queue budget (with the daemon's
        `scheduler`), batched with concurrent requests (with its `batcher`), in frames that fit."""
        flight = self._flight(EMBEDDINGS, serving_model(self.config, model, EmbeddingsRequest.WHAT))
        rows = rq.check_rows(rows)
        pooling, normalize = ck.check_pooling(pooling, flight.mc), ck.check_normalize(normalize, flight.mc)
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
            mc = serving_model(self.config, model, EmbeddingsRequest.WHAT)
            rows = rq.check_rows(rows)
            pooling, normalize = ck.check_pooling(pooling, mc), ck.check_normalize(normalize, mc)
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
        """`rerank`, and the number of tokens of the query and documents sent (usage): see `RerankRequest`."""
        request = RerankRequest(models=self.config, model=model, query=query, documents=documents,
                                truncate=truncate, max_tokens_per_doc=max_tokens_per_doc)
        return await self.reranking(request, timeout=timeout)

    async def reranking(self, request: RerankRequest, *, timeout: float | None = None
                        ) -> tuple[np.ndarray, str, int]:
        """The relevance of each document to the query, in input order, the method and the tokens sent. Each
        document is cut to `max_tokens_per_doc` tokens when given. What does not fit the model (the pair [CLS]
        query [SEP] doc [SEP] for a cross-encoder, each text with [CLS]/[SEP] for a bi-encoder) is cut by the
        worker, or refused with RequestTooLarge naming it when `truncate` is false."""
        flight, mc, model = self._flight(RERANKING, request.mc), request.mc, request.model
        flight.start(timeout)
        if not request.documents:
            return np.zeros(0, dtype=np.float32), "none", 0
        texts = [request.query, *request.documents]
        if not request.truncate:
            names = ["query", *(f"documents[{i}]" for i in range(len(request.documents)))]
            ck.refuse_long_texts(texts, names, ck.char_cap(mc), model)
        texts = rq.cap_texts(texts, ck.char_cap(mc))
        async with flight.admit(rq.id_bytes_bound(texts, mc.max_tokens)) as ticket:
            await self.tokenizers.encoder_loaded(model)
            q, *ids = await self.tokenizers.off_loop(
                lambda: self._encode_rerank(model, mc, texts, request.truncate, request.max_tokens_per_doc))
            scores, method = await self._rerank_admitted(request, flight, q, ids)
            n_tokens = len(q) + sum(len(d) for d in ids)
            if ticket is not None:
                ticket.count_tokens(n_tokens)
        return scores, method, n_tokens

    async def _rerank_admitted(self, request: RerankRequest, flight: Flight[Any, Any], q: np.ndarray,
                               ids: list[np.ndarray]) -> tuple[np.ndarray, str]:
        """RERANK micro-batches of at most max_batch_items documents that fit a frame each, one at a time."""
        chunks = rq.plan_chunks([len(d) for d in ids], max_items=self.config.max_batch_items,
                                max_bytes=self.config.max_frame, fixed=len(q), what="documents")
        scores, method = [], "cross_encoder"
        for a, b in chunks:
            reply = await flight.call(request.to_wire(q, ids[a:b]), f"rerank on {request.model!r}")
            scores.append(np.frombuffer(reply.raw, dtype="<f4").copy())
            method = reply.method or "cross_encoder"
        return np.concatenate(scores), method

    def _encode_rerank(self, model: str, mc: ModelConfig, texts: list[str], truncate: bool,
                       per_doc: int | None) -> list[np.ndarray]:
        ck.check_unicode(texts, "query and documents")
        tok = self.tokenizers.encoder(model)
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

    async def generate(self, prompt: str | list[int] | None = None, *, model: str,
                       messages: list[dict[str, str]] | None = None, max_tokens: int | None = None,
                       grammar: str | None = None, timeout: float | None = None,
                       temperature: float | None = None, top_p: float | None = None, top_k: int | None = None,
                       seed: int | None = None, stop: str | list[str] | None = None, logprobs: int | None = None,
                       echo: bool = False, on_delta: OnDelta | None = None) -> dict[str, Any]:
        """Completion of `prompt`, or of `messages` through the model's chat template (daemon-side): see
        `CompletionRequest` for the arguments. `on_delta({text, n_gen, logprobs?})` streams the text as it is
        generated; the deltas joined are the answer's text. Returns {text, n_prompt, n_gen, finish_reason[,
        logprobs]}."""
        request = CompletionRequest(models=self.config, model=model, prompt=prompt, messages=messages,
                                    max_tokens=max_tokens, grammar=grammar, temperature=temperature, top_p=top_p,
                                    top_k=top_k, seed=seed, stop=stop, logprobs=logprobs, echo=echo)
        return await self.completion(request, timeout=timeout, on_delta=on_delta)

    async def completion(self, request: CompletionRequest, *, timeout: float | None = None,
                         on_delta: OnDelta | None = None) -> dict[str, Any]:
        """`request`'s completion: `generate`'s answer."""
        flight = self._flight(GENERATION, request.mc)
        flight.start(timeout)
        return await _completion.complete(flight, request, self.tokenizers, on_delta=on_delta)
