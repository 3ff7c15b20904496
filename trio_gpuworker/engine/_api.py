"""What an engine's methods receive and return (docs/engines.md, 'The five methods'): one frozen request class per
method, the results the server turns into replies, and the Context that carries a request's progress, streamed text
and stop."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from .._errors import LocalProtocolError, ProgressViolation
from .._proto import Progress, ProgressValidator, TextDelta, WireMessage


@dataclass(frozen=True)
class LoadRequest:
    """LOAD: make the artifact servable as `model_ref`. What `Engine.load` returns is the model the other methods
    receive (`request.model`); its `dims` attribute, when it has one, is the LOADED reply's `dims`."""

    model_ref: str  # the name later requests use
    artifact_path: Path
    artifact_digest: str  # sha256, lower-case hex
    format: str  # the model's `format` in the daemon's configuration
    runtime_config: Mapping[str, Any]  # the model's runtime_config table
    # Wait for the artifact's sha256 (hashed on its own thread from the moment LOAD arrived) and raise WorkerError
    # artifact_invalid unless it is `artifact_digest`. Call it before the bytes are trusted; the server calls it
    # again once `load` returns, so a LOAD is never answered for a wrong artifact.
    verify: Callable[[], None]


@dataclass(frozen=True)
class EmbedRequest:
    """EMBED_BATCH: one vector per item of token ids."""

    model_ref: str
    model: Any  # what `load` returned for model_ref
    token_ids: list[np.ndarray]  # one int32 array per item, none empty
    pooling: str  # "mean" or "cls" ("max", "lasttoken" too to an engine that advertises gpuworker.pooling)
    normalize: bool  # each vector scaled to unit length


@dataclass(frozen=True)
class RerankRequest:
    """RERANK: one score per candidate, for how well it answers the query."""

    model_ref: str
    model: Any
    query: np.ndarray  # int32 token ids
    candidates: list[np.ndarray]  # int32 token ids each


@dataclass(frozen=True)
class GenerateRequest:
    """GENERATE: new tokens after the prompt. The sampling fields are None unless the engine advertises sampling
    (`Engine.sampling`); `stream` asks for the text as it is made (`Context.delta`, or a generator `generate`)."""

    model_ref: str
    model: Any
    prompt: np.ndarray  # int32 token ids
    max_tokens: int
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: list[str] | None = None
    logprobs: int | None = None  # alternatives to report per token
    prompt_logprobs: int | None = None  # alternatives per prompt token: the PROMPT_LOGPROBS extension
    grammar: str | None = None  # the GRAMMAR extension's: a Lark grammar the tokens must follow (engines with it)


@dataclass(frozen=True)
class UnloadRequest:
    """UNLOAD: `model_ref` is gone from the engine's models once this returns (or raises)."""

    model_ref: str
    model: Any


@dataclass(frozen=True)
class Generation:
    """What `generate` returns (or a generator `generate` returns at its end): the TEXT reply."""

    text: str
    token_ids: Sequence[int] = ()
    finish_reason: str = "length"  # "stop" (the model ended it) or "length" (max_tokens reached)
    logprobs: list[dict[str, Any]] | None = None  # one record per token, when the request asked for them
    prompt_logprobs: list[dict[str, Any]] | None = None  # one record per prompt token after the first, if asked
    n_gen: int | None = None  # tokens generated; default len(token_ids)


@dataclass(frozen=True)
class Ranking:
    """What `rerank` may return instead of bare scores: the scores and how they were computed (SCORES `method`)."""

    scores: Sequence[float] | np.ndarray
    method: str | None = None


class Reporter(Protocol):
    """The server's side of a Context: called, it queues PROGRESS (with `post` False it only checks for a stop);
    `notice` queues another message of the request. Both raise the request's stop."""

    def __call__(self, completed: int, phase: str, post: bool = True) -> None: ...

    def notice(self, msg: WireMessage) -> None: ...


class _Detached:
    """A Context's reporter outside a server (an engine's own unit tests): nothing is sent, nothing stops."""

    def __call__(self, completed: int, phase: str, post: bool = True) -> None:
        pass

    def notice(self, msg: WireMessage) -> None:
        pass


class Context:
    """A request's line to its server, handed to every engine method (docs/engines.md, 'Progress, CANCEL and
    deadlines'). `Context(req_id)` alone, outside a server, sends nothing: for an engine's own tests."""

    def __init__(self, req_id: int, reporter: Reporter | None = None, phase: str = "inference") -> None:
        self.req_id = req_id
        self._reporter: Reporter = reporter or _Detached()
        self._progress = ProgressValidator(req_id, phase)
        self._n_gen = 0

    @property
    def completed(self) -> int:
        """The work reported so far (0 before the first report)."""
        return self._progress.completed or 0

    def progress(self, completed: int | None = None, phase: str | None = None) -> None:
        """Report completed work: PROGRESS, which renews the daemon's silence window. `completed` counts the work
        done so far (default: one more than last time) and must increase; `phase` ("setup", "inference",
        "control"; default: the one in force) never moves back. Raises WorkerError once the request is cancelled
        or the worker is shutting down: let it propagate."""
        n = self.completed + 1 if completed is None else completed
        phase = phase or self._progress.phase
        try:
            self._progress.accept(Progress(req_id=self.req_id, completed=n, phase=phase))
        except ProgressViolation as exc:
            raise LocalProtocolError(f"progress the daemon would refuse: {exc}") from exc
        self._reporter(n, phase)

    def check(self) -> None:
        """Raise WorkerError if the request was cancelled or the worker is shutting down; send nothing."""
        self._reporter(self.completed, self._progress.phase, post=False)

    def delta(self, text: str, n_gen: int | None = None, logprobs: list[dict[str, Any]] | None = None) -> None:
        """Stream text of a GENERATE that asked for it (`request.stream`): TEXT_DELTA, which renews the silence
        window like progress. `n_gen` is the tokens generated so far (default: one more than last time) and must
        increase; the deltas joined are the final Generation's text. Raises the request's stop, as `progress`."""
        n = self._n_gen + 1 if n_gen is None else n_gen
        if n <= self._n_gen:
            raise LocalProtocolError(f"TEXT_DELTA n_gen {n} does not exceed {self._n_gen}")
        self._n_gen = n
        self._reporter.notice(TextDelta(req_id=self.req_id, text=text, n_gen=n, logprobs=logprobs))


__all__ = ["Context", "EmbedRequest", "GenerateRequest", "Generation", "LoadRequest", "Ranking", "Reporter",
           "RerankRequest", "UnloadRequest"]
