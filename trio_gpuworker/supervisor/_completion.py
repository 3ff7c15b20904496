"""A completion request on its way to GENERATE and back: its prompt tokenized (through the chat template for
messages), checked against the model's context, sent (or decoded in a batch, _genbatch.py) and its answer read.
The request's arguments were checked when it was built (_api_requests.py, `CompletionRequest`).

Sampling fields go on the wire only when they change the answer, so a greedy request of at most 64 tokens is the
reference's GENERATE, which any v3 worker serves; anything more needs the worker's negotiated extensions
(_proto/_extensions.py), checked where it is sent.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import _api_checks as ck
from .._api_requests import CompletionRequest, OnDelta
from .._config import ModelConfig
from .._errors import InvalidRequest
from .._proto import EXT_LONG, V3_MAX_GEN_TOKENS, Generate, Progress, Text, TextDelta, WireMessage, advertised
from . import _requests as rq
from ._genbatch import packer_for
from ._route import Flight
from ._tokenizers import Tokenizers


async def complete(flight: Flight[Generate, Text], request: CompletionRequest, tokenizers: Tokenizers, *,
                   on_delta: OnDelta | None) -> dict[str, Any]:
    """`request` on its `flight` (started: its deadline runs), its prompt tokenized by `tokenizers`: the answer
    {text, n_prompt, n_gen, finish_reason[, logprobs][, echo, prompt_logprobs]}; `on_delta` gets the text as it
    is generated. With `echo`, `echo` is the prompt's text and, with logprobs, `prompt_logprobs` one record per
    prompt token (the first with logprob None: nothing came before it)."""
    given = len(request.prompt_ids or ())  # a prompt given as token ids
    nbytes = rq.id_bytes_bound(request.texts) + rq.ID_BYTES * (request.template_bytes + given)
    async with flight.admit(nbytes) as ticket:
        ids, max_tokens = await _prompt_ids(request, tokenizers)
        wire = request.to_wire(ids, _worker_cap(flight, request, max_tokens), stream=on_delta is not None)
        out = await _decode(flight, wire, ids, on_delta)
        if ticket is not None:
            ticket.count_tokens(out["n_prompt"], out["n_gen"])
    if request.echo:
        tok = await tokenizers.chat_loaded(request.model)

        def echoed() -> dict[str, Any]:
            echo = {"echo": request.prompt if isinstance(request.prompt, str) else tok.decode(ids.tolist())}
            if "prompt_logprobs" in out:
                first = {"token": tok.decode(ids[:1].tolist()), "id": int(ids[0]), "logprob": None, "top": None}
                echo["prompt_logprobs"] = [first, *out["prompt_logprobs"]]
            return echo

        out.update(await tokenizers.off_loop(echoed))
    return out


async def context_of(mc: ModelConfig, tokenizers: Tokenizers) -> int:
    """A generate model's context in tokens: its `max_context` (ck.gen_context), at most its GGUF's
    context_length, as its worker's decoder caps it."""
    tok = await tokenizers.chat_loaded(mc.id)
    return min(ck.gen_context(mc), tok.context_length or ck.gen_context(mc))


async def _prompt_ids(request: CompletionRequest, tokenizers: Tokenizers) -> tuple[np.ndarray, int]:
    """The prompt's token ids (the messages through the chat template; ids given, checked against the vocabulary),
    and its max_tokens: the request's, if the prompt leaves room for it, else what the context leaves (at most the
    model's default_max_tokens)."""
    model, context = request.model, await context_of(request.mc, tokenizers)
    max_tokens, messages = request.max_tokens, request.messages
    tok = await tokenizers.chat_loaded(model)

    def encode() -> np.ndarray:
        # a plain prompt gets the BOS its GGUF asks for; a chat template writes its own specials
        if request.prompt_ids is not None:
            vocab = tok.tokenizer.get_vocab_size(with_added_tokens=True)
            return rq.check_token_rows([request.prompt_ids], vocab, "prompt")[0].astype("<i4")
        if messages is None:
            return np.asarray(tok.encode(request.prompt, add_special=True), dtype="<i4")
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tools=request.template_tools)
        return np.asarray(tok.encode(text), dtype="<i4")

    ids = await tokenizers.off_loop(encode)
    room = context - len(ids)
    if max_tokens is None:
        if room < 1:
            raise InvalidRequest(f"the prompt has {len(ids)} tokens: it leaves no room in model {model!r}'s "
                                 f"{context}-token context")
        return ids, min(room, request.mc.default_max_tokens or room)
    if max_tokens > room:
        raise InvalidRequest(f"the prompt has {len(ids)} tokens; with max_tokens {max_tokens} that exceeds "
                             f"model {model!r}'s {context}-token context (at most {max(room, 0)} new tokens)")
    return ids, max_tokens


def _worker_cap(flight: Flight[Generate, Text], request: CompletionRequest, max_tokens: int) -> int:
    """A request that named no max_tokens is not refused by a worker without long generation (the reference's 64
    tokens at most): its default is what that worker makes. A max_tokens the caller named is sent as it is."""
    if request.max_tokens is not None or max_tokens <= V3_MAX_GEN_TOKENS:
        return max_tokens
    lane = flight.lane()
    gen = lane.gens.get(lane.generation)
    if gen is not None and EXT_LONG not in advertised(gen.wp.hello):
        return V3_MAX_GEN_TOKENS
    return max_tokens


async def _decode(flight: Flight[Generate, Text], wire: Generate, ids: np.ndarray,
                  on_delta: OnDelta | None) -> dict[str, Any]:
    """GENERATE's answer: decoded in the model's batch where the worker can (supervisor/_genbatch.py), else alone."""
    timing, what = flight.timing(), f"generate on {wire.model_ref!r}"

    def progress(msg: WireMessage) -> None:
        """PROGRESS and TEXT_DELTA both count generated tokens (a token streamed in a delta has no PROGRESS)."""
        match msg:
            case Progress(completed=n) if timing is not None:
                timing.token(n)
            case TextDelta(n_gen=n):
                if timing is not None:
                    timing.token(n)
                if on_delta is not None:
                    on_delta({k: v for k, v in msg.to_fields().items() if k in ("text", "n_gen", "logprobs")})

    fields = wire.to_fields()
    packer = packer_for(flight.lane(), wire.model_ref, fields)
    out = None if packer is None else await packer.generate(fields, ids, timeout=flight.left(what),
                                                             on_delta=on_delta, timing=timing)
    if out is None:
        reply = await flight.call(wire, what, timing=timing, on_progress=progress)
        if timing is not None and reply.n_gen:
            timing.token(reply.n_gen)  # the tokens after the last PROGRESS (a worker paces them)
        out = {"text": reply.text, "n_prompt": reply.n_prompt, "n_gen": reply.n_gen,
               "finish_reason": reply.finish_reason}
        if wire.logprobs is not None:
            out["logprobs"] = list(reply.logprobs or [])
        if wire.prompt_logprobs is not None:
            out["prompt_logprobs"] = list(reply.prompt_logprobs or [])
    return out


__all__ = ["OnDelta", "complete", "context_of"]
