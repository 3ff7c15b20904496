"""Choosing the next token from a decoder's logits: temperature, top-k, top-p and a seeded generator, plus the
log probabilities OpenAI's `logprobs` reports. Pure numpy, shared by both decoders.

Reproducibility: a request with a `seed` draws from its own PCG64 stream, one uniform per token, so the same
seed, prompt and weights give the same text on any worker of any generation. Log probabilities are the model's
own (a log-softmax of the raw logits), as vLLM and llama.cpp's server report them, whatever the temperature.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

import numpy as np

from .._proto import MAX_TOP_LOGPROBS


@dataclass(frozen=True)
class SamplingParams:
    """What GENERATE asked for. temperature 0 is greedy (top_k/top_p/seed then change nothing)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no cut
    seed: int | None = None  # None: a fresh random stream per request
    logprobs: int | None = None  # None: none; n: the chosen token's and the n most likely alternatives

    def __post_init__(self) -> None:
        if not 0.0 <= self.temperature <= 2.0:
            raise ValueError(f"temperature must be in 0..2, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"logprobs must be in 0..{MAX_TOP_LOGPROBS}, got {self.logprobs}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_logits(self) -> bool:
        return not self.greedy or self.logprobs is not None


GREEDY = SamplingParams()


class Sampler:
    """One request's sampling state: its random stream lives as long as the request."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        seed = params.seed if params.seed is not None else secrets.randbits(64)
        self._rng = np.random.Generator(np.random.PCG64(seed))

    def pick(self, logits: np.ndarray) -> int:
        """The next id from float32 logits (V,): the argmax when greedy, else a draw from the cut distribution."""
        p = self.params
        if p.greedy:
            return int(np.argmax(logits))
        z = logits.astype(np.float64) / p.temperature
        if p.top_k and p.top_k < len(z):
            # ties at the k-th value are all kept: the cut must not depend on how argpartition orders them
            kth = np.partition(z, len(z) - p.top_k)[len(z) - p.top_k]
            z = np.where(z >= kth, z, -np.inf)
        z -= z.max()
        probs = np.exp(z)
        probs /= probs.sum()
        u = self._rng.random()
        if p.top_p >= 1.0:  # the whole (top-k cut) distribution, in id order: no sort
            return min(int(np.searchsorted(np.cumsum(probs), u, side="right")), len(probs) - 1)
        order = self._nucleus(probs, p.top_p)
        kept = probs[order] / probs[order].sum()
        return int(order[min(int(np.searchsorted(np.cumsum(kept), u, side="right")), len(order) - 1)])

    @staticmethod
    def _nucleus(probs: np.ndarray, top_p: float) -> np.ndarray:
        """The smallest most-likely-first prefix of ids whose mass reaches `top_p` (ties in id order). Only the
        top m are sorted, m growing until they hold that mass: a full sort of the vocabulary costs ms a token."""
        m = 64
        while True:
            m = min(m, len(probs))
            top = np.argpartition(-probs, m - 1)[:m] if m < len(probs) else np.arange(len(probs))
            top = top[np.lexsort((top, -probs[top]))]
            cum = np.cumsum(probs[top])
            if cum[-1] >= top_p or m == len(probs):
                return top[: int(np.searchsorted(cum, top_p)) + 1]
            m *= 8


def log_softmax(logits: np.ndarray) -> np.ndarray:
    z = logits.astype(np.float64)
    z -= z.max()
    return z - np.log(np.exp(z).sum())


def token_logprobs(logits: np.ndarray, chosen: int, n_top: int) -> tuple[float, list[tuple[int, float]]]:
    """(log p of `chosen`, the `n_top` most likely ids with theirs, most likely first)."""
    lp = log_softmax(logits)
    top = np.argpartition(-lp, n_top - 1)[:n_top] if 0 < n_top < len(lp) else np.arange(min(n_top, len(lp)))
    top = top[np.lexsort((top, -lp[top]))]
    return float(lp[chosen]), [(int(i), float(lp[i])) for i in top]


__all__ = ["GREEDY", "MAX_TOP_LOGPROBS", "Sampler", "SamplingParams", "log_softmax", "token_logprobs"]
