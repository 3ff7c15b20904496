"""Which encoder a worker builds (runtime_config `encoder`, `threads`): fused on CPU, tinygrad-generated elsewhere."""

from __future__ import annotations

from typing import Any

import pytest

from trio_gpuworker import WorkerError
from trio_gpuworker.worker._loaders import FUSED_THREADS, encoder_for


def test_defaults_follow_the_device() -> None:
    assert encoder_for({}, "CPU") == ("fused", FUSED_THREADS)
    assert encoder_for({}, "CUDA")[0] == "graph" and encoder_for({}, "NV:1")[0] == "graph"
    assert encoder_for({"encoder": "graph"}, "CPU")[0] == "graph"
    assert encoder_for({"threads": 2}, "CPU") == ("fused", 2)


@pytest.mark.parametrize(("rc", "device", "match"), [
    ({"encoder": "turbo"}, "CPU", "encoder must be one of fused, graph, got 'turbo'"),
    ({"encoder": "fused"}, "CUDA", "encoder 'fused' runs on CPU only, not on CUDA"),
    ({"threads": 0}, "CPU", "threads must be an int within 1..8, got 0"),
    ({"threads": 9}, "CPU", "threads must be an int within 1..8"),
    ({"threads": True}, "CPU", "threads must be an int"),
    ({"threads": 2, "encoder": "graph"}, "CPU", "threads applies to the fused encoder only"),
    ({"threads": 2}, "CUDA", "threads applies to the fused encoder only"),
])
def test_bad_choices_are_config_errors(rc: dict[str, Any], device: str, match: str) -> None:
    with pytest.raises(WorkerError, match=match) as info:
        encoder_for(rc, device)
    assert info.value.code == "config_invalid"
