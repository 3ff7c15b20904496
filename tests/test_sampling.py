"""The sampler (models/sampling.py) on its own: its draws follow the cut distribution, a seed reproduces them,
and its log probabilities are numpy's log-softmax."""

from __future__ import annotations

import numpy as np
import pytest

from trio_gpuworker.models.sampling import Sampler, SamplingParams, log_softmax, token_logprobs

LOGITS = np.log(np.array([0.5, 0.2, 0.15, 0.1, 0.05], dtype=np.float64)).astype(np.float32)


def _draws(params: SamplingParams, n: int = 20000, logits: np.ndarray = LOGITS) -> np.ndarray:
    s = Sampler(params)
    return np.bincount([s.pick(logits) for _ in range(n)], minlength=len(logits)) / n


def test_greedy_is_the_argmax() -> None:
    assert Sampler(SamplingParams()).pick(np.array([0.1, 3.0, 3.0, -1], np.float32)) == 1


def test_temperature_one_follows_the_softmax() -> None:
    freq = _draws(SamplingParams(temperature=1.0, seed=1))
    assert np.abs(freq - np.exp(log_softmax(LOGITS))).max() < 0.015


def test_temperature_sharpens_and_flattens() -> None:
    for t in (0.5, 1.5):
        want = np.exp(log_softmax(LOGITS / t))
        assert np.abs(_draws(SamplingParams(temperature=t, seed=2)) - want).max() < 0.015


def test_top_k_keeps_the_k_most_likely() -> None:
    freq = _draws(SamplingParams(temperature=1.0, top_k=2, seed=3))
    assert freq[2:].sum() == 0 and abs(freq[0] - 0.5 / 0.7) < 0.015


def test_top_p_keeps_the_smallest_prefix_reaching_p() -> None:
    freq = _draws(SamplingParams(temperature=1.0, top_p=0.8, seed=4))  # 0.5 + 0.2 < 0.8 <= 0.85
    assert freq[3:].sum() == 0 and abs(freq[2] - 0.15 / 0.85) < 0.015


def test_top_p_over_a_large_vocabulary() -> None:
    """The nucleus grows past its first guess of 64 ids when they do not hold the mass."""
    logits = np.zeros(5000, np.float32)
    freq = _draws(SamplingParams(temperature=1.0, top_p=0.5, seed=5), n=5000, logits=logits)
    assert np.count_nonzero(freq) > 1000 and freq[2600:].sum() == 0


def test_a_seed_reproduces_the_draws() -> None:
    a = [Sampler(SamplingParams(temperature=1.0, seed=9)).pick(LOGITS) for _ in range(50)]
    b = [Sampler(SamplingParams(temperature=1.0, seed=9)).pick(LOGITS) for _ in range(50)]
    s1, s2 = Sampler(SamplingParams(temperature=1.0, seed=9)), Sampler(SamplingParams(temperature=1.0, seed=10))
    assert a == b
    assert [s1.pick(LOGITS) for _ in range(50)] != [s2.pick(LOGITS) for _ in range(50)]


def test_logprobs_are_the_log_softmax() -> None:
    chosen, top = token_logprobs(LOGITS, 3, 2)
    assert chosen == pytest.approx(np.log(0.1), abs=1e-6)
    assert [i for i, _ in top] == [0, 1] and top[0][1] == pytest.approx(np.log(0.5), abs=1e-6)
    assert token_logprobs(LOGITS, 0, 0)[1] == []


@pytest.mark.parametrize("bad", [dict(temperature=-0.1), dict(temperature=2.5), dict(top_p=0.0), dict(top_p=1.1),
                                 dict(top_k=-1), dict(logprobs=6)])
def test_out_of_range_parameters_are_refused(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**bad)  # type: ignore[arg-type]
