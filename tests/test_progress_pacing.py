"""A decode's PROGRESS is paced in the worker: the first token's at once, then at most one per PROGRESS_EVERY_S,
each counting every token so far; every token still checks for a stop. GENERATE_PACKED's chunk paces its reports
the same way (through a Context over the handler's reporter). Time is injected."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from tests.support.tiny_gguf import write_llama
from trio_gpuworker._errors import WorkerError
from trio_gpuworker._proto import GeneratePacked
from trio_gpuworker.engine import Context
from trio_gpuworker.llm_tokenizer import ChatTokenizer
from trio_gpuworker.models.llama_fused import FusedLlamaLM
from trio_gpuworker.worker._genbatch import PackedGeneration
from trio_gpuworker.worker._generate import PROGRESS_EVERY_S, PacedProgress


class Recorder:
    """A Context's reporter that keeps what was posted and raises a stop once `stop` is set."""

    def __init__(self) -> None:
        self.posted: list[int] = []
        self.checks = 0
        self.stop = False

    def __call__(self, completed: int, phase: str, post: bool = True) -> None:
        if self.stop:
            raise WorkerError("request_cancelled", "CANCEL stopped this request")
        if post:
            self.posted.append(completed)
        else:
            self.checks += 1

    def notice(self, msg: object) -> None:
        raise AssertionError("a paced PROGRESS sends no other message")


def test_the_first_token_goes_at_once_and_the_rest_at_most_once_a_period() -> None:
    now = [0.0]
    rec = Recorder()
    paced = PacedProgress(Context(1, rec), clock=lambda: now[0])
    step = PROGRESS_EVERY_S / 4 * 1.001  # a little over four tokens a period
    for n in range(1, 14):
        paced(n)
        now[0] += step
    # tokens 1, 5, 9, 13 fall on a period's start; the others only check for a stop
    assert rec.posted == [1, 5, 9, 13]
    assert rec.checks == 13 - 4


def test_a_stop_is_seen_at_the_next_token_even_between_frames() -> None:
    now = [0.0]
    rec = Recorder()
    paced = PacedProgress(Context(1, rec), clock=lambda: now[0])
    paced(1)
    rec.stop = True
    with pytest.raises(WorkerError, match="CANCEL"):
        paced(2)  # within the period: no frame, but the stop is raised
    assert rec.posted == [1]



def test_a_packed_chunk_reports_its_first_work_at_once_and_checks_at_every_step(tmp_path: Path) -> None:
    """GENERATE_PACKED's chunk paces through the same PacedProgress: within one period, its prefill's report is the
    only PROGRESS and each of its eight decode steps checks for a stop; a period later the next step reports."""
    path = write_llama(tmp_path / "k.gguf", {"attn_q": T.Q4_K}, tied=True)
    served = SimpleNamespace(impl=FusedLlamaLM.load(path, max_context=64, warmup=False),
                             detokenizer=ChatTokenizer.from_gguf(path), grammars=None)
    now = [0.0]
    packed, rec = PackedGeneration(clock=lambda: now[0]), Recorder()
    join = [{"seq": 1, "n_tokens": 3, "max_tokens": 20}]
    prompt = np.array([3, 17, 101], "<i4").tobytes()
    msg = GeneratePacked(model_ref="lm", steps=8, join=join, leave=[], live=[], raw=prompt)
    packed.run(served, msg, rec)
    assert (rec.posted, rec.checks) == ([1], 8)
    now[0] += PROGRESS_EVERY_S
    packed.run(served, GeneratePacked(model_ref="lm", steps=2, join=[], leave=[], live=[1], raw=b""), rec)
    assert (rec.posted, rec.checks) == ([1, 1], 9)  # the next chunk's first step (its own count), then a check
