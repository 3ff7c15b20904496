"""Which SmolLM2 decoder a worker builds (runtime_config `decoder`): fused on CPU, tinygrad-generated elsewhere."""

from __future__ import annotations

import pytest

from trio_gpuworker import WorkerError
from trio_gpuworker._kinds import AUTO_THREADS
from trio_gpuworker.worker._loaders import decoder_for


def test_defaults_follow_the_device() -> None:
    assert decoder_for({}, "CPU") == ("fused", AUTO_THREADS)  # the node's share of its cores, each step
    assert decoder_for({}, "CUDA")[0] == "graph" and decoder_for({}, "NV:1")[0] == "graph"
    assert decoder_for({"decoder": "graph"}, "CPU")[0] == "graph"
    assert decoder_for({"threads": 2}, "CPU") == ("fused", 2)


@pytest.mark.parametrize(("rc", "device", "match"), [
    ({"decoder": "turbo"}, "CPU", "decoder must be one of fused, graph, got 'turbo'"),
    ({"decoder": "fused"}, "CUDA", "decoder 'fused' runs on CPU only, not on CUDA"),
    ({"threads": 2, "decoder": "graph"}, "CPU", "threads applies to the fused decoder only"),
    ({"threads": 2}, "CUDA", "threads applies to the fused decoder only"),
    ({"threads": 9}, "CPU", "threads"),
])
def test_bad_choices_are_config_errors(rc: dict[str, str], device: str, match: str) -> None:
    with pytest.raises(WorkerError, match=match) as info:
        decoder_for(rc, device)
    assert info.value.code == "config_invalid"
