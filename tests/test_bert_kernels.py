"""The fused BERT encoder's C (models/kernels/gemm.h, bert_attention.h, bert_math.h, bert_encode.c) on its own,
through ctypes, against numpy references (tests/support/reference_bert.py for the whole encoder)."""

from __future__ import annotations

import ctypes
import math

import numpy as np
import pytest

from tests.support.ckernels import build, entry_first, imports, ptr, spec
from tests.support.reference_bert import hidden
from trio_gpuworker.models import bert_fused, ckernel, quant
from trio_gpuworker.models.bert import BertConfig
from trio_gpuworker.models.bert_fused import CAP, NR, BertDims, Capacity, pack_rows, pack_weights, panels

RNG = np.random.default_rng(0)
HD, MAXLP = 32, 96


@pytest.fixture(scope="module", params=[0, 1], ids=["native", "wide"])
def probe(request: pytest.FixtureRequest) -> ctypes.CDLL:
    """The tiles of this CPU, and AVX-512's wide ones (WIDE 1, bert_math.h) run on whatever this CPU has."""
    return build("bert_probe.c", spec(act=0, hd=HD, maxlp=MAXLP, wide=request.param))


@pytest.mark.parametrize("epi", [1, 2, 3])
@pytest.mark.parametrize("m", [1, 5, 6, 7, 12, 13, 50])
def test_gemm_epilogues(probe: ctypes.CDLL, epi: int, m: int) -> None:
    n, k = 3 * NR, 40
    a = RNG.standard_normal((m, k)).astype(np.float32)
    w = RNG.standard_normal((n, k)).astype(np.float32)  # (out, in), as Hugging Face stores it
    bias = RNG.standard_normal(n).astype(np.float32)
    res = RNG.standard_normal((m, n)).astype(np.float32)
    c, packed = res.copy(), panels(w)
    probe.gemm_epi(epi, m, n, k, ptr(a), ptr(packed), ptr(c), ptr(bias))
    y = a.astype(np.float64) @ w.T.astype(np.float64) + bias
    want = {1: y, 2: 0.5 * y * (1 + np.vectorize(math.erf)(y / math.sqrt(2))), 3: y + res}[epi]
    np.testing.assert_allclose(c, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("L", [1, 2, 6, 31, 33, 70, 96])
def test_attention_of_one_head(probe: ctypes.CDLL, L: int) -> None:
    qkv = RNG.standard_normal((L, 3 * HD)).astype(np.float32)
    ctx = np.full((L, HD), np.nan, np.float32)
    kt, sc = np.zeros(2 * HD * MAXLP, np.float32), np.zeros(16 * MAXLP, np.float32)
    probe.attention(L, ptr(qkv), ptr(ctx), ptr(kt), ptr(sc))
    q, k, v = (qkv[:, i * HD : (i + 1) * HD].astype(np.float64) for i in range(3))
    s = q @ k.T / math.sqrt(HD)
    p = np.exp(s - s.max(1, keepdims=True))
    np.testing.assert_allclose(ctx, (p / p.sum(1, keepdims=True)) @ v, rtol=1e-5, atol=1e-5)


def test_exp_erf_and_gelu(probe: ctypes.CDLL) -> None:
    x = np.concatenate([np.linspace(-90, 10, 4000), np.linspace(-6, 6, 4000), [0.0, -0.0, -1e-30, 1e-30]])
    x = np.ascontiguousarray(np.resize(x, len(x) // 16 * 16 + 16), dtype=np.float32)
    y = np.empty_like(x)
    x64 = x.astype(np.float64)
    probe.vmath(0, ptr(x), ptr(y), len(x))
    want = np.where(x64 < -87.33654, 0.0, np.exp(x64))
    np.testing.assert_allclose(y, want, rtol=3e-7, atol=0)
    probe.vmath(1, ptr(x), ptr(y), len(x))
    np.testing.assert_allclose(y, np.vectorize(math.erf)(x64), rtol=0, atol=2e-7)
    probe.vmath(2, ptr(x), ptr(y), len(x))
    np.testing.assert_allclose(y, 0.5 * x64 * (1 + np.vectorize(math.erf)(x64 / math.sqrt(2))), rtol=0, atol=5e-7)


def test_layernorm(probe: ctypes.CDLL) -> None:
    rows, n, eps = 5, 384, 1e-12
    x = (RNG.standard_normal((rows, n)) * 3 + 1).astype(np.float32)
    w, b = RNG.standard_normal(n).astype(np.float32), RNG.standard_normal(n).astype(np.float32)
    got = x.copy()
    probe.norm_rows(ptr(got), ptr(w), ptr(b), rows, n, ctypes.c_float(eps))
    x64 = x.astype(np.float64)
    mu = x64.mean(1, keepdims=True)
    want = (x64 - mu) / np.sqrt(((x64 - mu) ** 2).mean(1, keepdims=True) + eps) * w + b
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


TINY = dict(vocab_size=97, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
            max_position_embeddings=128, type_vocab_size=2, hidden_act="gelu", layer_norm_eps=1e-12)


def _tiny_weights(cfg: BertConfig) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(3)
    return {k: (rng.standard_normal(s) * (0.3 if len(s) > 1 else 0.5) + (1.0 if k.endswith("LayerNorm.weight") else 0))
            .astype(np.float32) for k, s in cfg.shapes().items()}


def _poolings(h: np.ndarray) -> list[np.ndarray]:
    """mean, [CLS], max and last token of one sequence's states, in _proto POOLINGS' order."""
    return [h.mean(0), h[0], h.max(0), h[-1]]


@pytest.mark.parametrize("threads, wide", [(1, 0), (2, 0), (3, 0), (2, 1)])
@pytest.mark.parametrize("offset", [0, 2], ids=["bert", "xlm-roberta"])
def test_whole_encoder_matches_the_numpy_reference(threads: int, wide: int, offset: int) -> None:
    """Sequences of mixed lengths packed back to back, token types, position ids as the host numbers them
    (XLM-RoBERTa's from its padding id + 1, a padding id inside a row at the padding id), a team of threads that
    splits both the tokens (row blocks) and the heads (attention) of every layer, and every pooling."""
    cfg = BertConfig.from_dict(TINY)
    w = _tiny_weights(cfg)
    maxlp, mb = 128, 8  # a small row block, so a thread runs several
    dims = BertDims(h=64, nh=2, hd=32, ff=128, nl=2, eps=1e-12, act=0)
    cap = Capacity(cap=CAP, maxlp=maxlp, mb=mb, threads=threads,
                   scratch=bert_fused.scratch_floats(dims, CAP, maxlp, mb, threads))
    lib = build("bert_encode.c", dims, cap, spec(wide=wide))
    lens = [1, 7, 126, 2, 33, 13, 64, 5]
    rows = [RNG.integers(0, 97, n).astype(np.int32) for n in lens]
    types = [(np.arange(n) >= n // 2).astype(np.int32) for n in lens]
    positions = [np.arange(n, dtype=np.int32) + offset for n in lens]
    if offset:
        positions[4][5:] -= 1  # a padding id at 5 keeps position 1 and is not counted
        positions[4][5] = 1
    inp = np.zeros(bert_fused.IN_INTS, np.int32)
    pack_rows(inp, rows, types, positions)
    out = np.full((CAP, 4 * 64), np.nan, np.float32)
    scr = np.zeros(cap.scratch, np.float32)
    table = ckernel.host_table(threads)
    weights = pack_weights(cfg, w)
    lib.encode(ptr(out), ptr(scr), ptr(inp), ptr(table), *[ptr(a) for a in weights])
    for i, (r, t, p) in enumerate(zip(rows, types, positions, strict=True)):
        want = np.concatenate(_poolings(hidden(w, TINY, r, t, p)))
        np.testing.assert_allclose(out[i], want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("cpu", [None, "x86-64-v3", "icelake-server"], ids=["native", "avx2", "avx512"])
def test_the_kernels_build_for_avx2_and_avx512_and_link_nothing(cpu: str | None) -> None:
    """Both ISAs' code paths compile (this CPU runs one of them), and a freestanding kernel calls no libc or libm
    directly: tinygrad's loader would link the call as a 32-bit displacement, wrong once the kernel is mapped over
    2 GiB from the library (tests/test_kernel_links.py). tinygrad runs the first code of the image: the entry comes
    first, whatever static functions (threads.h's team) the source defines before it."""
    from trio_gpuworker.models import csource
    from trio_gpuworker.models.llama_fused import STEPS, LlamaDims

    dims = BertDims(h=384, nh=12, hd=32, ff=1536, nl=6, eps=1e-12, act=0)
    cap = Capacity(cap=CAP, maxlp=256, mb=48, threads=2, scratch=bert_fused.scratch_floats(dims, CAP, 256, 48, 2))
    llama = LlamaDims(d=576, h=9, kv=3, hd=64, ff=1536, v=49152, s=2080, nl=30, eps=1e-5, g=4, type_embd=14,
                      type_out=14, layouts=sum(1 << t for t in quant.LAYOUTS), biases=1, head_norms=1)
    sources = [("encode", csource.source("bert_encode.c", dims, cap))]
    sources += [("forward", csource.source("llama_forward.c", llama, step)) for step in STEPS.values()]
    for entry, src in sources:
        obj = ckernel.compile_object(src, cpu)
        assert imports(obj) == set(), entry
        assert entry_first(obj, entry), entry
