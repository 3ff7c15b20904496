"""Llama variants on both decoders against transformers (float32, loading the very same GGUF): Llama 3's rope scaling
(llama.cpp's rope_freqs.weight) with an untied output matrix. A GGUF of an architecture the decoders do not run is
refused at LOAD, naming it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # transformers loads a GGUF only with it
gguf = pytest.importorskip("gguf")

from gguf import GGMLQuantizationType as T  # noqa: E402

from tests.tiny_gguf import Dims, llama3_rope_factors, write_llama  # noqa: E402
from trio_gpuworker import WorkerError  # noqa: E402
from trio_gpuworker.models.greedy import GreedyDecoder  # noqa: E402
from trio_gpuworker.worker import _jitfile, _loaders  # noqa: E402

PROMPT = [3, 17, 101, 250, 42, 7, 256, 9, 88]
N_NEW = 8
# Llama 3.1's recipe, its original context shrunk to this model's so every branch of the blend is taken
LLAMA3 = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


def _hf_greedy(model: torch.nn.Module, ids: list[int], n: int) -> tuple[list[int], np.ndarray]:
    """Greedy ids from the whole sequence each step (no cache), and the prompt's last logits."""
    seq, first = list(ids), None
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([seq])).logits[0, -1].numpy()
            first = logits if first is None else first
            seq.append(int(np.argmax(logits)))
    assert first is not None
    return seq[len(ids):], first


@pytest.fixture(scope="module")
def llama3(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[int], np.ndarray]:
    d = tmp_path_factory.mktemp("llama3")
    factors = llama3_rope_factors(Dims(), LLAMA3["rope_theta"], LLAMA3["factor"], LLAMA3["low_freq_factor"],
                                  LLAMA3["high_freq_factor"], LLAMA3["original_max_position_embeddings"])
    assert {1.0, 8.0} < set(factors.tolist())  # high, low and blended frequencies
    path = write_llama(d / "llama3.gguf", {"attn_q": T.Q8_0, "ffn_down": T.Q4_K}, tied=False, seed=3,
                       rope_freqs=factors)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(d), gguf_file=path.name, dtype=torch.float32,
                                                           rope_parameters=LLAMA3)
    assert not hf.config.tie_word_embeddings
    return path, *_hf_greedy(hf.eval(), PROMPT, N_NEW)


@pytest.mark.parametrize("decoder", ["fused", "graph"])
def test_llama3_rope_scaling_and_untied_output_match_transformers(
        llama3: tuple[Path, list[int], np.ndarray], decoder: str) -> None:
    path, want, want_logits = llama3
    if decoder == "fused":
        from trio_gpuworker.models.llama_fused import FusedLlamaLM as cls
    else:
        from trio_gpuworker.models.llama import LlamaLM as cls
    lm: GreedyDecoder = cls.load(path, max_context=64, warmup=False)
    got, reason = lm.generate(np.array(PROMPT, dtype=np.int32), N_NEW, ignore_eos=True)
    assert (got, reason) == (want, "length")
    lm._prefill_step(np.array(PROMPT, dtype=np.int32), 0, len(PROMPT) - 1)
    np.testing.assert_allclose(lm._logits(), want_logits, rtol=1e-4,
                               atol=1e-4 * float(np.abs(want_logits).max()))


@pytest.mark.parametrize("arch", ["gemma2", "phi3"])
def test_another_architecture_is_refused_at_load_naming_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            arch: str) -> None:
    monkeypatch.setenv(_jitfile.ENV, str(tmp_path / "jit"))
    path = write_llama(tmp_path / "m.gguf", {}, arch=arch)
    with pytest.raises(WorkerError, match=f"unsupported architecture '{arch}'") as info:
        _loaders.load_llama(path, {}, "00" * 32, lambda: None, lambda k: None)
    assert info.value.code == "config_invalid"
