"""One path from the serving API to `Lane.call` for every request kind: embed, rerank and generate.

What every kind does alike is written here once: the deadline, admission against the model's byte budget, the
lane choice and the check of the reply (the model was looked up and kind-checked when its request was built,
_api_requests.py). A `Route` says what differs per kind: its reply's class, and how a reply must fit its request.
A request that passes a Route's checks reaches the worker as its class (`Lane.call`), and its reply comes back as
its class.

Embeddings choose their lanes themselves (a large job is spread over idle replicas, _dispatch.py) and may be
merged with other callers' (_batching.py): they take the model, the deadline and admission from a `Flight`, and
reach the lane through `send`, as the other kinds do.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, TypeVar

import trio

from .._errors import DeadlineExceeded, InvalidRequest, RemoteProtocolError
from .._proto import EmbedBatch, Generate, Rerank, Scores, Text, Vectors, WireMessage

if TYPE_CHECKING:
    from .._config import ModelConfig
    from ._admission import Scheduler, Ticket, Timing
    from ._gate import ModelGate
    from ._lane import Lane

Q = TypeVar("Q", bound=WireMessage)
R = TypeVar("R", bound=WireMessage)


@dataclass(frozen=True)
class Route(Generic[Q, R]):
    """What one request kind supplies; everything else is the same for all."""

    reply: type[R]  # its terminal reply (ERR is raised by the lane as WorkerError)
    misfit: Callable[[Q, R], str | None]  # what is wrong with a well-formed reply to this request, or None


def _vectors_misfit(request: EmbedBatch, reply: Vectors) -> str | None:
    rows = len(request.items)
    if reply.n != rows or len(reply.raw) != reply.n * reply.dims * 4:
        return f"n={reply.n} dims={reply.dims} raw_len={len(reply.raw)} for {rows} rows"
    return None


def _scores_misfit(request: Rerank, reply: Scores) -> str | None:
    docs = len(request.candidates)
    if reply.n != docs or len(reply.raw) != 4 * docs:
        return f"n={reply.n} raw_len={len(reply.raw)} for {docs} documents"
    return None


EMBEDDINGS: Route[EmbedBatch, Vectors] = Route(Vectors, _vectors_misfit)
RERANKING: Route[Rerank, Scores] = Route(Scores, _scores_misfit)
GENERATION: Route[Generate, Text] = Route(Text, lambda request, reply: None)


async def send(lane: Lane, request: Q, route: Route[Q, R], *, timeout: float | None,
               on_settled: Callable[[], None] | None = None, on_started: Callable[[], None] | None = None,
               on_progress: Callable[[WireMessage], None] | None = None) -> R:
    """`request` on `lane`, and its reply once checked against it (RemoteProtocolError if it does not fit)."""
    reply = await lane.call(request, timeout=timeout, on_settled=on_settled, on_started=on_started,
                            on_progress=on_progress)
    if not isinstance(reply, route.reply):  # the RequestTracker lets no other reply end it: a broken invariant
        raise RemoteProtocolError(f"{reply.T} answered {request.T}")
    if (wrong := route.misfit(request, reply)) is not None:
        raise RemoteProtocolError(f"{reply.T}: {wrong}")
    return reply


def deadline(timeout: float | None) -> float:
    """When a request with `timeout` (seconds, None: none) must be done, on trio's clock."""
    if timeout is not None and (not isinstance(timeout, int | float) or isinstance(timeout, bool)
                                or math.isnan(timeout) or timeout < 0):
        raise InvalidRequest(f"timeout must be a number of seconds >= 0, got {timeout!r}")
    return math.inf if timeout is None else trio.current_time() + timeout


def left(at: float, what: str, timeout: float | None) -> float | None:
    """Seconds left until `at` (None: no deadline); DeadlineExceeded once it has passed."""
    if math.isinf(at):
        return None
    remaining = at - trio.current_time()
    if remaining <= 0:
        raise DeadlineExceeded(f"{what} did not finish within {timeout:g} s")
    return remaining


class Flight(Generic[Q, R]):
    """One API request of one kind, from its checks to its last reply: its model (`mc`, which its request looked
    up and kind-checked), its deadline (from `start`), its admission ticket (`admit`) and its lane calls."""

    def __init__(self, route: Route[Q, R], mc: ModelConfig, scheduler: Scheduler | None,
                 pick_lane: Callable[[str], Lane], gate: ModelGate) -> None:
        self.route, self.mc, self.model = route, mc, mc.id
        self._scheduler, self._pick, self._gate = scheduler, pick_lane, gate
        self.deadline, self.timeout = math.inf, None
        self.ticket: Ticket | None = None

    def start(self, timeout: float | None) -> None:
        """The deadline runs from now (once the arguments are checked)."""
        self.deadline, self.timeout = deadline(timeout), timeout

    @asynccontextmanager
    async def admit(self, nbytes: int) -> AsyncIterator[Ticket | None]:
        """Held against the model's byte budget (the daemon's scheduler; the bare Python API has none) until the
        block exits and every lane job it started has settled; not before a change of the model's settings that
        is under way has been made (the gate)."""
        async with self._gate.serving(self.model, self.deadline):
            if self._scheduler is None:
                yield None
                return
            with self._scheduler.admit(self.model, nbytes) as self.ticket:
                yield self.ticket

    def lane(self) -> Lane:
        """The least loaded lane that serves the model now (the Supervisor's choice)."""
        return self._pick(self.model)

    def left(self, what: str) -> float | None:
        return left(self.deadline, what, self.timeout)

    def timing(self) -> Timing | None:
        return self.ticket.timing() if self.ticket is not None else None

    def settled(self) -> Callable[[], None] | None:
        """An `on_settled` for one lane job of this request: the ticket is held until it fires."""
        return self.ticket.job() if self.ticket is not None else None

    async def call(self, request: Q, what: str, *, timing: Timing | None = None,
                   on_progress: Callable[[WireMessage], None] | None = None) -> R:
        """`request` on the least loaded lane that serves the model, within what is left of the deadline."""
        timeout = self.left(what)
        lane = self.lane()
        timing = timing if timing is not None else self.timing()
        return await send(lane, request, self.route, timeout=timeout, on_settled=self.settled(),
                          on_started=timing.started if timing is not None else None, on_progress=on_progress)


__all__ = ["EMBEDDINGS", "GENERATION", "RERANKING", "Flight", "Route", "deadline", "left", "send"]
