"""Model loading for LOAD: weights plus warmed (captured) JITs, restored from the JIT cache when it holds valid
entries for this exact artifact, device and code (worker/_warmcache.py), else built and then stored.

Runs on the compute thread; tinygrad is imported here, on the first LOAD. The artifact's digest is checked before
anything from the cache runs.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from .. import encoder_folder
from .._errors import WorkerError
from .._kinds import AUTO_THREADS, EMBEDDING, GENERATE, DecoderRuntime, EncoderRuntime, LoadConfig
from . import _jitcache, _jitfile, _warmcache
from ._beam import BeamStats, beam_shape, check_beam

ModelProgress = Callable[[int], None]
_CACHE_MODULES = (__name__, _jitcache.__name__, _jitfile.__name__, _warmcache.__name__)


def _log(line: str) -> None:
    print(line, file=sys.stderr)  # the lane's log ring


def _key(digest: str, kind: str, modules: tuple[str, ...], extra: dict[str, Any]) -> dict[str, Any]:
    from tinygrad import Device

    sources = [Path(sys.modules[m].__file__ or "") for m in (*modules, *_CACHE_MODULES)]
    return _jitfile.cache_key(digest, Device.DEFAULT, sources, {"kind": kind, **extra})


def _cached(path: Path, kind: str, key: dict[str, Any], build: Callable[[], Any]) -> tuple[Any, Any, str]:
    try:
        return _warmcache.load_or_build(key, build, _log)
    except (ValueError, KeyError, TypeError) as exc:
        raise WorkerError("config_invalid", f"cannot load {path}: {exc}") from exc


def load_config(kind: str, rc: LoadConfig | Mapping[str, Any]) -> LoadConfig:
    """LOAD's runtime_config, typed (a map, as tests and LOAD give it, is read the way the daemon wrote it)."""
    if isinstance(rc, LoadConfig):
        return rc
    try:
        return LoadConfig.from_map({"kind": kind, **rc})
    except ValueError as exc:
        raise WorkerError("config_invalid", str(exc)) from exc


def _beam(cfg: LoadConfig) -> int:
    try:
        return check_beam(cfg.beam)
    except ValueError as exc:
        raise WorkerError("config_invalid", str(exc)) from exc


# runtime_config `threads` default of the fused encoder: replicas use the cores (bench/embed.py measures both). The
# fused decoder's is AUTO_THREADS: each step takes its share of the node's idle cores (_cores.py), since with the other
# core busy a two-thread step ran at about half the speed of one (docs/performance.md, 'Batched generation')
FUSED_THREADS = 1


def encoder_for(rc: EncoderRuntime | Mapping[str, Any], device: str) -> tuple[str, int]:
    """runtime_config `encoder`: "fused" (one C kernel per batch, CPU only) or "graph" (tinygrad-generated
    kernels, any device), and `threads`, the cores one fused kernel uses. Default: fused on CPU, graph
    elsewhere. The values were checked when the EncoderRuntime was built; here, what depends on the device."""
    rt = rc if isinstance(rc, EncoderRuntime) else load_config(EMBEDDING, rc).runtime
    assert isinstance(rt, EncoderRuntime)
    cpu = device.split(":")[0] == "CPU"
    choice = rt.backend(device)
    if choice == "fused" and not cpu:
        raise WorkerError("config_invalid", f"encoder 'fused' runs on CPU only, not on {device}: use 'graph'")
    if rt.threads is not None and choice != "fused":
        raise WorkerError("config_invalid", "threads applies to the fused encoder only")
    return choice, FUSED_THREADS if rt.threads is None else rt.threads


def _load_fused(kind: str, path: Path, config: dict[str, Any], max_tokens: int, threads: int, digest: str,
                verify: Callable[[], None], progress: ModelProgress) -> Any:
    """The fused encoder: one kernel serves every batch, so there are no shapes to warm and nothing to BEAM. Its
    packed weights and captured kernel are one JIT cache entry, as SmolLM2's are: a warm start maps them instead
    of reading, converting, packing and uploading 90 MB and capturing the kernel again."""
    from ..models import csource

    if kind == EMBEDDING:
        from ..models.bert_fused import FusedBertEncoder as cls
    else:
        from ..models.bert_fused import FusedCrossEncoder as cls
    verify()  # before the artifact is read or anything from the cache runs

    def build() -> Any:
        impl = cls.load(path, config, max_tokens=max_tokens, threads=threads)
        impl.warmup(progress)
        return impl

    modules = (cls.__module__, "trio_gpuworker.models.bert", "trio_gpuworker.models.csource",
               "trio_gpuworker.models.ckernel")
    key = _key(digest, kind, modules, {"max_tokens": max_tokens, "threads": threads, "encoder": "fused",
                                       "kernels_sha256": csource.digest()})
    impl, _, outcome = _cached(path, kind, key, build)
    _log(f"worker: {kind} model {path.name}: fused encoder, {threads} thread(s), jit cache {outcome}")
    return impl


def load_encoder(cfg: LoadConfig, path: Path, digest: str, verify: Callable[[], None],
                 progress: ModelProgress) -> tuple[Any, None]:
    """_kinds.KINDS' loader of embedding and rerank models: (encoder, no detokenizer). An embedding model's
    sentence-transformers folder must pool and normalise in a way the encoders serve (encoder_folder.read)."""
    cfg_path = path.with_name("config.json")
    try:
        config = json.loads(cfg_path.read_text())
    except (OSError, ValueError) as exc:
        raise WorkerError("config_invalid", f"cannot read {cfg_path}: {exc}") from exc
    if cfg.kind == EMBEDDING:
        try:
            encoder_folder.read(path)
        except ValueError as exc:
            raise WorkerError("config_invalid", f"cannot load {path}: {exc}") from exc
    return load_bert(cfg.kind, path, config, cfg, digest, verify, progress), None


def load_bert(kind: str, path: Path, config: dict[str, Any], rc: LoadConfig | Mapping[str, Any], digest: str,
              verify: Callable[[], None], progress: ModelProgress) -> Any:
    """An encoder: fused on CPU (encoder_for), else with its micro-batch shapes captured: the runtime_config
    `warmup_shapes` (default: (16, 1), or with `beam` > 0 the model's tuned_shapes, each compiled under a BEAM
    search of that width) and, once this machine has stored the model (any start after the first), every other
    shape the batch plan can produce. On a first start the other shapes are compiled when a request first needs
    them, and stored for every later worker."""
    from tinygrad import Device

    cfg = load_config(kind, rc)
    rt = cfg.runtime
    if not isinstance(rt, EncoderRuntime):
        raise WorkerError("config_invalid", f"safetensors artifacts serve embedding or rerank, not {kind!r}")
    choice, threads = encoder_for(rt, Device.DEFAULT)
    if choice == "fused":
        if _beam(cfg) or rt.warmup_shapes is not None:
            _log(f"worker: {kind} model {path.name}: beam and warmup_shapes tune tinygrad-generated kernels; "
                 "the fused encoder has none (encoder = 'graph' uses them)")
        return _load_fused(kind, path, config, cfg.max_tokens, threads, digest, verify, progress)
    if kind == EMBEDDING:
        from ..models.bert import BertEncoder as cls
    else:
        from ..models.cross_encoder import BertCrossEncoder as cls
    max_tokens, beam = cfg.max_tokens, _beam(cfg)
    shapes = list(rt.warmup_shapes) if rt.warmup_shapes is not None else None  # checked in EncoderRuntime
    # without an explicit list: one small shape, or with BEAM the shapes worth a search
    warm = shapes if shapes is not None else (cls.tuned_shapes(max_tokens) if beam else [(16, 1)])
    stats = BeamStats(beam)
    verify()  # before the artifact is read or anything from the cache runs

    def build() -> Any:
        return cls.load(path, config, max_tokens=max_tokens)

    def compile(shape: tuple[int, int]) -> None:  # captures one shape; BEAM only for the warm-up shapes
        tuned = beam > 0 and shape in warm
        impl.warmup([shape], around=(lambda s: beam_shape(beam, stats)) if tuned else None, tuned=tuned)

    key = _key(digest, kind, (cls.__module__, "trio_gpuworker.models.bert", "trio_gpuworker.models.shapes"),
               {"max_tokens": max_tokens})
    impl, stored, outcome = _cached(path, kind, key, build)
    try:
        for shape in warm:
            if shape not in impl.all_shapes():
                raise ValueError(f"{shape} is not a micro-batch shape of this model")
        cache_dir = _jitfile.cache_dir_from_env()
        if cache_dir is None or stored is None:  # no cache, or one that cannot be written: this worker's own
            for k, shape in enumerate(warm):
                compile(shape)
                progress(k + 1)
            served: Any = impl
        else:
            parts = _warmcache.ShapeCache(cache_dir, key, stored, {s: beam for s in warm} if beam else {}, compile,
                                          _log)
            rest = [s for s in impl.all_shapes() if s not in warm] if outcome == "hit" else []
            parts.provide_all(impl, [*warm, *rest], progress)
            outcome = f"{outcome}, {parts.describe()}"
            served = _warmcache.GrowingEncoder(impl, parts)
        impl.warmup(warm, tuned=beam > 0)  # every one is captured: this marks the BEAM-tuned ones for the batch plan
    except (ValueError, KeyError, TypeError) as exc:
        raise WorkerError("config_invalid", f"cannot load {path}: {exc}") from exc
    if stats.searched or stats.seconds:
        _log(f"worker: {kind} model {path.name}: {stats.describe()}")
    _log(f"worker: {kind} model {path.name}: jit cache {outcome}")
    return served


def decoder_for(rc: DecoderRuntime | Mapping[str, Any], device: str) -> tuple[str, int]:
    """runtime_config `decoder`: "fused" (one C kernel per step, CPU only) or "graph" (tinygrad-generated
    kernels, any device), and `threads`, the cores one fused step uses. Default: fused on CPU, graph elsewhere;
    AUTO_THREADS, the step's share of the node's cores (_cores.py)."""
    rt = rc if isinstance(rc, DecoderRuntime) else load_config(GENERATE, rc).runtime
    assert isinstance(rt, DecoderRuntime)
    choice = rt.backend(device)
    if choice == "fused" and device.split(":")[0] != "CPU":
        raise WorkerError("config_invalid", f"decoder 'fused' runs on CPU only, not on {device}: use 'graph'")
    if rt.threads is not None and choice != "fused":
        raise WorkerError("config_invalid", "threads applies to the fused decoder only")
    return choice, AUTO_THREADS if rt.threads is None else rt.threads


def load_decoder(cfg: LoadConfig, path: Path, digest: str, verify: Callable[[], None],
                 progress: ModelProgress) -> tuple[Any, Any]:
    """_kinds.KINDS' loader of generate models."""
    return load_llama(path, cfg, digest, verify, progress)


def load_llama(path: Path, rc: LoadConfig | Mapping[str, Any], digest: str, verify: Callable[[], None],
               progress: ModelProgress) -> tuple[Any, Any]:
    """(decoder with its prefill and decode graphs captured, detokenizer): both restored from one entry. With
    `beam` > 0 both graphs are compiled under a BEAM search of that width (it tunes tinygrad-generated
    kernels: the graph decoder's). Its context is runtime_config `max_context`, the one the daemon caps
    prompts by."""
    from tinygrad import Device

    from ..llm_tokenizer import ChatTokenizer

    cfg = load_config(GENERATE, rc)
    rt = cfg.runtime
    assert isinstance(rt, DecoderRuntime)
    beam, (decoder, threads), context = _beam(cfg), decoder_for(rt, Device.DEFAULT), rt.context
    if decoder == "fused":
        from ..models.llama_fused import FusedLlamaLM as cls
    else:
        from ..models.llama import LlamaLM as cls
    verify()  # before the artifact is read or anything from the cache runs

    def build() -> tuple[Any, Any]:
        detokenizer = ChatTokenizer.from_gguf(path)  # ids in, text out: no tokenization in the worker
        lm = cls.load(path, max_context=context, warmup=False, **({"threads": threads} if decoder == "fused" else {}))
        stats = BeamStats(beam)
        with beam_shape(beam, stats):
            lm.warmup(progress)
        if beam:
            _log(f"worker: generate model {path.name}: {stats.describe()}")
        return lm, detokenizer

    extra: dict[str, Any] = {"max_context": context, "beam": beam, "decoder": decoder}
    fused = ("trio_gpuworker.models.csource", "trio_gpuworker.models.ckernel")
    if decoder == "fused":  # its C lives in models/kernels/, not in the modules' source
        from ..models import csource

        extra["kernels_sha256"] = csource.digest()
        extra["threads"] = threads
    modules = (cls.__module__, "trio_gpuworker.models.greedy", "trio_gpuworker.models.architectures",
               "trio_gpuworker.llm_tokenizer", "trio_gpuworker.chat_template", "trio_gpuworker.models.quant",
               "trio_gpuworker.gguf_file",
               *(fused if decoder == "fused" else ()))
    model, _, outcome = _cached(path, GENERATE, _key(digest, GENERATE, modules, extra), build)
    _log(f"worker: generate model {path.name}: jit cache {outcome}")
    return model
