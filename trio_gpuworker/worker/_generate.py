"""GENERATE in the worker: sampling parameters from the message, its grammar, stop strings, logprobs, and streamed
text.

Streamed text is decoded incrementally over a short window of ids (as text-generation-inference does), so a
delta never ends inside a UTF-8 character (a partial one decodes to U+FFFD and is held back) and never shows
text that may turn out to begin a stop string. The deltas of a request, joined, are its TEXT's text.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from .._proto import MAX_TOP_LOGPROBS
from ..engine import Context, GenerateRequest, Generation
from ..models.sampling import SamplingParams

REPLACEMENT = "\ufffd"
# After a decode's first token, PROGRESS goes at most this often: the daemon's silence window is seconds long, and
# each frame wakes the daemon, which takes a core from a decode that runs on all of them (docs/architecture.md,
# 'Idle watchdog')
PROGRESS_EVERY_S = 0.05


class PacedProgress:
    """A decode's per-token report: the first token's PROGRESS at once (the daemon times the first token by it),
    later ones at most every PROGRESS_EVERY_S, each counting every token so far (the daemon spreads a count over
    the time since the last one); a token without a frame still checks for a stop (CANCEL, abort)."""

    def __init__(self, ctx: Context, clock: Callable[[], float] = time.monotonic) -> None:
        self.ctx, self.clock = ctx, clock
        self.last: float | None = None

    def __call__(self, n: int) -> None:
        now = self.clock()
        if self.last is None or now - self.last >= PROGRESS_EVERY_S:
            self.ctx.progress(n)
            self.last = now
        else:
            self.ctx.check()


class TextStream:
    """The text of the ids generated so far, released as it becomes final."""

    def __init__(self, detokenizer: Any, stops: list[str]) -> None:
        self.detok = detokenizer
        self.stops = stops
        self.ids: list[int] = []
        self.text = ""  # decoded so far (complete characters)
        self.sent = 0  # characters of `text` released
        self._prefix, self._read = 0, 0  # the decode window: ids[prefix:read] decoded to what is in `text`
        self.stopped_at: int | None = None  # where a stop string begins in `text`

    def add(self, token: int) -> bool:
        """One more id; True when a stop string now appears (the text ends before it)."""
        self.ids.append(token)
        before = self.detok.decode(self.ids[self._prefix:self._read], skip_special=True)
        now = self.detok.decode(self.ids[self._prefix:], skip_special=True)
        if len(now) > len(before) and not now.endswith(REPLACEMENT):
            self.text += now[len(before):]
            self._prefix, self._read = self._read, len(self.ids)
        hits = [i for s in self.stops if (i := self.text.find(s, max(0, self.sent - len(s)))) >= 0]
        if hits:
            self.stopped_at = min(hits)
            return True
        return False

    def release(self) -> str:
        """Text that is now final: all of it but a tail that may still become a stop string."""
        end = len(self.text) if self.stopped_at is None else self.stopped_at
        if self.stopped_at is None:
            for s in self.stops:
                for k in range(min(len(s) - 1, end - self.sent), 0, -1):
                    if self.text.endswith(s[:k]):
                        end = min(end, len(self.text) - k)
                        break
        out, self.sent = self.text[self.sent:end], max(self.sent, end)
        return out

    def finish(self) -> str:
        """The rest, at the end: a held-back tail that no stop string completed, a last partial character."""
        if self.stopped_at is None:
            tail = self.detok.decode(self.ids[self._prefix:], skip_special=True)
            head = self.detok.decode(self.ids[self._prefix:self._read], skip_special=True)
            self.text += tail[len(head):]
            self._prefix = self._read = len(self.ids)
        if self.stopped_at is not None:
            return self.release()
        out, self.sent = self.text[self.sent:], len(self.text)
        return out


def sampling_params(request: GenerateRequest) -> SamplingParams:
    """The extension's fields; an absent one (None) is the greedy default."""
    return SamplingParams(temperature=float(request.temperature or 0.0),
                          top_p=float(1.0 if request.top_p is None else request.top_p),
                          top_k=int(request.top_k or 0), seed=request.seed, logprobs=request.logprobs)


def generate(m: Any, request: GenerateRequest, ctx: Context) -> Generation:
    """Run one GENERATE on served model `m`. ValueError for a bad request. A token whose text goes out in a
    TEXT_DELTA needs no PROGRESS of its own (the delta renews the window), halving the frames."""
    ids = request.prompt
    params = sampling_params(request)
    stops = list(request.stop or [])
    if any(not s for s in stops):
        raise ValueError("a stop string is empty")
    stream = request.stream
    text = TextStream(m.detokenizer, stops) if stops or stream else None
    records: list[dict[str, Any]] = []
    shown = 0  # records already sent in a TEXT_DELTA
    progress = PacedProgress(ctx)

    def scored(token: int, lp: tuple[float, list[tuple[int, float]]]) -> dict[str, Any]:
        word = lambda i: m.detokenizer.decode([i])  # noqa: E731
        return {"token": word(token), "id": token, "logprob": lp[0],
                "top": [{"token": word(i), "id": i, "logprob": v} for i, v in lp[1]]}

    def record(token: int, lp: tuple[float, list[tuple[int, float]]] | None) -> None:
        if lp is not None:
            records.append(scored(token, lp))

    prompt_records = None
    if request.prompt_logprobs is not None:  # the PROMPT_LOGPROBS extension: before the generation's prefill
        if not 0 <= request.prompt_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"prompt_logprobs must be in 0..{MAX_TOP_LOGPROBS}, got {request.prompt_logprobs}")
        scores = m.impl.score_prompt(ids, request.prompt_logprobs, ctx.check)  # a CANCEL stops it between tokens
        prompt_records = [scored(int(t), lp) for t, lp in zip(ids[1:], scores, strict=True)]

    def on_token(token: int, lp: tuple[float, list[tuple[int, float]]] | None) -> bool:
        nonlocal shown
        record(token, lp)
        if text is None:
            return False  # tokens() reported it
        hit = text.add(token)
        n = len(text.ids)
        if stream and (delta := text.release()):
            new, shown = records[shown:] or None, len(records)
            ctx.delta(delta, n, new)  # an abort or a CANCEL stops it here, before the delta
        else:
            progress(n)
        return hit

    def tokens(n: int) -> None:  # the decoder's per-token call: PROGRESS now unless on_token reports it
        if text is None:
            progress(n)

    # compiled (or found compiled) before the prompt's prefill: a grammar llguidance refuses is ERR invalid_request
    constraint = m.grammars.constraint(request.grammar) if request.grammar else None
    out, finish = m.impl.generate(ids, request.max_tokens, tokens, sampling=params, on_token=on_token,
                                  constraint=constraint)
    if text is None:
        final = m.detokenizer.decode(out, skip_special=True)
    else:
        text.finish()  # streamed: what no delta carried is in TEXT, whose text is all of it
        final = text.text[: text.sent]
    return Generation(final, out, finish, records if params.logprobs is not None else None,
                      prompt_logprobs=prompt_records)


__all__ = ["PacedProgress", "TextStream", "generate", "sampling_params"]
