"""The fused decoder's C (models/kernels/quant.h, qmatmul.h, llama_math.h) against numpy references.

The decoder's greedy output matches the float reference because its kernels compute with the very same
float32 weights: these tests dequantise every packed block of real GGUF matrices and require bit-identical
values against the `gguf` package's dequantiser, check the matvec tiles (one row of x, and the prefill tile)
numerically, and RMSNorm and the softmax exp against numpy. The C runs on its own through ctypes
(tests/support/ckernels.py), compiled as tinygrad compiles it; one test runs it through the tinygrad bridge.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

pytestmark = pytest.mark.slow

gguf = pytest.importorskip("gguf")

from tests.support.ckernels import ISAS, build, ptr, spec  # noqa: E402
from tests.support.reference_llama import gguf_path  # noqa: E402
from trio_gpuworker.gguf_file import BLOCKS, F16, Q4_1, Q8_0, GGUFTensor, read_tensors  # noqa: E402
from trio_gpuworker.models import quant  # noqa: E402
from trio_gpuworker.models.llama_fused import BATCHED  # noqa: E402


@pytest.fixture(scope="module")
def raw() -> dict[str, GGUFTensor]:
    return read_tensors(gguf_path())[1]


@pytest.fixture(scope="module")
def reader() -> gguf.GGUFReader:
    return gguf.GGUFReader(gguf_path())


def _reference(reader: gguf.GGUFReader, name: str) -> np.ndarray:
    t = next(t for t in reader.tensors if t.name == name)
    return gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)


def _probe(typ: int, rows: int, cols: int, nx: int = 1, nt: int = 1, cpu: str | None = None) -> ctypes.CDLL:
    return build("quant_probe.c", spec(rows=rows, cols=cols, nx=nx, nt=nt, g=quant.G, type=typ,
                                       batched_nt=BATCHED.nt, batched_split=BATCHED.split), cpu=cpu)


def _packed(t: GGUFTensor, rows: int) -> np.ndarray:
    """The first `rows` rows of `t`, packed and grouped as the decoder loads them."""
    block = BLOCKS[t.typ][1]
    return quant.group(t.typ, quant.pack(t.typ, t.data[: rows * t.shape[1] // 32 * block], rows))


@pytest.mark.parametrize("name", ["blk.0.ffn_down.weight", "blk.7.attn_q.weight", "token_embd.weight"])
def test_packed_blocks_dequantise_to_the_reference_weights(raw: dict, reader: gguf.GGUFReader, name: str) -> None:
    t = raw[name]
    assert t.typ in (Q4_1, Q8_0)
    rows, cols = t.shape
    rows = min(rows, 4096)  # enough rows to cover the grouping; the whole vocabulary only costs time
    w = _packed(t, rows)
    got = np.empty((rows, cols), np.float32)
    _probe(t.typ, rows, cols).dequant(ptr(got), ptr(w))
    want = _reference(reader, name)[:rows]
    assert got.view(np.uint32).tolist() == want.view(np.uint32).tolist()  # bit for bit, not approximately


@pytest.mark.parametrize("cpu", ISAS)
@pytest.mark.parametrize("n, nt", [(1, 1), (8, 4), (5, 4), (6, 4), (7, 4)])
def test_matvec_tiles(raw: dict, reader: gguf.GGUFReader, n: int, nt: int, cpu: str | None) -> None:
    """One row of x, and the prefill's 4-row tiles with a shorter last tile, against float64 numpy."""
    name = "blk.3.ffn_gate.weight"
    t = raw[name]
    rows, cols = t.shape
    x = np.random.default_rng(0).standard_normal((n, cols)).astype(np.float32)
    got, w = np.empty((n, rows), np.float32), _packed(t, rows)
    _probe(t.typ, rows, cols, n, nt, cpu).matvec(ptr(got), ptr(x), ptr(w))
    want = x.astype(np.float64) @ _reference(reader, name).astype(np.float64).T
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("cpu", ISAS)
@pytest.mark.parametrize("nx", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("name", ["blk.3.ffn_gate.weight", "blk.5.ffn_down.weight", "output.weight"])
def test_batched_tiles_compute_each_row_as_one_row_does(raw: dict, reader: gguf.GGUFReader, name: str, nx: int,
                                                        cpu: str | None) -> None:
    """The batched decode's matmul (4-row tiles with split accumulators, a shorter last tile) gives every row bit
    for bit what the one-token decode's gives it, for any number of rows: what makes a sequence in a batch of
    any size equal to the sequence alone."""
    name = name if name in raw else "token_embd.weight"  # a tied head is the embedding
    t = raw[name]
    rows, cols = t.shape
    rows = min(rows, 4096)
    x = np.random.default_rng(nx).standard_normal((nx, cols)).astype(np.float32)
    w = _packed(t, rows)
    probe = _probe(t.typ, rows, cols, nx, 1, cpu)
    alone, batched = np.empty((nx, rows), np.float32), np.empty((nx, rows), np.float32)
    probe.matvec(ptr(alone), ptr(x), ptr(w))
    probe.matvec_split(ptr(batched), ptr(x), ptr(w))
    assert batched.view(np.uint32).tolist() == alone.view(np.uint32).tolist()
    ref = _reference(reader, name)[:rows]
    np.testing.assert_allclose(alone, x.astype(np.float64) @ ref.astype(np.float64).T, rtol=1e-4, atol=1e-4)


def test_rmsnorm_and_exp_match_numpy() -> None:
    n, eps = 576, 1e-5
    lib = build("llama_math_probe.c", spec(n=n, eps=eps))
    rng = np.random.default_rng(1)
    x, w = rng.standard_normal((3, n)).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    got = np.empty_like(x)
    lib.rms(ptr(got), ptr(x), ptr(w), 3)
    ms = (x.astype(np.float64) ** 2).mean(1, keepdims=True)
    np.testing.assert_allclose(got, x / np.sqrt(ms.astype(np.float32) + np.float32(eps)) * w, rtol=2e-7, atol=1e-7)
    z = np.concatenate([-np.geomspace(1e-8, 700, 4000), [0.0, -708.5, -800.0, -1e4]])
    z = np.ascontiguousarray(z[: len(z) // 8 * 8])
    e = np.empty_like(z)
    lib.exp8(ptr(e), ptr(z), len(z))
    np.testing.assert_allclose(e, np.exp(np.maximum(z, -708.0)), rtol=4e-16, atol=0)


def test_the_bridge_runs_the_same_c_in_tinygrad(raw: dict, reader: gguf.GGUFReader) -> None:
    """Through ckernel.kernel (a tinygrad custom kernel), the dequantiser gives the same bits as through ctypes."""
    from tinygrad import Tensor

    from tests.support.ckernels import TEST_KERNELS
    from trio_gpuworker.models import ckernel, csource

    t = raw["blk.1.attn_v.weight"]
    rows, cols = t.shape
    src = csource.source("quant_dequant.c", spec(rows=rows, cols=cols, g=quant.G, type=t.typ), dirs=(TEST_KERNELS,))
    got = ckernel.kernel("dequant", src, [Tensor.empty(rows * cols)], [Tensor(_packed(t, rows))])[0].numpy()
    want = _reference(reader, "blk.1.attn_v.weight").reshape(-1)
    assert got.view(np.uint32).tolist() == want.view(np.uint32).tolist()


def test_a_type_is_packed_only_in_its_own_layout_or_float32() -> None:
    with pytest.raises(ValueError, match="F16 cannot be packed as Q4_1"):
        quant.pack(F16, np.zeros(64, np.uint8), 1, Q4_1)
    assert quant.pack(F16, np.zeros(64, np.uint8), 1).shape == (1, 128)  # float32: 32 weights of 4 bytes
