"""worker/_genbatch.py: a decoder that cannot batch (the graph decoder, `batches = False`) is refused with the typed
ERR the daemon falls back on (unsupported_request), before any sequence is kept."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from trio_gpuworker import WorkerError
from trio_gpuworker._proto import GeneratePacked
from trio_gpuworker.models.llama import LlamaLM
from trio_gpuworker.models.llama_fused import FusedLlamaLM
from trio_gpuworker.worker._genbatch import PackedGeneration


def test_only_the_fused_decoder_says_it_batches() -> None:
    """The flag the refusal below reads: the graph decoder has no batched step, the fused one has."""
    assert LlamaLM.batches is False and FusedLlamaLM.batches is True
    assert FusedLlamaLM._batched_step is not LlamaLM._batched_step


def test_a_decoder_that_does_not_batch_is_refused_as_unsupported() -> None:
    packed = PackedGeneration()
    served = SimpleNamespace(impl=SimpleNamespace(batches=LlamaLM.batches))  # as a loaded graph decoder
    msg = GeneratePacked(model_ref="lm", steps=2, join=[], leave=[], live=[], raw=b"")
    with pytest.raises(WorkerError) as info:
        packed.run(served, msg, lambda *a, **k: None)
    assert info.value.code == "unsupported_request"
    assert "does not batch" in info.value.message
    assert packed.batches == {}  # nothing kept: the next chunk starts clean
