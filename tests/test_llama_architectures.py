"""Each architecture on both decoders against transformers (float32, loading the very same GGUF through gguf-py):
Llama 3's rope scaling (llama.cpp's rope_freqs.weight) with an untied output matrix; Qwen2 (q/k/v biases, neox RoPE,
tied output); Qwen3 (q/k head norms, a head size of its own, neox RoPE). A GGUF of an architecture the decoders do
not run, or whose tokenizer the daemon does not build, is refused at LOAD, naming it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # transformers loads a GGUF only with it
gguf = pytest.importorskip("gguf")

from gguf import GGMLQuantizationType as T  # noqa: E402

from tests.support.tiny_gguf import DEFAULT_VOCAB, Dims, llama3_rope_factors, write_llama  # noqa: E402
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


Reference = tuple[Path, list[int], np.ndarray]


def _decoder(decoder: str, path: Path) -> GreedyDecoder:
    if decoder == "fused":
        from trio_gpuworker.models.llama_fused import FusedLlamaLM as cls
    else:
        from trio_gpuworker.models.llama import LlamaLM as cls
    return cls.load(path, max_context=64, warmup=False)


def _check(lm: GreedyDecoder, ref: Reference) -> None:
    """Greedy tokens equal and the prompt's logits within 1e-4 (relative to the largest)."""
    _, want, want_logits = ref
    got, reason = lm.generate(np.array(PROMPT, dtype=np.int32), N_NEW, ignore_eos=True)
    assert (got, reason) == (want, "length")
    lm._prefill_step(np.array(PROMPT, dtype=np.int32), 0, len(PROMPT) - 1)
    np.testing.assert_allclose(lm._logits(), want_logits, rtol=1e-4,
                               atol=1e-4 * float(np.abs(want_logits).max()))


@pytest.fixture(scope="module")
def llama3(tmp_path_factory: pytest.TempPathFactory) -> Reference:
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


def _qwen(d: Path, arch: str, dims: Dims, types: dict[str, T], tied: bool, seed: int) -> Reference:
    path = write_llama(d / f"{arch}.gguf", types, dims, tied=tied, seed=seed, arch=arch, rope_base=QWEN_BASE)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(d), gguf_file=path.name, dtype=torch.float32)
    assert hf.config.model_type == arch and hf.config.tie_word_embeddings == tied
    assert hf.config.rope_parameters["rope_theta"] == QWEN_BASE
    return path, *_hf_greedy(hf.eval(), PROMPT, N_NEW)


QWEN_BASE = 1e6  # Qwen's RoPE base


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory: pytest.TempPathFactory) -> Reference:
    # quantised q and k: their packed rows are reordered for adjacent-pair RoPE
    return _qwen(tmp_path_factory.mktemp("qwen2"), "qwen2", Dims(),
                 {"attn_q": T.Q8_0, "attn_k": T.Q4_K, "ffn_up": T.Q5_0}, tied=True, seed=4)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> Reference:
    # heads of 128 where dim / heads is 64: q and the attention output are 512 wide
    return _qwen(tmp_path_factory.mktemp("qwen3"), "qwen3", Dims(head_dim=128),
                 {"attn_q": T.Q6_K, "attn_k": T.Q8_0, "attn_output": T.Q4_K}, tied=False, seed=5)


@pytest.mark.parametrize("decoder", ["fused", "graph"])
def test_llama3_rope_scaling_and_untied_output_match_transformers(llama3: Reference, decoder: str) -> None:
    _check(_decoder(decoder, llama3[0]), llama3)


@pytest.mark.parametrize("decoder", ["fused", "graph"])
def test_qwen2_biases_and_neox_rope_match_transformers(qwen2: Reference, decoder: str) -> None:
    _check(_decoder(decoder, qwen2[0]), qwen2)


@pytest.mark.parametrize("decoder", ["fused", "graph"])
def test_qwen3_head_norms_and_head_size_match_transformers(qwen3: Reference, decoder: str) -> None:
    _check(_decoder(decoder, qwen3[0]), qwen3)


@pytest.mark.parametrize("arch", ["gemma2", "phi3"])
def test_another_architecture_is_refused_at_load_naming_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            arch: str) -> None:
    monkeypatch.setenv(_jitfile.ENV, str(tmp_path / "jit"))
    path = write_llama(tmp_path / "m.gguf", {}, arch=arch)
    with pytest.raises(WorkerError, match=f"unsupported architecture '{arch}'") as info:
        _loaders.load_llama(path, {}, "00" * 32, lambda: None, lambda k: None)
    assert info.value.code == "config_invalid"


@pytest.mark.parametrize(("key", "value", "message"), [("model", "t5", "unsupported tokenizer model 't5'"),
                                                       ("pre", "falcon", "unsupported pre-tokenizer 'falcon'")])
def test_a_tokenizer_not_served_is_refused_at_load_naming_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             key: str, value: str, message: str) -> None:
    monkeypatch.setenv(_jitfile.ENV, str(tmp_path / "jit"))
    path = write_llama(tmp_path / "m.gguf", {}, vocab=dataclasses.replace(DEFAULT_VOCAB, **{key: value}))
    with pytest.raises(WorkerError, match=message) as info:
        _loaders.load_llama(path, {}, "00" * 32, lambda: None, lambda k: None)
    assert info.value.code == "config_invalid"


def test_qwen3_loads_through_load(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, qwen3: Reference) -> None:
    """LOAD's path (worker/_loaders.py: tokenizer, warm-up, JIT cache) serves it as transformers decodes it."""
    monkeypatch.setenv(_jitfile.ENV, str(tmp_path / "jit"))
    lm, detok = _loaders.load_llama(qwen3[0], {"max_context": 64}, "00" * 32, lambda: None, lambda k: None)
    got, _ = lm.generate(np.array(PROMPT, dtype=np.int32), N_NEW, ignore_eos=True)
    assert got == qwen3[1]
    assert detok.eos_ids == lm.eos_ids
