"""Generation shared by the decoders: prompt checks, chunked prefill, the decode loop, stop tokens, sampling.

A decoder supplies two replays of its captured graphs: `_prefill_step` (a PREFILL_CHUNK-row chunk, padded)
and `_decode_step` (one token); both return the greedy next id, and `_logits()` then reads that step's logits
(only sampling and logprobs read them, so greedy decoding costs what it did). A decoder that can batch
(`batches`) also has `_batched_step`: one token of each of up to BATCH sequences, each in its own KV cache slot
(1..BATCH; generate() uses slot 0), which models/batched.py drives.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from .._proto import PACKED_SLOTS
from ..gguf_file import GGUFTensor, end_of_generation_ids
from . import quant
from .architectures import BIASES, HEAD_NORMS, architecture, optional
from .constraint import Constraint
from .sampling import GREEDY, Sampler, SamplingParams, token_logprobs

PREFILL_CHUNK = 32
BATCH = PACKED_SLOTS  # sequences in one batched decode step (models/batched.py): the protocol's batch


class GreedyDecoder(abc.ABC):
    max_context: int
    vocab_size: int
    eos_ids: set[int]
    _prefill: Any  # the TinyJits of a chunk and of one token
    _decode: Any
    batches = False  # has _batched_step and BATCH + 1 cache slots

    def _hparams(self, kv: dict[str, Any], raw: Mapping[str, GGUFTensor], max_context: int) -> np.ndarray:
        """The GGUF's hyperparameters (of any architecture in models/architectures.py), onto self, with whether its
        layers have q/k/v biases and q/k head norms; returns RoPE's inverse frequencies (float64, head_dim / 2):
        base ** (-2i / head_dim), each divided by its factor where the file has `rope_freqs.weight` (llama.cpp's
        frequency factors: a Llama 3 model's rope scaling, written out per frequency)."""
        arch = architecture(kv)
        g = lambda k, d=None: kv.get(f"{arch}.{k}", d)  # noqa: E731
        self.n_layers, self.dim = int(g("block_count")), int(g("embedding_length"))
        self.n_heads, self.n_kv = int(g("attention.head_count")), int(g("attention.head_count_kv"))
        self.head_dim = int(g("attention.key_length", self.dim // self.n_heads))
        if int(g("attention.value_length", self.head_dim)) != self.head_dim:
            raise ValueError("value heads of another size than key heads are not supported")
        if int(g("rope.dimension_count", self.head_dim)) != self.head_dim:
            raise ValueError("partial RoPE is not supported")
        self.biases = optional(raw, BIASES, self.n_layers)
        self.head_norms = optional(raw, HEAD_NORMS, self.n_layers)
        self.eps = float(g("attention.layer_norm_rms_epsilon"))
        self.max_context = min(max_context, int(g("context_length")))
        self.eos_ids = end_of_generation_ids(kv)
        theta = float(g("rope.freq_base", 10000.0))
        inv_freq = theta ** (-np.arange(0, self.head_dim, 2, dtype=np.float64) / self.head_dim)
        if (factors := raw.get("rope_freqs.weight")) is None:
            return inv_freq
        if factors.shape != (self.head_dim // 2,):
            raise ValueError(f"rope_freqs.weight has shape {factors.shape}, not ({self.head_dim // 2},)")
        return inv_freq / quant.dequantize(factors.typ, factors.data).astype(np.float64)

    @abc.abstractmethod
    def _prefill_step(self, tokens: np.ndarray, start: int, last: int, slot: int = 0) -> int:
        """`tokens` (at most PREFILL_CHUNK) at positions start.. of cache `slot` -> the greedy next id after row
        `last`."""

    @abc.abstractmethod
    def _decode_step(self, token: int, pos: int) -> int:
        """`token` at position `pos` -> the greedy next id."""

    @abc.abstractmethod
    def _logits(self, row: int = 0) -> np.ndarray:
        """The float32 logits (vocab_size,) of the last step's predicted row (of a batched step's `row`), valid
        until the next step."""

    def _batched_step(self, tokens: list[int], positions: list[int], slots: list[int]) -> list[int]:
        """One token of each sequence, at its position in its cache slot -> each one's greedy next id. Only a
        decoder with `batches` has it; callers check `batches` first (models/batched.py, worker/_genbatch.py), so
        reaching this is a programming error, not a request the worker refuses."""
        raise TypeError(f"{type(self).__name__} does not batch sequences (batches is False)")

    def prefill(self, ids: np.ndarray, slot: int = 0) -> int:
        """Run prompt `ids` (checked) through the chunked prefill into cache `slot`: the greedy next id. The
        positions `reused(ids, slot)` counts are already there and are not run again."""
        n, nxt = len(ids), 0
        for s in range(self.reused(ids, slot), n, PREFILL_CHUNK):
            chunk = ids[s : s + PREFILL_CHUNK].astype(np.int32)
            nxt = self._prefill_step(chunk, s, len(chunk) - 1, slot)
        self._prefilled(ids, slot)
        return nxt

    def reused(self, ids: np.ndarray, slot: int) -> int:
        """How many first positions of prompt `ids` cache `slot` already holds as their prefill computed them (all
        but the last at most: its row gives the next id). 0 here; a decoder that keeps a record of its slots'
        prompts says more (models/llama_fused.py)."""
        return 0

    def _prefilled(self, ids: np.ndarray, slot: int) -> None:
        """Prompt `ids` was prefilled into cache `slot` (for `reused`): nothing to note for a decoder that keeps no
        record."""
        return None

    def forget_prompts(self) -> None:
        """Something ran the graphs outside the steps (the JIT cache's probe replays them on zeros): what cache slots
        hold is unknown from now on. Nothing to forget for a decoder that keeps no record."""
        return None

    def score_prompt(self, prompt_ids: np.ndarray, n_top: int,
                     each: Callable[[], None] | None = None) -> list[tuple[float, list[tuple[int, float]]]]:
        """Each prompt token after the first: (its log probability after the tokens before it, the `n_top` most
        likely ids there with theirs), as `token_logprobs` reports a generated token. The prompt runs one token per
        decode step (the prefill graph's logits are its last row's only), so this costs a decode step a token; a
        `generate` after it prefills anew. `each()` runs before every step (the worker's cancellation check)."""
        ids = self.check_prompt(prompt_ids, 1)
        out = []
        for pos, token in enumerate(ids[:-1]):
            if each is not None:
                each()
            self._decode_step(int(token), pos)
            out.append(token_logprobs(self._logits(), int(ids[pos + 1]), n_top))
        return out

    def check_prompt(self, prompt_ids: np.ndarray, max_tokens: int) -> np.ndarray:
        """The prompt as a flat integer array. ValueError when max_tokens < 1, or the prompt is empty, not
        integers, holds an id outside the vocabulary, or prompt + max_tokens exceeds max_context."""
        ids = np.asarray(prompt_ids).reshape(-1)
        n = len(ids)
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        if n == 0:
            raise ValueError("empty prompt")
        if ids.dtype.kind not in "iu":
            raise ValueError(f"prompt ids must be integers, got {ids.dtype}")
        if n + max_tokens > self.max_context:
            raise ValueError(f"prompt of {n} tokens + {max_tokens} new exceeds the {self.max_context}-token context")
        # An out-of-range id would index past the embedding table rather than fail.
        if ids.min() < 0 or ids.max() >= self.vocab_size:
            raise ValueError(f"prompt holds token ids outside 0..{self.vocab_size - 1}")
        return ids

    def warmup(self, progress: Callable[[int], None] | None = None) -> None:
        """Trace and capture both JIT graphs. `progress` sees 1..4 after the (slow) first prefill calls."""
        # TinyJit runs eagerly once, captures on the second call and replays from the third: two prefill
        # chunks and three decode steps reach replay on both graphs.
        self.generate(np.zeros(PREFILL_CHUNK + 1, dtype=np.int32), 4, progress, ignore_eos=True)
        if self.batches:  # the batched graph too: three steps of two sequences reach its replay (at position 0,
            for _ in range(3):  # which each step writes before it attends to it)
                self._batched_step([0, 0], [0, 0], [1, 2])

    def generate(
        self,
        prompt_ids: np.ndarray,
        max_tokens: int,
        progress: Callable[[int], None] | None = None,
        *,
        ignore_eos: bool = False,
        sampling: SamplingParams = GREEDY,
        on_token: OnToken | None = None,
        constraint: Constraint | None = None,
    ) -> tuple[list[int], str]:
        """Continuation of `prompt_ids`: (generated ids without the stop token, "stop" | "length").

        `progress(n)` is called after each generated token (n = 1, 2, ...). `on_token(id, logprobs)` too, with
        (logprob, [(id, logprob)...]) when `sampling.logprobs` asks for them, else None; it returns True to stop
        there (a stop string was generated). `ignore_eos` keeps going past end-of-generation tokens (warm-up,
        benchmarks). `constraint` (models/constraint.py): every token is one its grammar allows, greedy or sampled,
        and generation stops where the grammar ends. ValueError when max_tokens < 1, or the prompt is empty, not
        integers, holds an id outside the vocabulary, or prompt + max_tokens exceeds max_context."""
        ids = self.check_prompt(prompt_ids, max_tokens)
        n = len(ids)
        sampler = Sampler(sampling)
        nxt = self.prefill(ids)
        out_ids: list[int] = []
        pos = n
        while True:
            lp = None
            if constraint is not None:
                nxt, lp = self._constrained(nxt, constraint, sampler)
                if constraint.done and nxt not in self.eos_ids:  # nothing may follow: end-of-generation is next
                    out_ids.append(nxt)
                    if progress is not None:
                        progress(len(out_ids))
                    if on_token is not None:
                        on_token(nxt, lp)
                    return out_ids, "stop"
            elif sampling.needs_logits:
                logits = self._logits()
                # greedy keeps the kernel's own argmax, so logprobs never change which token greedy picks
                nxt = nxt if sampling.greedy else sampler.pick(logits)
                if sampling.logprobs is not None:
                    lp = token_logprobs(logits, nxt, sampling.logprobs)
            if nxt in self.eos_ids and not ignore_eos:
                return out_ids, "stop"
            out_ids.append(nxt)
            if progress is not None:
                progress(len(out_ids))
            if on_token is not None and on_token(nxt, lp):
                return out_ids, "stop"
            if len(out_ids) == max_tokens:
                return out_ids, "length"
            nxt = self._decode_step(nxt, pos)
            pos += 1

    def _constrained(self, nxt: int, constraint: Constraint, sampler: Sampler,
                     row: int = 0) -> tuple[int, tuple[float, list[tuple[int, float]]] | None]:
        """The next token under `constraint` (taken by it) from the last step's logits row `row`, and its logprobs
        if asked. Greedy keeps the kernel's argmax `nxt` when the grammar allows it (then it is also the masked
        argmax), reading no logits; otherwise the pick is over the masked logits. Logprobs are the model's own,
        unmasked. Shared by generate() and a batch's sequences (models/batched.py)."""
        p = sampler.params
        logits = None
        if not (p.greedy and constraint.allows(nxt)):
            logits = self._logits(row)
            nxt = sampler.pick(constraint.masked(logits))
            constraint.take(nxt)
        if p.logprobs is None:
            return nxt, None
        return nxt, token_logprobs(self._logits(row) if logits is None else logits, nxt, p.logprobs)


OnToken = Callable[[int, "tuple[float, list[tuple[int, float]]] | None"], bool]
