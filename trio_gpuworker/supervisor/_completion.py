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
from .._errors import InvalidRequest
from .._proto import Generate, Progress, Text, TextDelta, WireMessage
from . import _requests as rq
from ._genbatch import packer_for
from ._route import Flight
from ._tokenizers import Tokenizers


async def complete(flight: Flight[Generate, Text], request: CompletionRequest, tokenizers: Tokenizers, *,
                   on_delta: OnDelta | None) -> dict[str, Any]:
    """`request` on its `flight` (started: its deadline runs), its prompt tokenized by `tokenizers`: the answer
    {text, n_prompt, n_gen, finish_reason[, logprobs]}; `on_delta` gets the text as it is generated."""
    async with flight.admit(rq.id_bytes_bound(request.texts) + rq.ID_BYTES * request.template_bytes) as ticket:
        ids = await _prompt_ids(request, tokenizers)
        out = await _decode(flight, request.to_wire(ids, stream=on_delta is not None), ids, on_delta)
        if ticket is not None:
            ticket.count_tokens(out["n_prompt"], out["n_gen"])
    return out


async def _prompt_ids(request: CompletionRequest, tokenizers: Tokenizers) -> np.ndarray:
    """The prompt's token ids (the messages through the chat template), if they leave room for max_tokens."""
    model, context = request.model, ck.gen_context(request.mc)
    max_tokens, messages = request.max_tokens, request.messages
    tok = await tokenizers.chat_loaded(model)

    def encode() -> np.ndarray:
        # a plain prompt gets the BOS its GGUF asks for; a chat template writes its own specials
        if messages is None:
            return np.asarray(tok.encode(request.prompt, add_special=True), dtype="<i4")
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tools=request.template_tools)
        return np.asarray(tok.encode(text), dtype="<i4")

    ids = await tokenizers.off_loop(encode)
    if len(ids) + max_tokens > context:
        raise InvalidRequest(f"the prompt has {len(ids)} tokens; with max_tokens {max_tokens} that exceeds "
                             f"model {model!r}'s {context}-token context (at most {max(context - len(ids), 0)} "
                             "new tokens)")
    return ids


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
        out = {"text": reply.text, "n_prompt": reply.n_prompt, "n_gen": reply.n_gen,
               "finish_reason": reply.finish_reason}
        if wire.logprobs is not None:
            out["logprobs"] = list(reply.logprobs or [])
    return out


__all__ = ["OnDelta", "complete"]
