"""Several sequences decoded together: one batched step advances each of up to BATCH sequences by one token.

Each sequence has its own KV cache slot, position, stop condition and sampler; the step reads the weights once for
all of them (decode is memory bound). A sequence joins with a prefill into its slot at any step, and leaves, freeing
its slot, when it finishes or its caller goes. The per-token rules are generate()'s (greedy.py), in the same
order, and the batched kernel computes every row as the one-token kernel does, so a sequence's ids are bit for bit
the ones generate() gives for it alone.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from .constraint import Constraint
from .greedy import BATCH, GreedyDecoder, OnToken
from .sampling import GREEDY, Sampler, SamplingParams, token_logprobs


class Sequence:
    """One sequence of a Batch: its slot, its position, the ids generated so far, and how it ended."""

    def __init__(self, slot: int, n_prompt: int, max_tokens: int, sampling: SamplingParams, ignore_eos: bool,
                 on_token: OnToken | None, constraint: Constraint | None = None) -> None:
        self.slot, self.n_prompt, self.max_tokens = slot, n_prompt, max_tokens
        self.sampling, self.sampler, self.ignore_eos, self.on_token = sampling, Sampler(sampling), ignore_eos, on_token
        self.constraint = constraint  # its grammar (models/constraint.py), or None
        self.pos = n_prompt  # where the next decoded token goes
        self.ids: list[int] = []
        self.finish: str | None = None  # "stop" | "length" once done


class Batch:
    """The sequences decoding together on one decoder (one Batch per decoder: it owns cache slots 1..BATCH)."""

    def __init__(self, lm: GreedyDecoder) -> None:
        if not lm.batches:
            raise ValueError(f"{type(lm).__name__} does not batch sequences")
        self.lm = lm
        self.live: list[Sequence] = []
        self._free = list(range(BATCH, 0, -1))

    @property
    def full(self) -> bool:
        return not self._free

    def join(self, prompt_ids: np.ndarray, max_tokens: int, *, sampling: SamplingParams = GREEDY,
             ignore_eos: bool = False, on_token: OnToken | None = None,
             constraint: Constraint | None = None) -> Sequence:
        """Prefill a new sequence into a free slot and take its first token (it may finish at once: then it has
        already left). ValueError for a prompt generate() refuses; RuntimeError when every slot is taken."""
        ids = self.lm.check_prompt(prompt_ids, max_tokens)
        if self.full:
            raise RuntimeError(f"all {BATCH} sequences of the batch are in use")
        # the free slot holding the longest part of this prompt already (the most recently freed on a tie)
        slot = max(reversed(self._free), key=lambda s: self.lm.reused(ids, s))
        self._free.remove(slot)
        seq = Sequence(slot, len(ids), max_tokens, sampling, ignore_eos, on_token, constraint)
        self.live.append(seq)
        self._take(seq, self.lm.prefill(ids, seq.slot), 0)
        return seq

    def leave(self, seq: Sequence) -> None:
        """Drop `seq` (finished, or its caller left): its slot is free for the next join."""
        if seq in self.live:
            self.live.remove(seq)
            self._free.append(seq.slot)

    def step(self) -> list[Sequence]:
        """One token more for every live sequence: the ones that took part (finished ones have left)."""
        seqs = list(self.live)
        if not seqs:
            return []
        nxt = self.lm._batched_step([s.ids[-1] for s in seqs], [s.pos for s in seqs], [s.slot for s in seqs])
        for row, (s, t) in enumerate(zip(seqs, nxt, strict=True)):
            s.pos += 1
            self._take(s, t, row)
        return seqs

    def _take(self, s: Sequence, nxt: int, row: int) -> None:
        """generate()'s loop body for the id the last step predicted for `s` (row `row` of its logits)."""
        lp = None
        if s.constraint is not None:
            nxt, lp = self.lm._constrained(nxt, s.constraint, s.sampler, row)
            if s.constraint.done and nxt not in self.lm.eos_ids:  # nothing may follow: generate() ends here too
                s.ids.append(nxt)
                if s.on_token is not None:
                    s.on_token(nxt, lp)
                return self._end(s, "stop")
        elif s.sampling.needs_logits:
            logits = self.lm._logits(row)
            nxt = nxt if s.sampling.greedy else s.sampler.pick(logits)
            if s.sampling.logprobs is not None:
                lp = token_logprobs(logits, nxt, s.sampling.logprobs)
        if nxt in self.lm.eos_ids and not s.ignore_eos:
            return self._end(s, "stop")
        s.ids.append(nxt)
        if s.on_token is not None and s.on_token(nxt, lp):
            return self._end(s, "stop")
        if len(s.ids) == s.max_tokens:
            return self._end(s, "length")
        return None

    def _end(self, s: Sequence, reason: str) -> None:
        s.finish = reason
        self.leave(s)


def generate_together(lm: GreedyDecoder, prompts: list[np.ndarray], max_tokens: int,
                      join_at: Callable[[int], int] = lambda i: 0) -> list[tuple[list[int], str]]:
    """Each prompt's (ids, finish reason), decoded in one Batch, prompt i joining before step `join_at(i)` (or as
    soon after as a slot is free): what tests and benchmarks compare with generate() alone."""
    batch, pending, seqs = Batch(lm), list(range(len(prompts))), {}
    step = 0
    while pending or batch.live:
        while pending and join_at(pending[0]) <= step and not batch.full:
            i = pending.pop(0)
            seqs[i] = batch.join(prompts[i], max_tokens)
        batch.step()
        step += 1
    return [(seqs[i].ids, seqs[i].finish or "") for i in range(len(prompts))]


__all__ = ["Batch", "Sequence", "generate_together"]
