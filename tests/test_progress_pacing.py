"""A decode's PROGRESS is paced in the worker: the first token's at once, then at most one per PROGRESS_EVERY_S,
each counting every token so far; every token still checks for a stop. GENERATE_PACKED's chunk paces its reports
the same way (PacedReport, over a handler's reporter). Time is injected."""

from __future__ import annotations

import pytest

from trio_gpuworker._errors import WorkerError
from trio_gpuworker.engine import Context
from trio_gpuworker.worker._generate import PROGRESS_EVERY_S, PacedProgress, PacedReport


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


def test_a_packed_chunk_reports_at_once_then_once_a_period_and_checks_between() -> None:
    now = [0.0]
    rec = Recorder()
    paced = PacedReport(rec, clock=lambda: now[0])
    for n in range(1, 10):
        paced(n, "inference")
        now[0] += PROGRESS_EVERY_S / 2 * 1.001  # a little over two steps a period
    assert rec.posted == [1, 3, 5, 7, 9]
    assert rec.checks == 4
    rec.stop = True
    with pytest.raises(WorkerError, match="CANCEL"):
        paced(10, "inference")
