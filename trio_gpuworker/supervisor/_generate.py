"""A completion request on its way to GENERATE and back: its prompt tokenized (through the chat template for
messages), checked against the model's context, sent (or decoded in a batch, _genbatch.py) and its answer read.
The request's arguments were checked when it was built (_api_requests.py, `CompletionRequest`).

Sampling fields go on the wire only when they change the answer, so a greedy request of at most 64 tokens is the
reference's GENERATE, which any v3 worker serves; anything more needs the worker's negotiated extensions
(_proto/_extensions.py), checked where it is sent.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar

import numpy as np
import trio

from .. import _api_checks as ck
from .._api_requests import CompletionRequest, OnDelta
from .._config import ModelConfig
from .._errors import InvalidRequest
from .._proto import Progress, TextDelta, WireMessage
from . import _requests as rq
from ._genbatch import packer_for
from ._route import GENERATION, Flight, Q, R, Route

T = TypeVar("T")


class GenerateHost(Protocol):
    """What generate() needs of the ServingApi that calls it: its request path (_route.Flight: the model's kind
    check, deadline, admission, lane choice), the chat tokenizer and the CPU threads tokenization runs on."""

    _cpu: trio.CapacityLimiter

    def _off_loop(self, fn: Callable[[], T]) -> Awaitable[T]: ...
    def _flight(self, route: Route[Q, R], mc: ModelConfig) -> Flight[Q, R]: ...
    def chat_tokenizer(self, model: str) -> Any: ...


async def generate(api: GenerateHost, request: CompletionRequest, *, timeout: float | None,
                   on_delta: OnDelta | None) -> dict[str, Any]:
    """ServingApi.completion (`api`, which calls this): see there."""
    flight, model = api._flight(GENERATION, request.mc), request.model
    context, max_tokens, messages = ck.gen_context(request.mc), request.max_tokens, request.messages
    flight.start(timeout)
    async with flight.admit(rq.id_bytes_bound(request.texts) + rq.ID_BYTES * request.template_bytes) as ticket:
        tok = await trio.to_thread.run_sync(api.chat_tokenizer, model, limiter=api._cpu)

        def encode() -> np.ndarray:
            text = request.prompt if messages is None else tok.apply_chat_template(messages, add_generation_prompt=True)
            return np.asarray(tok.encode(text), dtype="<i4")

        ids = await api._off_loop(encode)
        if len(ids) + max_tokens > context:
            raise InvalidRequest(f"the prompt has {len(ids)} tokens; with max_tokens {max_tokens} that exceeds "
                                 f"model {model!r}'s {context}-token context (at most {max(context - len(ids), 0)} "
                                 "new tokens)")
        wire = request.to_wire(ids, stream=on_delta is not None)
        timing = flight.timing()

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

        what = f"generate on {model!r}"
        # concurrent requests for this model decode together where the worker can (supervisor/_genbatch.py)
        fields = wire.to_fields()
        packer = packer_for(api.pick_lane(model), model, fields)
        out = None if packer is None else await packer.generate(fields, ids, timeout=flight.left(what),
                                                                 on_delta=on_delta, timing=timing)
        if out is None:
            reply = await flight.call(wire, what, timing=timing, on_progress=progress)
            out = {"text": reply.text, "n_prompt": reply.n_prompt, "n_gen": reply.n_gen,
                   "finish_reason": reply.finish_reason}
            if "logprobs" in request.sampling:
                out["logprobs"] = list(reply.logprobs or [])
        if ticket is not None:
            ticket.count_tokens(out["n_prompt"], out["n_gen"])
    return out


__all__ = ["OnDelta", "generate"]
