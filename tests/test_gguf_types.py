"""Every GGUF tensor type the worker reads, against the `gguf` package's dequantiser (the independent reference).

models/quant.py's dequantiser must give the reference's float32 bits for each type; the fused decoder's packed
layouts (kernels/quant.h) must too, for the types that pack and for float32. Tiny random llama GGUFs with
tensors of every type, and a llama.cpp *_K_M-like mix, then decode on both decoders as tests/support/reference_llama.py
(numpy on the reference's dequantised weights) does. A type the worker does not read is refused at LOAD, naming
the tensor and the type.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from gguf import GGMLQuantizationType as T  # noqa: E402

from tests.support.ckernels import ISAS, build, ptr, spec  # noqa: E402
from tests.support.reference_llama import NumpyLlama, scored_prompt  # noqa: E402
from tests.support.tiny_gguf import encode, k_m_mix, write_llama  # noqa: E402
from trio_gpuworker import WorkerError  # noqa: E402
from trio_gpuworker.gguf_file import GGUFFormatError, read_tensors  # noqa: E402
from trio_gpuworker.models import quant  # noqa: E402
from trio_gpuworker.models.greedy import GreedyDecoder  # noqa: E402
from trio_gpuworker.models.llama_fused import BATCHED  # noqa: E402
from trio_gpuworker.worker import _jitfile, _loaders  # noqa: E402

TYPES = [T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K]
QUANTISED = [t for t in TYPES if t not in (T.F32, T.F16, T.BF16)]
ROWS, COLS = 8, 512


def _random_blocks(rng: np.random.Generator, typ: T, rows: int, cols: int) -> np.ndarray:
    """Every bit random but the f16 scales, which are random finite values of either sign."""
    block, size = gguf.GGML_QUANT_SIZES[typ]
    b = rng.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
    scales = {T.Q4_1: [0, 2], T.Q5_1: [0, 2], T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208]}.get(typ, [0])
    for at in scales:
        b[:, at : at + 2] = rng.uniform(-0.1, 0.1, (len(b), 1)).astype(np.float16).view(np.uint8)
    return b.reshape(rows, -1)


def _tensor(typ: T, source: str, seed: int = 0) -> np.ndarray:
    """(ROWS, row bytes) of type `typ`: the reference's quantisation of random normals, or random valid blocks."""
    rng = np.random.default_rng(seed)
    if source == "random":
        return _random_blocks(rng, typ, ROWS, COLS)
    return encode(rng, rng.standard_normal((ROWS, COLS)).astype(np.float32), typ).view(np.uint8)


def _reference(typ: T, data: np.ndarray) -> np.ndarray:
    return gguf.quants.dequantize(data, typ).astype(np.float32).reshape(-1)


def _bits(a: np.ndarray) -> list[int]:
    return np.ascontiguousarray(a, np.float32).view(np.uint32).reshape(-1).tolist()


def _sources(typ: T) -> list[str]:
    # the K-quants have no quantiser in the reference: random valid blocks only
    return ["random"] if typ in (T.Q4_K, T.Q5_K, T.Q6_K) else ["quantised", "random"]


CASES = [pytest.param(t, s, id=f"{t.name}-{s}") for t in TYPES for s in _sources(t)
         if not (s == "random" and t in (T.F32, T.F16, T.BF16))]


@pytest.mark.parametrize(("typ", "source"), CASES)
def test_dequantize_gives_the_reference_bits(typ: T, source: str) -> None:
    data = _tensor(typ, source)
    got = quant.dequantize(int(typ), data.reshape(-1))
    assert got.dtype == np.float32 and got.shape == (ROWS * COLS,)
    assert _bits(got) == _bits(_reference(typ, data))


@functools.cache
def _probe(layout: int, nx: int = 1, nt: int = 1, cpu: str | None = None) -> ctypes.CDLL:
    return build("quant_probe.c", spec(rows=ROWS, cols=COLS, nx=nx, nt=nt, g=quant.G, type=layout,
                                       batched_nt=BATCHED.nt, batched_split=BATCHED.split), cpu=cpu)


def _packed(typ: T, data: np.ndarray, layout: int) -> np.ndarray:
    return quant.group(layout, quant.pack(int(typ), data.reshape(-1), ROWS, layout))


@pytest.mark.parametrize("cpu", ISAS)
@pytest.mark.parametrize(("typ", "source"), [c for c in CASES if c.values[0] in QUANTISED or c.values[0] == T.F16])
def test_the_kernels_read_each_type_as_the_reference_weights(typ: T, source: str, cpu: str | None) -> None:
    """In the layout the fused decoder packs the type in, and in float32 (a matrix of mixed types)."""
    data = _tensor(typ, source, seed=1)
    want = _bits(_reference(typ, data))
    for layout in {quant.kernel_type(int(typ)), int(T.F32)}:
        got, w = np.empty((ROWS, COLS), np.float32), _packed(typ, data, layout)  # w lives through the call
        _probe(layout, cpu=cpu).dequant(ptr(got), ptr(w))
        assert _bits(got) == want, f"{typ.name} packed as layout {layout}"


@pytest.mark.parametrize("cols", [COLS, COLS + 64])
def test_q4_1_reads_as_the_reference_without_f16c(cols: int) -> None:
    """Q4_1's packed f16 scales and offsets (zeros, subnormals, the largest f16 among them), and a row's tail of GGUF
    blocks, on a CPU with no F16C (x86-64-v2: the kernels convert f16 bit by bit there)."""
    data = _random_blocks(np.random.default_rng(2), T.Q4_1, ROWS, cols).reshape(-1, 20)
    special = np.array([0x0000, 0x8000, 0x0001, 0x83FF, 0x7BFF, 0xFBFF, 0x0400, 0x3C00], np.uint16)
    data[: len(special), 0:2] = special.view(np.uint8).reshape(-1, 2)
    data[: len(special), 2:4] = special[::-1].copy().view(np.uint8).reshape(-1, 2)
    data = data.reshape(ROWS, -1)
    w = quant.group(int(T.Q4_1), quant.pack(int(T.Q4_1), data.reshape(-1), ROWS))
    got = np.empty((ROWS, cols), np.float32)
    build("quant_probe.c", spec(rows=ROWS, cols=cols, nx=1, nt=1, g=quant.G, type=int(T.Q4_1), batched_nt=BATCHED.nt,
                                batched_split=BATCHED.split), cpu="x86-64-v2").dequant(ptr(got), ptr(w))
    assert _bits(got) == _bits(_reference(T.Q4_1, data))


def test_types_with_a_packed_layout_keep_it_and_a_mix_falls_back_to_float32() -> None:
    got = [quant.kernel_type(int(t)) for t in (T.Q4_1, T.Q4_K, T.Q5_K, T.Q6_K, T.Q8_0, T.Q4_0, T.Q5_0)]
    assert got == [3, 12, 13, 14, 8, 8, 8]
    assert {quant.kernel_type(int(t)) for t in (T.F32, T.F16, T.BF16, T.Q5_1)} == {0}
    assert quant.kernel_type(int(T.Q4_K), int(T.Q4_K)) == 12 and quant.kernel_type(int(T.Q4_0), int(T.Q5_0)) == 8
    assert quant.kernel_type(int(T.Q4_K), int(T.Q6_K)) == 0 and quant.kernel_type(int(T.Q4_1), int(T.Q8_0)) == 0
    with pytest.raises(ValueError, match="Q6_K cannot be packed as Q4_1"):
        quant.pack(int(T.Q6_K), _tensor(T.Q6_K, "random").reshape(-1), ROWS, int(T.Q4_1))


# the float32 layout, and the K-quants' own (256-weight blocks: a row of COLS holds two)
MATMUL_LAYOUTS = [(T.Q6_K, T.F32), (T.Q4_K, T.Q4_K), (T.Q5_K, T.Q5_K), (T.Q6_K, T.Q6_K)]


@pytest.mark.parametrize(("typ", "layout"), MATMUL_LAYOUTS, ids=[f"{t.name}-as-{la.name}" for t, la in MATMUL_LAYOUTS])
@pytest.mark.parametrize(("nx", "nt"), [(1, 1), (5, 4), (3, 1)])
@pytest.mark.parametrize("cpu", ISAS)
def test_matrices_multiply_as_numpy_does(typ: T, layout: T, nx: int, nt: int, cpu: str | None) -> None:
    """One row of x, the prefill's 4-row tiles with a shorter last tile, and the batched decode's split tiles, whose
    every row is bit for bit the one-row call's."""
    data = _tensor(typ, "random", seed=2)
    x = np.random.default_rng(nx).standard_normal((nx, COLS)).astype(np.float32)
    got, w = np.empty((nx, ROWS), np.float32), _packed(typ, data, int(layout))
    probe = _probe(int(layout), nx, nt, cpu)
    probe.matvec(ptr(got), ptr(x), ptr(w))
    want = x.astype(np.float64) @ _reference(typ, data).reshape(ROWS, COLS).astype(np.float64).T
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    if nt == 1:
        batched = np.empty_like(got)
        probe.matvec_split(ptr(batched), ptr(x), ptr(w))
        assert _bits(batched) == _bits(got)


# Every readable type in some matrix of some file; the kernels then read each matrix in its type's packed layout,
# or (gate and up of different layouts, or a type without one) in float32. Per part, its layout in each layer.
FILES = {
    "q4_0-q5_0-q5_1-q8_0-bf16": dict(types={"attn_q": T.Q4_0, "attn_k": T.Q4_0, "attn_v": T.Q4_0,
                                            "attn_output": T.Q5_0, "ffn_gate": T.Q4_K, "ffn_up": T.Q4_K,
                                            "ffn_down": T.Q5_1, "token_embd": T.BF16, "output": T.Q8_0},
                                     tied=False, layouts={"q": [8, 8], "k": [8, 8], "v": [8, 8], "o": [8, 8],
                                                          "gu": [12, 12], "d": [0, 0], "embd": 0, "out": 8}),
    "q5_k-q6_k-f16-q4_1-f32": dict(types={"attn_q": T.Q5_K, "attn_k": T.Q5_K, "attn_v": T.Q5_K,
                                          "attn_output": T.Q6_K, "ffn_gate": T.F16, "ffn_up": T.Q4_1,
                                          "ffn_down": T.Q4_1, "token_embd": T.Q4_K, "output": T.F32},
                                   tied=False, layouts={"q": [13, 13], "k": [13, 13], "v": [13, 13], "o": [14, 14],
                                                        "gu": [0, 0], "d": [3, 3], "embd": 12, "out": 0}),
    # as llama.cpp's Q4_K_M mixes them: Q4_K q, Q5_0 k, Q6_K v; Q6_K ffn_down in layer 0 only; a Q6_K head
    "k_m-mix": dict(types=k_m_mix, tied=True, layouts={"q": [12, 12], "k": [8, 8], "v": [14, 14], "o": [12, 12],
                                                       "gu": [12, 12], "d": [14, 12], "embd": 14, "out": 14}),
}


@pytest.fixture(scope="module", params=list(FILES))
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, NumpyLlama, dict]:
    spec_ = FILES[request.param]
    path = write_llama(tmp_path_factory.mktemp("gguf") / f"{request.param}.gguf", spec_["types"], tied=spec_["tied"])
    return path, NumpyLlama(path), spec_["layouts"]


PROMPT = [3, 17, 101, 250, 42, 7, 256]
N_NEW = 8


@pytest.mark.parametrize("decoder", ["fused", "graph"])
def test_both_decoders_decode_every_type_as_the_reference(tiny: tuple[Path, NumpyLlama, dict], decoder: str) -> None:
    path, ref, layouts = tiny
    if decoder == "fused":
        from trio_gpuworker.models.llama_fused import FusedLlamaLM as cls
    else:
        from trio_gpuworker.models.llama import LlamaLM as cls
    lm: GreedyDecoder = cls.load(path, max_context=64, warmup=False)
    if decoder == "fused":  # each matrix in the layout its types call for
        assert {**lm.layouts, "embd": lm.embd_type, "out": lm.out_type} == layouts
    want, gaps = ref.generate(PROMPT, N_NEW)
    got, reason = lm.generate(np.array(PROMPT, dtype=np.int32), N_NEW, ignore_eos=True)
    assert (got, reason) == (want, "length"), f"min top-2 logit gap {min(gaps):.5f}"
    # the prompt's logits, from one prefill chunk, within 1e-4 of the reference's relative to their range
    lm._prefill_step(np.array(PROMPT, dtype=np.int32), 0, len(PROMPT) - 1)
    logits = lm._logits()
    np.testing.assert_allclose(logits, ref.logits[0], rtol=1e-4, atol=1e-4 * float(np.abs(ref.logits[0]).max()))
    # the prompt scored token by token (a completion's echo with logprobs): each token's logprob after the ones
    # before it, as the reference's rows give it, and the most likely alternative first
    scores = lm.score_prompt(np.array(PROMPT, dtype=np.int32), 2)
    span = float(np.ptp(ref.logits[0]))
    np.testing.assert_allclose([s[0] for s in scores], scored_prompt(ref, PROMPT), atol=1e-3 + 2e-4 * span)
    rows = ref.row_logits(PROMPT)[:-1]
    assert all(s[1][0][0] == int(np.argmax(r)) for s, r in zip(scores, rows, strict=True))


@pytest.mark.parametrize("typ", [T.Q4_K, T.Q6_K])
@pytest.mark.parametrize("cpu", ISAS)
def test_a_decode_step_keeps_each_block_of_x_to_its_bits(typ: T, cpu: str | None) -> None:
    """A decode step's K-quant matmul (with AVX512-VNNI, kernels/qmatmul_vnni.h: x in integers, each 256-block to
    22 bits of its largest |x| against Q4_K, 21 against Q6_K): blocks of x far apart in scale, within the bound
    that rounding allows; a NaN or an infinity in x reaches every output, as the float kernel's does."""
    data = _tensor(typ, "random", seed=3)
    w = _reference(typ, data).reshape(ROWS, COLS).astype(np.float64)
    x = np.random.default_rng(7).standard_normal((1, COLS)).astype(np.float32)
    x[0, :256] *= 1e4
    x[0, 256:] *= 1e-4
    probe, packed = _probe(int(typ), 1, 1, cpu), _packed(typ, data, int(typ))
    got = np.empty((1, ROWS), np.float32)
    probe.matvec_split(ptr(got), ptr(x), ptr(packed))
    x64 = x.astype(np.float64)
    block_max = np.repeat(np.abs(x64).reshape(-1, 256).max(axis=1), 256)
    bits = 22 if typ == T.Q4_K else 21
    bound = 2.0**-bits * (np.abs(w) @ block_max) + 2.0**-20 * (np.abs(w) @ np.abs(x64[0]))
    assert np.all(np.abs(got[0] - w @ x64[0]) <= bound)
    for bad in (np.nan, np.inf):
        x[0, 300] = bad
        probe.matvec_split(ptr(got), ptr(x), ptr(packed))
        assert not np.isfinite(got).any()


@pytest.mark.parametrize("typ", [T.Q2_K, T.Q3_K, T.IQ2_XXS, T.IQ4_XS, T.TQ1_0])
def test_an_unread_type_is_refused_naming_the_tensor_and_type(tmp_path: Path, typ: T) -> None:
    path = write_llama(tmp_path / "m.gguf", lambda name: typ if name == "blk.1.ffn_up.weight" else T.F32)
    with pytest.raises(GGUFFormatError, match=f"blk.1.ffn_up.weight: tensor type {typ.name} "):
        read_tensors(path)


@pytest.mark.parametrize("decoder", ["fused", "graph"])
def test_load_refuses_it_as_config_invalid(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, decoder: str) -> None:
    monkeypatch.setenv(_jitfile.ENV, str(tmp_path / "jit"))
    path = write_llama(tmp_path / "m.gguf", lambda name: T.Q2_K if name == "blk.0.attn_k.weight" else T.Q8_0)
    with pytest.raises(WorkerError, match=r"blk\.0\.attn_k\.weight: tensor type Q2_K \(GGML type 10\)") as info:
        _loaders.load_llama(path, {"decoder": decoder}, "00" * 32, lambda: None, lambda k: None)
    assert info.value.code == "config_invalid"

