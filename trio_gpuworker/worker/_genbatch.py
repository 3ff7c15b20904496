"""GENERATE_PACKED in the worker (the PACKED extension): the sequences of one model's batch, kept between chunks.

Each chunk drops the sequences whose callers left, prefills the joining ones into free KV cache slots, then runs up
to `steps` batched decode steps (models/batched.py); TEXTS carries each sequence's new final text and ids. A
sequence's text follows GENERATE's rules exactly (worker/_generate.py): streamed or with stop strings it goes
through a TextStream, otherwise it is the decode of all its ids at the end; a `grammar` (GRAMMAR extension)
constrains its every token, as GENERATE's does. Any error ends the whole batch: the
daemon then fails every one of its sequences, so neither side keeps one the other forgot.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from .._errors import WorkerError
from .._proto import PACKED_SLOTS, GeneratePacked, Texts
from ..engine import Context
from ..models.batched import Batch, Sequence
from ..models.sampling import SamplingParams
from ._generate import PacedProgress, TextStream


class _Seq:
    """One sequence as the worker tracks it: the decoder's Sequence, its text, and what TEXTS already carried."""

    def __init__(self, seq_id: int, detok: Any, stops: list[str], stream: bool) -> None:
        self.id = seq_id
        self.detok = detok
        self.text = TextStream(detok, stops) if stops or stream else None
        self.seq: Sequence | None = None
        self.sent_ids = 0

    def on_token(self, token: int, lp: Any) -> bool:
        return self.text.add(token) if self.text is not None else False

    def result(self) -> dict[str, Any]:
        """This chunk's part: the text now final, the ids not yet sent, and how it ended once it has."""
        assert self.seq is not None
        ids, done = self.seq.ids, self.seq.finish is not None
        if self.text is None:
            new = self.detok.decode(ids, skip_special=True) if done else ""
        else:  # the chunks' texts joined are GENERATE's streamed text
            new = self.text.finish() if done else self.text.release()
        out = {"seq": self.id, "text": new, "n_gen": len(ids), "ids": ids[self.sent_ids:],
               "finish_reason": self.seq.finish}
        self.sent_ids = len(ids)
        return out


def _sampling(j: dict[str, Any]) -> SamplingParams:
    return SamplingParams(temperature=float(j.get("temperature") or 0.0),
                          top_p=float(1.0 if j.get("top_p") is None else j["top_p"]), top_k=int(j.get("top_k") or 0),
                          seed=j.get("seed"))


class PackedGeneration:
    """Every served model's batch in this worker (one batch per model: it owns the decoder's batch cache slots)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.batches: dict[str, tuple[Any, Batch, dict[int, _Seq]]] = {}
        self.clock = clock  # PROGRESS pacing's

    def drop(self, model_ref: str) -> None:
        self.batches.pop(model_ref, None)

    def run(self, m: Any, msg: GeneratePacked, progress: Any) -> Texts:
        """One chunk on served model `m`, reporting through `progress` (the request's Reporter). ValueError for a
        request that does not fit the batch (ERR invalid_request); WorkerError unsupported_request when `m`'s
        decoder does not batch (the graph decoder): the daemon then sends that lane plain GENERATEs."""
        if not getattr(m.impl, "batches", False):
            raise WorkerError("unsupported_request", f"model {msg.model_ref!r}'s decoder does not batch sequences")
        held = self.batches.get(msg.model_ref)
        if held is None or held[0] is not m:  # a model loaded again starts a new batch
            held = self.batches[msg.model_ref] = (m, Batch(m.impl), {})
        try:
            return self._chunk(m, held[1], held[2], msg, progress)
        except BaseException:
            self.drop(msg.model_ref)  # the daemon fails every sequence of the batch on an ERR: so do we
            raise

    def _chunk(self, m: Any, batch: Batch, seqs: dict[int, _Seq], msg: GeneratePacked, progress: Any) -> Texts:
        for sid in msg.leave:
            if (s := seqs.pop(sid, None)) is not None and s.seq is not None:
                batch.leave(s.seq)
        if sorted(seqs) != sorted(msg.live):
            raise ValueError(f"the daemon's live sequences {sorted(msg.live)} are not this worker's {sorted(seqs)}")
        ids = np.frombuffer(msg.raw, dtype="<i4").astype(np.int32)
        if sum(j["n_tokens"] for j in msg.join) != len(ids):
            raise ValueError("the joining sequences' n_tokens do not add up to the ids sent")
        if len(seqs) + len(msg.join) > PACKED_SLOTS:
            raise ValueError(f"more sequences than the batch's {PACKED_SLOTS} slots")
        # a PROGRESS at once, then at most one every PROGRESS_EVERY_S (each wakes the daemon, whose turn on a core a
        # step's threads would wait for), as a GENERATE's
        paced = PacedProgress(Context(msg.req_id, progress), self.clock)
        done, at, failed = 0, 0, []
        out: list[_Seq] = list(seqs.values())
        for j in msg.join:
            prompt, at = ids[at : at + j["n_tokens"]], at + j["n_tokens"]
            stops = list(j.get("stop") or [])
            if j["seq"] in seqs or any(not s for s in stops) or j.get("logprobs") is not None:
                failed.append({"seq": j["seq"], "code": "invalid_request",
                               "msg": "a sequence id in use, an empty stop string, or logprobs (not batched)"})
                continue
            s = _Seq(j["seq"], m.detokenizer, stops, bool(j.get("stream")))
            try:
                grammar = j.get("grammar")  # the GRAMMAR extension's, as GENERATE's: compiled before the prefill
                constraint = m.grammars.constraint(grammar) if isinstance(grammar, str) and grammar else None
                s.seq = batch.join(prompt, j["max_tokens"], sampling=_sampling(j), on_token=s.on_token,
                                   constraint=constraint)
            except ValueError as exc:
                failed.append({"seq": j["seq"], "code": "invalid_request", "msg": str(exc)})
                continue
            seqs[s.id] = s
            out.append(s)
            done += 1
            paced(done)  # a prefill is completed work: it renews the inference window
        for _ in range(msg.steps):
            if not batch.live:
                break
            done += len(batch.step())
            paced(done)
        results = [s.result() for s in out]
        for s in out:
            if s.seq is not None and s.seq.finish is not None:
                seqs.pop(s.id, None)
        return Texts(req_id=msg.req_id, seqs=results, failed=failed or None)


__all__ = ["PackedGeneration"]
