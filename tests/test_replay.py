"""A captured graph of the fused decoder runs straight through its program's runtime (ckernel.Replay): the same
tokens and logits, bit for bit, as TinyJit's own replay of it; and it starts only once the graph is captured."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from gguf import GGMLQuantizationType as T  # noqa: E402

from tests.support.tiny_gguf import write_llama  # noqa: E402
from trio_gpuworker.models import ckernel  # noqa: E402
from trio_gpuworker.models.greedy import BATCH, PREFILL_CHUNK  # noqa: E402
from trio_gpuworker.models.llama_fused import FusedLlamaLM  # noqa: E402

PROMPT = np.random.default_rng(5).integers(3, 250, PREFILL_CHUNK + 9).astype(np.int32)


@pytest.fixture(scope="module")
def path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_llama(tmp_path_factory.mktemp("gguf") / "r.gguf", {"attn_q": T.Q4_1, "ffn_down": T.Q4_K})


def _outputs(lm: FusedLlamaLM) -> tuple[list[int], bytes, list[list[int]]]:
    got, _ = lm.generate(PROMPT, 8, ignore_eos=True)
    logits = lm._logits().tobytes()
    batched = lm._batched_step([3, 4, 5], [0, 1, 2], [1, 2, 3])
    return got, logits, [batched]


def test_straight_runs_give_what_the_jit_replays_give(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    lm = FusedLlamaLM.load(path, max_context=64, warmup=False)
    assert lm._runs == {}
    straight = [_outputs(lm) for _ in range(3)]  # the first runs capture; later ones run straight through
    assert set(lm._runs) == {1, PREFILL_CHUNK, BATCH}
    assert all(isinstance(r, ckernel.Replay) for r in lm._runs.values())
    lm._runs.clear()
    monkeypatch.setattr(ckernel.Replay, "of", staticmethod(lambda jit, inputs: None))  # TinyJit's replay only
    assert _outputs(lm) == straight[0] == straight[-1]
    assert lm._runs == {}


def test_a_graph_not_captured_has_no_straight_run(path: Path) -> None:
    lm = FusedLlamaLM.load(path, max_context=64, warmup=False)
    ids = lm._ids[1]
    assert ckernel.Replay.of(lm._jits[1], [ids]) is None  # never called: nothing captured
    lm._decode_step(3, 0)  # TinyJit's first call runs the function itself, the second captures it
    assert ckernel.Replay.of(lm._jits[1], [ids]) is None
    lm._decode_step(3, 0)
    assert ckernel.Replay.of(lm._jits[1], [ids]) is not None
