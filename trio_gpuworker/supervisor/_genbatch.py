"""Batched generation in the daemon (the PACKED extension): concurrent generate requests for one model on one lane
become the sequences of one batch, decoded together by GENERATE_PACKED chunks, still one request in flight.

Each chunk tells the worker which sequences join (their prompts and sampling), which leave (their callers went),
and runs CHUNK_STEPS decode steps (STREAM_STEPS while one streams); a request that arrives while a chunk runs
joins at the next one, without waiting for the batch to finish. There is no task of its own: a waiting caller runs
the next chunk when none is in flight (shielded: its leaving cannot abandon the others' chunk), and every chunk's
answer is applied by the lane's `on_result`. An error of a chunk (a crash, a restart, an ERR) fails every
sequence of the batch with it (fan-out: none is lost, none gets another's text). Used only with a worker that
advertised PACKED, for requests the batch serves (no logprobs; a grammar only when it also advertised GRAMMAR); a
model whose decoder does not batch answers ERR unsupported_request once, and that lane's requests for it go one at
a time from then on.
"""

from __future__ import annotations

import itertools
import math
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import trio

from .._errors import BrokenWorkerError, DeadlineExceeded, InvalidRequest, WorkerError
from .._proto import EXT_GRAMMAR, EXT_PACKED, PACKED_SLOTS, GeneratePacked, Texts, WireMessage, advertised

if TYPE_CHECKING:
    from ._admission import Timing
    from ._lane import Lane

CHUNK_STEPS = 8  # decode steps per chunk: the longest a new request waits to join, in steps of the batch
STREAM_STEPS = 1  # while a sequence streams: its text goes out token by token, as GENERATE's TEXT_DELTAs do
JOIN_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream", "grammar")
OnDelta = Callable[[dict[str, Any]], None]


class _Waiter:
    """One caller's sequence: what it asked, what came back so far, and how it ended."""

    def __init__(self, seq: int, fields: dict[str, Any], ids: np.ndarray, on_delta: OnDelta | None,
                 timing: Timing | None) -> None:
        self.seq, self.fields, self.ids, self.on_delta, self.timing = seq, fields, ids, on_delta, timing
        self.parts: list[str] = []
        self.unsent: list[dict[str, Any]] = []  # deltas for on_delta, which runs in the caller's task, never the lane's
        self.n_gen = 0
        self.finish: str | None = None
        self.error: BaseException | None = None
        self.fallback = False  # the model does not batch: the caller generates alone
        self.done = trio.Event()

    def flush(self) -> None:
        while self.unsent and self.on_delta is not None:
            self.on_delta(self.unsent.pop(0))

    def end(self, error: BaseException | None = None, *, fallback: bool = False) -> None:
        if not self.done.is_set():
            self.error, self.fallback = error, fallback
            self.done.set()


class Packer:
    """The batch of one model on one lane."""

    def __init__(self, lane: Lane, model: str) -> None:
        self.lane, self.model = lane, model
        self.pending: list[_Waiter] = []  # waiting to join
        self.live: dict[int, _Waiter] = {}  # in the worker's batch
        self.leaving: list[int] = []  # in the worker's batch, their callers gone: dropped at the next chunk
        self.busy = False
        self.changed = trio.Event()  # set (and replaced) after every chunk
        self.generation: int | None = None  # the worker generation that holds the live sequences
        self.unsupported = False
        self.peak = 0  # the most sequences one chunk has decoded together
        self._held: int | None = None  # the generation told it holds the live sequences
        self._seqs = itertools.count(1)

    async def generate(self, fields: dict[str, Any], ids: np.ndarray, *, timeout: float | None,
                       on_delta: OnDelta | None, timing: Timing | None) -> dict[str, Any] | None:
        """GENERATE's answer for these fields ({text, n_prompt, n_gen, finish_reason}), decoded in the batch; None
        when the model turned out not to batch (the caller then sends GENERATE)."""
        w = _Waiter(next(self._seqs), fields, ids, on_delta, timing)
        self.pending.append(w)
        try:
            with trio.move_on_after(math.inf if timeout is None else timeout):
                while not w.done.is_set():
                    # A chunk is shielded, so a caller whose deadline passed while it drove one is cancelled only
                    # here: without this look it would drive the next chunk too, and wait out its whole sequence.
                    await trio.lowlevel.checkpoint_if_cancelled()
                    if not self.busy and (self.pending or self.live):
                        await self._chunk()
                    else:
                        await self.changed.wait()
                    w.flush()
        finally:
            if not w.done.is_set():
                self._leave(w)
        if not w.done.is_set():
            raise DeadlineExceeded(f"generate on {self.model!r} did not finish within {timeout:g} s")
        if w.fallback:
            return None
        if w.error is not None:
            raise w.error
        w.flush()
        return {"text": "".join(w.parts), "n_prompt": len(ids), "n_gen": w.n_gen, "finish_reason": w.finish}

    def _leave(self, w: _Waiter) -> None:
        """`w`'s caller left: its slot is free at the next chunk."""
        w.end(DeadlineExceeded("the caller left"))
        if w in self.pending:
            self.pending.remove(w)
        elif self.live.pop(w.seq, None) is not None:
            self.leaving.append(w.seq)
        self._sync_hold()

    def _sync_hold(self) -> None:
        """The lane knows which generation holds live sequences: a roll-over or an ordered reload lets them finish
        there before that generation stops (their next chunks are pinned to it)."""
        if not self.live:
            self.generation = None  # a batch that starts again may start on another worker
        holder = self.generation
        if holder != self._held:
            if self._held is not None:
                self.lane.hold(self._held, False)
            if holder is not None:
                self.lane.hold(holder, True)
            self._held = holder

    async def _chunk(self) -> None:
        live = list(self.live)
        # while the lane hands over to a fresh worker, the batch that holds the old one only finishes
        joining = [] if live and self.lane.handing_over else self.pending[: PACKED_SLOTS - len(live)]
        del self.pending[: len(joining)]
        leave, self.leaving = self.leaving, []
        for w in joining:
            self.live[w.seq] = w
        self.peak = max(self.peak, len(self.live))
        streams = any(w.on_delta is not None for w in self.live.values())
        request = GeneratePacked(
            model_ref=self.model, steps=STREAM_STEPS if streams else CHUNK_STEPS, leave=leave, live=live,
            join=[{"seq": w.seq, "n_tokens": len(w.ids), **{k: w.fields[k] for k in JOIN_FIELDS if k in w.fields}}
                  for w in joining],
            raw=b"".join(w.ids.tobytes() for w in joining))
        self.busy, settled = True, False

        def started() -> None:
            self.generation = self.lane.generation
            self._sync_hold()
            for w in joining:
                if w.timing is not None:
                    w.timing.started()

        def on_result(reply: WireMessage | None, error: BaseException | None) -> None:
            nonlocal settled
            if not settled:
                settled = True
                self._apply(reply, error)

        try:
            # Shielded: the chunk carries the other callers' sequences, so the caller that happens to drive it
            # leaving (it waits at most one chunk more) must not abandon it. Live sequences exist only in the
            # generation that holds them: another one fails them (BrokenWorkerError).
            with trio.CancelScope(shield=True):
                await self.lane.call(request, on_result=on_result, on_started=started,
                                     generation=self.generation if live else None)
        except Exception as exc:  # every sequence of the chunk gets it, through on_result
            on_result(None, exc)

    def _apply(self, reply: WireMessage | None, error: BaseException | None) -> None:
        """A chunk's answer: each sequence's text and end, or the error that ends the whole batch."""
        self.busy = False
        try:
            if error is not None or not isinstance(reply, Texts):
                fallback = isinstance(error, WorkerError) and error.code == "unsupported_request"
                self.unsupported = self.unsupported or fallback
                for w in list(self.live.values()):
                    w.end(error or BrokenWorkerError("GENERATE_PACKED ended without an answer"), fallback=fallback)
                if fallback:
                    for w in self.pending:
                        w.end(fallback=True)
                    self.pending.clear()
                self.live.clear()
                self.leaving.clear()
                self.generation = None
                return
            for f in reply.failed or []:
                if (w := self.live.pop(f["seq"], None)) is not None:
                    w.end(InvalidRequest(f"{f['code']}: {f['msg']}"))
            for r in reply.seqs:
                if (w := self.live.get(r["seq"])) is None:
                    continue  # its caller left during the chunk: it is in `leaving`, or the worker dropped it
                w.parts.append(r["text"])
                w.n_gen = r["n_gen"]
                if w.timing is not None:
                    w.timing.token(w.n_gen)
                if r["text"] and w.on_delta is not None:
                    w.unsent.append({"text": r["text"], "n_gen": w.n_gen})
                if r["finish_reason"] is not None:
                    w.finish = r["finish_reason"]
                    del self.live[w.seq]
                    w.end()
        finally:
            self._sync_hold()
            self.changed.set()
            self.changed = trio.Event()


_PACKERS: weakref.WeakKeyDictionary[Lane, dict[str, Packer]] = weakref.WeakKeyDictionary()


def packer_for(lane: Lane, model: str, fields: dict[str, Any]) -> Packer | None:
    """The batch a GENERATE with these fields joins on `lane`, or None when it goes alone: the lane's worker did not
    advertise PACKED (or, for a grammar, GRAMMAR: the lone GENERATE is then refused, naming it), the model does not
    batch, or the request needs what a batch does not do (logprobs)."""
    if "logprobs" in fields:
        return None
    gen = lane.gens.get(lane.generation)
    has = advertised(gen.wp.hello) if gen is not None else frozenset()
    if EXT_PACKED not in has or (fields.get("grammar") and EXT_GRAMMAR not in has):
        return None
    packer = _PACKERS.setdefault(lane, {}).setdefault(model, Packer(lane, model))
    return None if packer.unsupported else packer


__all__ = ["CHUNK_STEPS", "Packer", "packer_for"]
