"""A generate request, from the caller's arguments to GENERATE's fields and back: checked once, here.

Sampling fields go on the wire only when they change the answer (temperature 0 is greedy, top_p 1 and top_k 0
cut nothing), so a greedy request of at most 64 tokens is the reference's GENERATE, which any v3 worker serves;
anything more needs the worker's negotiated extensions (_proto/_extensions.py), checked where it is sent.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import numpy as np
import trio

from .._errors import InvalidRequest
from .._proto import MAX_TOP_LOGPROBS, Generate, Progress, TextDelta, WireMessage
from . import _requests as rq
from ._genbatch import packer_for
from ._route import GENERATION, Flight, Q, R, Route

MAX_STOPS = 4  # stop strings per request, as OpenAI allows
MAX_STOP_CHARS = 256
SEED_BOUND = 1 << 64
OnDelta = Callable[[dict[str, Any]], None]
T = TypeVar("T")


class GenerateHost(Protocol):
    """What generate() needs of the ServingApi that calls it: its request path (_route.Flight: the model's kind
    check, deadline, admission, lane choice), the chat tokenizer and the CPU threads tokenization runs on."""

    _cpu: trio.CapacityLimiter

    def _off_loop(self, fn: Callable[[], T]) -> Awaitable[T]: ...
    def _flight(self, route: Route[Q, R], model: str) -> Flight[Q, R]: ...
    def chat_tokenizer(self, model: str) -> Any: ...


@dataclass(frozen=True)
class Sampling:
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    logprobs: int | None = None

    def wire(self) -> dict[str, Any]:
        """GENERATE's sampling fields, each checked; only those that change the answer."""
        out: dict[str, Any] = {}
        t = _number(self.temperature, "temperature", 0.0, 2.0)
        p = _number(self.top_p, "top_p", 0.0, 1.0)
        if p == 0.0:
            raise InvalidRequest("top_p must be in (0, 1], got 0")
        k = _integer(self.top_k, "top_k", 0, 1 << 31)
        seed = _integer(self.seed, "seed", 0, SEED_BOUND - 1)
        if t:  # greedy: nothing else changes which token comes next
            out["temperature"] = t
            if p is not None and p < 1.0:
                out["top_p"] = p
            if k:
                out["top_k"] = k
            if seed is not None:
                out["seed"] = seed
        if stops := _stops(self.stop):
            out["stop"] = stops
        if (lp := _integer(self.logprobs, "logprobs", 0, MAX_TOP_LOGPROBS)) is not None:
            out["logprobs"] = lp
        return out


def _number(v: Any, what: str, lo: float, hi: float) -> float | None:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int | float) or math.isnan(v) or not lo <= v <= hi:
        raise InvalidRequest(f"{what} must be a number in {lo:g}..{hi:g}, got {v!r}")
    return float(v)


def _integer(v: Any, what: str, lo: int, hi: int) -> int | None:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise InvalidRequest(f"{what} must be an integer in {lo}..{hi}, got {v!r}")
    return v


def _stops(stop: Any) -> list[str]:
    stops = [stop] if isinstance(stop, str) else stop
    if stops is None:
        return []
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise InvalidRequest("stop must be a non-empty string or a list of them")
    if len(stops) > MAX_STOPS:
        raise InvalidRequest(f"stop has {len(stops)} strings; at most {MAX_STOPS}")
    if any(len(s) > MAX_STOP_CHARS for s in stops):
        raise InvalidRequest(f"a stop string is longer than {MAX_STOP_CHARS} characters")
    rq.check_unicode(stops, "stop")
    return stops


async def generate(api: GenerateHost, prompt: str | None, *, model: str, messages: list[dict[str, str]] | None,
                   max_tokens: int, grammar: str | None, timeout: float | None, sampling: Sampling,
                   on_delta: OnDelta | None) -> dict[str, Any]:
    """ServingApi.generate (`api`, which calls this): see there."""
    flight = api._flight(GENERATION, model)
    mc = flight.mc
    context = rq.gen_context(mc)
    max_tokens = rq.check_max_tokens(max_tokens, context - 1)
    if grammar is not None and not isinstance(grammar, str):
        raise InvalidRequest("grammar must be a string")
    if (prompt is None) == (messages is None):
        raise InvalidRequest("give exactly one of prompt or messages")
    wire = sampling.wire()
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
    flight.start(timeout)
    async with flight.admit(rq.id_bytes_bound(texts) + rq.ID_BYTES * extra) as ticket:
        tok = await trio.to_thread.run_sync(api.chat_tokenizer, model, limiter=api._cpu)

        def encode() -> np.ndarray:
            # a plain prompt gets the BOS its GGUF asks for; a chat template writes its own specials
            if messages is None:
                return np.asarray(tok.encode(prompt, add_special=True), dtype="<i4")
            return np.asarray(tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True)), dtype="<i4")

        ids = await api._off_loop(encode)
        if len(ids) + max_tokens > context:
            raise InvalidRequest(f"the prompt has {len(ids)} tokens; with max_tokens {max_tokens} that exceeds "
                                 f"model {model!r}'s {context}-token context (at most {max(context - len(ids), 0)} "
                                 "new tokens)")
        request = Generate(model_ref=model, max_tokens=max_tokens, grammar=grammar or None,
                           stream=True if on_delta is not None else None, **wire, raw=ids.tobytes())
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
        fields = request.to_fields()
        packer = packer_for(api.pick_lane(model), model, fields)
        out = None if packer is None else await packer.generate(fields, ids, timeout=flight.left(what),
                                                                 on_delta=on_delta, timing=timing)
        if out is None:
            reply = await flight.call(request, what, timing=timing, on_progress=progress)
            out = {"text": reply.text, "n_prompt": reply.n_prompt, "n_gen": reply.n_gen,
                   "finish_reason": reply.finish_reason}
            if "logprobs" in wire:
                out["logprobs"] = list(reply.logprobs or [])
        if ticket is not None:
            ticket.count_tokens(out["n_prompt"], out["n_gen"])
    return out


__all__ = ["OnDelta", "Sampling", "generate"]
