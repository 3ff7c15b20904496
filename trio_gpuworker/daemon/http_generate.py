"""/v1/completions and /v1/chat/completions, mixed into `Api`: OpenAI's bodies, answers and streams.

With `stream: true` the answer is server-sent events in OpenAI's shape: for chat a first chunk with the role,
then one chunk per text delta, `finish_reason` on the last, a usage chunk when `stream_options.include_usage`,
then `data: [DONE]`. The stream starts at the first chunk, so a request refused before generation (bad field,
quarantined lane) is still a plain HTTP error; a failure after that ends the stream with an `error` event. A
client that disconnects cancels the request, and the worker stops generating at its next token (CANCEL).
"""

from __future__ import annotations

import math
import secrets
import time
from collections.abc import Callable
from typing import Any

import trio

from .._errors import GpuWorkerError, InvalidRequest
from .http_common import Emit, EventStream
from .http_fields import CONTENT_PART, MESSAGE, UnsupportedField, check_fields
from .http_serving import DEFAULT_GEN_TOKENS, ServingRoutes

STREAM_OPTIONS = ("include_usage",)


def _utf8(token: str) -> list[int]:
    return list(token.encode("utf-8", "surrogatepass"))


def chat_logprobs(records: list[dict[str, Any]]) -> dict[str, Any]:
    """OpenAI's chat `logprobs`: {content: [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}."""
    return {"content": [{"token": r["token"], "logprob": r["logprob"], "bytes": _utf8(r["token"]),
                         "top_logprobs": [{"token": t["token"], "logprob": t["logprob"], "bytes": _utf8(t["token"])}
                                          for t in r["top"]]} for r in records]}


def completion_logprobs(records: list[dict[str, Any]], offset: int = 0) -> dict[str, Any]:
    """The legacy completions `logprobs`: parallel lists, and each token's offset in the text."""
    offsets, at = [], offset
    for r in records:
        offsets.append(at)
        at += len(r["token"])
    return {"tokens": [r["token"] for r in records], "token_logprobs": [r["logprob"] for r in records],
            "top_logprobs": [{t["token"]: t["logprob"] for t in r["top"]} for r in records], "text_offset": offsets}


class GenerationRoutes(ServingRoutes):
    def _generation_args(self, body: dict[str, Any], *, chat: bool) -> dict[str, Any]:
        """What a completion takes; the fields it does not implement were refused by the route's spec."""
        both = body.get("max_tokens"), body.get("max_completion_tokens")
        if None not in both and both[0] != both[1]:
            raise InvalidRequest("max_tokens and max_completion_tokens differ: give one of them")
        max_tokens = both[1] if both[1] is not None else both[0]  # checked by the Supervisor, as for the Python API
        if max_tokens is None:
            max_tokens = DEFAULT_GEN_TOKENS
        for key in ("user", "grammar"):
            if body.get(key) is not None and not isinstance(body[key], str):
                raise InvalidRequest(f"'{key}' must be a string")
        if chat:  # logprobs: true and top_logprobs: n (0..5)
            want = body.get("logprobs")
            if want is not None and not isinstance(want, bool):
                raise InvalidRequest(f"'logprobs' must be a boolean, got {want!r}")
            top = body.get("top_logprobs")
            if top is not None and not want:
                raise InvalidRequest("'top_logprobs' needs 'logprobs': true")
            logprobs = (top if top is not None else 0) if want else None
        else:  # logprobs: n, the alternatives per token
            logprobs = body.get("logprobs")
        return {"max_tokens": max_tokens, "grammar": body.get("grammar") or None,
                "timeout": self.http.request_timeout_s, "temperature": body.get("temperature"),
                "top_p": body.get("top_p"), "top_k": body.get("top_k"), "seed": body.get("seed"),
                "stop": body.get("stop"), "logprobs": logprobs}

    @staticmethod
    def _stream_flags(body: dict[str, Any]) -> tuple[bool, bool]:
        """(stream, include_usage)."""
        stream = body.get("stream")
        if stream is not None and not isinstance(stream, bool):
            raise InvalidRequest(f"'stream' must be a boolean, got {stream!r}")
        options = body.get("stream_options")
        if options is None:
            return bool(stream), False
        if not stream:
            raise InvalidRequest("'stream_options' is only allowed with 'stream': true")
        if not isinstance(options, dict):
            raise InvalidRequest("'stream_options' must be an object")
        for key in options:
            if key not in STREAM_OPTIONS:
                raise UnsupportedField(f"stream_options.{key}", "is not a field this daemon implements")
        usage = options.get("include_usage", False)
        if not isinstance(usage, bool):
            raise InvalidRequest("'stream_options.include_usage' must be a boolean")
        return True, usage

    @staticmethod
    def _usage(out: dict[str, Any]) -> dict[str, int]:
        return {"prompt_tokens": out["n_prompt"], "completion_tokens": out["n_gen"],
                "total_tokens": out["n_prompt"] + out["n_gen"]}

    async def completions(self, _: dict[str, str], body: dict[str, Any]) -> tuple[int, Any] | EventStream:
        model = self._model(body)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if not isinstance(prompt, str) or not prompt:
            raise InvalidRequest("'prompt' must be a non-empty string (one prompt per request)")
        args, (stream, usage) = self._generation_args(body, chat=False), self._stream_flags(body)
        head = {"id": f"cmpl-{secrets.token_hex(12)}", "object": "text_completion", "created": int(time.time()),
                "model": model}
        lp = args["logprobs"] is not None

        def choice(text: str, records: list[dict[str, Any]] | None, offset: int, finish: str | None) -> Any:
            return {"index": 0, "text": text, "logprobs": completion_logprobs(records or [], offset) if lp else None,
                    "finish_reason": finish}

        if stream:
            return self._event_stream(
                lambda on_delta: self.sup.generate(prompt, model=model, on_delta=on_delta, **args), head, usage,
                choice, role=False)
        out = await self.sup.generate(prompt, model=model, **args)
        return 200, {**head, "choices": [choice(out["text"], out.get("logprobs"), 0, out["finish_reason"])],
                     "usage": self._usage(out)}

    async def chat_completions(self, _: dict[str, str], body: dict[str, Any]) -> tuple[int, Any] | EventStream:
        model = self._model(body)
        messages = self._messages(body.get("messages"))
        args, (stream, usage) = self._generation_args(body, chat=True), self._stream_flags(body)
        head = {"id": f"chatcmpl-{secrets.token_hex(12)}", "object": "chat.completion", "created": int(time.time()),
                "model": model}
        lp = args["logprobs"] is not None
        if stream:
            def delta(text: str, records: list[dict[str, Any]] | None, _: int, finish: str | None) -> Any:
                return {"index": 0, "delta": {"content": text} if text else {},
                        "logprobs": chat_logprobs(records or []) if lp and records else None, "finish_reason": finish}

            return self._event_stream(lambda on_delta: self.sup.generate(model=model, messages=messages,
                                                                   on_delta=on_delta, **args),
                                {**head, "object": "chat.completion.chunk"}, usage, delta, role=True)
        out = await self.sup.generate(model=model, messages=messages, **args)
        return 200, {**head,
                     "choices": [{"index": 0, "message": {"role": "assistant", "content": out["text"]},
                                  "logprobs": chat_logprobs(out.get("logprobs") or []) if lp else None,
                                  "finish_reason": out["finish_reason"]}],
                     "usage": self._usage(out)}

    @staticmethod
    def _messages(raw: Any) -> list[dict[str, str]]:
        if not isinstance(raw, list) or not raw:
            raise InvalidRequest("'messages' must be a non-empty list")
        messages: list[dict[str, str]] = []
        for i, m in enumerate(raw):
            if isinstance(m, dict):
                check_fields(m, MESSAGE, f"messages[{i}].")
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, list):  # content parts: text only
                for k, part in enumerate(content):
                    if isinstance(part, dict):
                        check_fields(part, CONTENT_PART, f"messages[{i}].content[{k}].")
                if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                           for p in content):
                    raise InvalidRequest(f"messages[{i}].content: only text parts are supported")
                content = "".join(p["text"] for p in content)
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(content, str):
                raise InvalidRequest(f"messages[{i}] must be {{role, content}} with string content")
            messages.append({"role": m["role"], "content": content})
        return messages

    def _event_stream(self, run: Callable[[Callable[[dict[str, Any]], None]], Any], head: dict[str, Any], usage: bool,
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
            async with trio.open_nursery() as nursery:
                nursery.start_soon(generate)
                async with recv:
                    async for d in recv:
                        if first and role:
                            await emit(chunk([{"index": 0, "delta": {"role": "assistant", "content": ""},
                                               "logprobs": None, "finish_reason": None}]))
                        first = False
                        await emit(chunk([choice(d["text"], d.get("logprobs"), sent, None)]))
                        sent, n_records = sent + len(d["text"]), n_records + len(d.get("logprobs") or ())
            if "error" in outcome:
                raise outcome["error"]
            out = outcome["out"]
            if first and role:
                await emit(chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                   "finish_reason": None}]))
            # what no delta carried: a held-back tail, a last partial character, their logprobs
            await emit(chunk([choice(out["text"][sent:], (out.get("logprobs") or [])[n_records:], sent,
                                     out["finish_reason"])]))
            if usage:
                await emit({**head, "choices": [], "usage": self._usage(out)})

        return EventStream(produce)
