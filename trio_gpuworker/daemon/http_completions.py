"""/v1/completions and /v1/chat/completions: OpenAI's bodies (one `CompletionRequest`), answers and streams.

With `stream: true` the answer is server-sent events in OpenAI's shape: for chat a first chunk with the role,
then one chunk per text delta, `finish_reason` on the last, a usage chunk when `stream_options.include_usage`,
then `data: [DONE]`. The stream starts at the first chunk, so a request refused before generation (bad field,
quarantined lane) is still a plain HTTP error; a failure after that ends the stream with an `error` event. A
client that disconnects cancels the request, and the worker stops generating at its next token (CANCEL).
A chat request with `tools` (docs/http-api.md, 'Structured output') is answered with `tool_calls` when the model
called one; streamed, its chunks come once the answer is whole.
"""

from __future__ import annotations

import math
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import trio

from .._api_requests import CompletionRequest, OnDelta
from .._errors import GpuWorkerError
from .._structured import tool_call
from .http_common import Emit, EventStream, Intake

if TYPE_CHECKING:
    from ..supervisor import Supervisor


def _utf8(token: str) -> list[int]:
    return list(token.encode("utf-8", "surrogatepass"))


def chat_logprobs(records: list[dict[str, Any]]) -> dict[str, Any]:
    """OpenAI's chat `logprobs`: {content: [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}."""
    return {"content": [{"token": r["token"], "logprob": r["logprob"], "bytes": _utf8(r["token"]),
                         "top_logprobs": [{"token": t["token"], "logprob": t["logprob"], "bytes": _utf8(t["token"])}
                                          for t in r["top"]]} for r in records]}


def completion_logprobs(records: list[dict[str, Any]], offset: int = 0) -> dict[str, Any]:
    """The legacy completions `logprobs`: parallel lists, and each token's offset in the text. A record without a
    logprob (an echoed prompt's first token) has null for its logprob and its top logprobs, as vLLM answers."""
    offsets, at = [], offset
    for r in records:
        offsets.append(at)
        at += len(r["token"])
    return {"tokens": [r["token"] for r in records], "token_logprobs": [r["logprob"] for r in records],
            "top_logprobs": [None if r["top"] is None else _top(r["top"]) for r in records], "text_offset": offsets}


def _top(top: list[dict[str, Any]]) -> dict[str, float]:
    """Alternatives keyed by their text, most likely first; of two with the same text (bytes of one character,
    each decoding to U+FFFD) the more likely one's logprob."""
    out: dict[str, float] = {}
    for t in top:
        out.setdefault(t["token"], t["logprob"])
    return out


async def run_all(fn: Callable[[int], Awaitable[None]], n: int) -> None:
    """fn(0) .. fn(n - 1) concurrently; the first error (a GpuWorkerError as itself, not in an ExceptionGroup)
    cancels the others."""
    if n == 1:
        await fn(0)
        return
    failed: list[GpuWorkerError] = []

    async def guarded(i: int, cancel: trio.CancelScope) -> None:
        try:
            await fn(i)
        except GpuWorkerError as exc:
            failed.append(exc)
            cancel.cancel()

    async with trio.open_nursery() as nursery:
        for i in range(n):
            nursery.start_soon(guarded, i, nursery.cancel_scope)
    if failed:
        raise failed[0]


class CompletionRoutes:
    def __init__(self, sup: Supervisor, intake: Intake) -> None:
        self.sup, self.intake = sup, intake

    @staticmethod
    def _usage(out: dict[str, Any]) -> dict[str, int]:
        return {"prompt_tokens": out["n_prompt"], "completion_tokens": out["n_gen"],
                "total_tokens": out["n_prompt"] + out["n_gen"]}

    @staticmethod
    def _head(request: CompletionRequest, shape: str) -> dict[str, Any]:
        """The head of an answer, OpenAI's fields in full (`system_fingerprint` null: no fingerprint is kept)."""
        prefix, kind = ("chatcmpl", "chat.completion") if shape == "chat" else ("cmpl", "text_completion")
        return {"id": f"{prefix}-{secrets.token_hex(12)}", "object": kind, "created": int(time.time()),
                "model": request.model, "system_fingerprint": None}

    def _request(self, body: dict[str, Any], shape: str) -> tuple[CompletionRequest, dict[str, Any], bool]:
        """The body's request, the head of its answer and whether it asks for logprobs."""
        request = CompletionRequest.from_json(body, self.sup.config, shape=shape)
        return request, self._head(request, shape), request.logprobs is not None

    def _completion(self, request: CompletionRequest) -> Callable[[OnDelta | None], Awaitable[dict[str, Any]]]:
        timeout = self.intake.http.request_timeout_s
        return lambda on_delta: self.sup.completion(request, timeout=timeout, on_delta=on_delta)

    async def completions(self, _: dict[str, str], body: dict[str, Any]) -> tuple[int, Any] | EventStream:
        """One choice per prompt (`index` in order; usage summed), generated concurrently; an echo begins with the
        prompt's text and, with logprobs, the prompt's tokens."""
        requests = CompletionRequest.from_json_prompts(body, self.sup.config, max_inputs=self.intake.http.max_inputs)
        head, lp = self._head(requests[0], "completions"), requests[0].logprobs is not None

        def choice(text: str, records: list[dict[str, Any]] | None, offset: int, finish: str | None,
                   index: int = 0) -> Any:
            return {"index": index, "text": text,
                    "logprobs": completion_logprobs(records or [], offset) if lp else None, "finish_reason": finish}

        if requests[0].stream:
            return self._event_stream(self._completion(requests[0]), head, requests[0].include_usage, choice,
                                      role=False)
        outs: list[dict[str, Any]] = [{} for _ in requests]

        async def one(i: int) -> None:
            outs[i] = await self._completion(requests[i])(None)

        await run_all(one, len(requests))
        choices = [choice(out.get("echo", "") + out["text"], out.get("prompt_logprobs", []) + out.get("logprobs", []),
                          0, out["finish_reason"], i) for i, out in enumerate(outs)]
        usage = {k: sum(u[k] for u in map(self._usage, outs)) for k in ("prompt_tokens", "completion_tokens",
                                                                          "total_tokens")}
        return 200, {**head, "choices": choices, "usage": usage}

    async def chat_completions(self, _: dict[str, str], body: dict[str, Any]) -> tuple[int, Any] | EventStream:
        request, head, lp = self._request(body, "chat")
        if request.tool_mode != "none":
            return await self._tool_answer(request, head, lp)
        if request.stream:
            def delta(text: str, records: list[dict[str, Any]] | None, _: int, finish: str | None) -> Any:
                return {"index": 0, "delta": {"content": text} if text else {},
                        "logprobs": chat_logprobs(records or []) if lp and records else None, "finish_reason": finish}

            return self._event_stream(self._completion(request), {**head, "object": "chat.completion.chunk"},
                                      request.include_usage, delta, role=True)
        out = await self._completion(request)(None)
        return 200, {**head,
                     "choices": [{"index": 0, "message": {"role": "assistant", "content": out["text"], "refusal": None},
                                  "logprobs": chat_logprobs(out.get("logprobs") or []) if lp else None,
                                  "finish_reason": out["finish_reason"]}],
                     "usage": self._usage(out)}

    async def _tool_answer(self, request: CompletionRequest, head: dict[str, Any],
                           lp: bool) -> tuple[int, Any] | EventStream:
        """An answer that may be a tool call: generated whole, then read back (_structured.tool_call) into
        OpenAI's `tool_calls` with `finish_reason: "tool_calls"`, or else the text as its content. Streamed, it
        is OpenAI's chunks: the role, then the call (`delta.tool_calls`, its arguments whole) or the text, then
        the finish."""

        def message(out: dict[str, Any]) -> tuple[dict[str, Any], str]:
            calls = tool_call(out["text"], request.tool_mode)
            if calls is None:
                return {"role": "assistant", "content": out["text"]}, out["finish_reason"]
            return {"role": "assistant", "content": None, "tool_calls": calls}, "tool_calls"

        logprobs = lambda out: chat_logprobs(out.get("logprobs") or []) if lp else None  # noqa: E731
        if not request.stream:
            out = await self._completion(request)(None)
            msg, finish = message(out)
            return 200, {**head, "choices": [{"index": 0, "message": msg, "logprobs": logprobs(out),
                                              "finish_reason": finish}], "usage": self._usage(out)}
        head = {**head, "object": "chat.completion.chunk"}
        extra = {"usage": None} if request.include_usage else {}

        async def produce(emit: Emit) -> None:
            out = await self._completion(request)(None)
            msg, finish = message(out)
            await emit({**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                             "logprobs": None, "finish_reason": None}], **extra})
            delta = ({"tool_calls": [{"index": i, **c} for i, c in enumerate(msg["tool_calls"])]}
                     if "tool_calls" in msg else {"content": msg["content"]})
            await emit({**head, "choices": [{"index": 0, "delta": delta, "logprobs": logprobs(out),
                                             "finish_reason": None}], **extra})
            await emit({**head, "choices": [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": finish}],
                        **extra})
            if request.include_usage:
                await emit({**head, "choices": [], "usage": self._usage(out)})

        return EventStream(produce)

    def _event_stream(self, run: Callable[[OnDelta], Awaitable[dict[str, Any]]], head: dict[str, Any], usage: bool,
                      choice: Callable[[str, list[dict[str, Any]] | None, int, str | None], Any], *,
                      role: bool) -> EventStream:
        """The generation as chunks: its deltas as they come (in order, from the lane's task through an unbounded
        channel: at most one per token, so bounded by max_tokens), then the rest of the text and the finish."""

        async def produce(emit: Emit) -> None:
            send, recv = trio.open_memory_channel[dict[str, Any]](math.inf)
            outcome: dict[str, Any] = {}

            async def generate() -> None:
                with send:
                    try:
                        outcome["out"] = await run(send.send_nowait)
                    except GpuWorkerError as exc:  # re-raised below as itself, not as an ExceptionGroup
                        outcome["error"] = exc

            def chunk(choices: list[Any], **extra: Any) -> dict[str, Any]:
                return {**head, "choices": choices, **({"usage": None} if usage else {}), **extra}

            sent, n_records, first = 0, 0, True
            opening = {"index": 0, "delta": {"role": "assistant", "content": "", "refusal": None}, "logprobs": None,
                       "finish_reason": None}  # chat's first chunk: the role
            async with trio.open_nursery() as nursery:
                nursery.start_soon(generate)
                async with recv:
                    async for d in recv:
                        if first and role:
                            await emit(chunk([opening]))
                        first = False
                        await emit(chunk([choice(d["text"], d.get("logprobs"), sent, None)]))
                        sent, n_records = sent + len(d["text"]), n_records + len(d.get("logprobs") or ())
            if "error" in outcome:
                raise outcome["error"]
            out = outcome["out"]
            if first and role:
                await emit(chunk([opening]))
            # what no delta carried: a held-back tail, a last partial character, their logprobs
            await emit(chunk([choice(out["text"][sent:], (out.get("logprobs") or [])[n_records:], sent,
                                     out["finish_reason"])]))
            if usage:
                await emit({**head, "choices": [], "usage": self._usage(out)})

        return EventStream(produce)
