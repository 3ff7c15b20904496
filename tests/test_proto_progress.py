"""ProgressValidator: the current request only, strictly increasing counts, phases only forward."""

from __future__ import annotations

import pytest

from trio_gpuworker._errors import ProgressViolation, RemoteProtocolError
from trio_gpuworker._proto import Progress, ProgressValidator


def progress(completed: int, phase: str = "inference", req_id: int = 7) -> Progress:
    return Progress(req_id=req_id, completed=completed, phase=phase)


def test_increasing_counts_are_accepted() -> None:
    v = ProgressValidator(7, "inference")
    assert v.completed is None
    for n in (0, 1, 5, 1 << 63):
        assert v.accept(progress(n)) == "inference"
        assert v.completed == n


def test_phase_moves_forward() -> None:
    v = ProgressValidator(7, "setup")
    assert v.accept(progress(1, "setup")) == "setup"
    assert v.accept(progress(2, "inference")) == "inference"
    assert v.phase == "inference"
    assert v.accept(progress(3, "control")) == "control"


def test_phase_may_skip_forward() -> None:
    assert ProgressValidator(7, "setup").accept(progress(1, "control")) == "control"


@pytest.mark.parametrize("req_id", [6, 8, 0])
def test_wrong_req_id(req_id: int) -> None:
    v = ProgressValidator(7, "inference")
    with pytest.raises(ProgressViolation):
        v.accept(progress(1, req_id=req_id))


@pytest.mark.parametrize("second", [2, 1, 0])
def test_count_must_strictly_increase(second: int) -> None:
    v = ProgressValidator(7, "inference")
    v.accept(progress(2))
    with pytest.raises(ProgressViolation):
        v.accept(progress(second))


@pytest.mark.parametrize(("start", "back"), [("inference", "setup"), ("control", "inference"),
                                             ("control", "setup")])
def test_phase_regress_from_the_start(start: str, back: str) -> None:
    with pytest.raises(ProgressViolation):
        ProgressValidator(7, start).accept(progress(1, back))


def test_phase_regress_after_moving_forward() -> None:
    v = ProgressValidator(7, "setup")
    v.accept(progress(1, "inference"))
    with pytest.raises(ProgressViolation):
        v.accept(progress(2, "setup"))


def test_rejected_frame_changes_nothing() -> None:
    v = ProgressValidator(7, "setup")
    v.accept(progress(3, "inference"))
    for bad in (progress(3, "control"), progress(4, "setup"), progress(9, req_id=8)):
        with pytest.raises(ProgressViolation):
            v.accept(bad)
        assert (v.completed, v.phase) == (3, "inference")
    assert v.accept(progress(4, "inference")) == "inference"


def test_violation_is_a_remote_protocol_error() -> None:
    assert issubclass(ProgressViolation, RemoteProtocolError)
    assert ProgressViolation.code == "progress_violation"
