"""The packed-weight kernels of models/quant.py against the `gguf` package's dequantiser.

The decoder's greedy output matches the float reference because its kernels compute with the very same
float32 weights: these tests dequantise every packed block of real GGUF matrices in a kernel and require
bit-identical values, and check the matvec tiles (one row of x, and the prefill tile) numerically.
"""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.slow

gguf = pytest.importorskip("gguf")

from tinygrad import Tensor  # noqa: E402

from tests.reference_llama import gguf_path  # noqa: E402
from trio_gpuworker.models import quant  # noqa: E402


@pytest.fixture(scope="module")
def raw() -> dict[str, quant.Raw]:
    return quant.gguf_raw(gguf_path())[1]


@pytest.fixture(scope="module")
def reader() -> gguf.GGUFReader:
    return gguf.GGUFReader(gguf_path())


def _reference(reader: gguf.GGUFReader, name: str) -> np.ndarray:
    t = next(t for t in reader.tensors if t.name == name)
    return gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)


def _dequantised(typ: int, packed: Tensor, rows: int, cols: int) -> np.ndarray:
    body = """(float *restrict y, const unsigned char *restrict w) {
  for (int o = 0; o < ROWS; o++) for (int b = 0; b < NB; b++) {
    v16 lo, hi; dqw(w + (((long)(o / G) * NB + b) * G + o % G) * BS, &lo, &hi);
    float *yb = y + (long)o * NB * 32 + b * 32;
    for (int i = 0; i < 16; i++) { yb[i] = lo[i]; yb[16 + i] = hi[i]; }
  }
}
"""
    defs = {"ROWS": rows, "NB": cols // 32, "G": quant.G, "BS": quant.PACKED[typ], "dqw": f"dq{typ}", "D": 32, "EPS": 0}
    src = quant.c_source("deq", defs, {}, body)
    return quant.kernel("deq", src, [Tensor.empty(rows * cols)], [packed])[0].numpy().reshape(rows, cols)


@pytest.mark.parametrize("name", ["blk.0.ffn_down.weight", "blk.7.attn_q.weight", "token_embd.weight"])
def test_packed_blocks_dequantise_to_the_reference_weights(raw: dict, reader: gguf.GGUFReader, name: str) -> None:
    typ, (rows, cols), data = raw[name]
    assert typ in (quant.Q4_1, quant.Q8_0)
    if name == "token_embd.weight":
        rows = 4096  # enough rows to cover the grouping; the whole vocabulary only costs time
        data = data[: rows * cols // 32 * 34]
    got = _dequantised(typ, Tensor(quant.group(typ, quant.pack(typ, data, rows))), rows, cols)
    want = _reference(reader, name)[:rows]
    assert got.view(np.uint32).tolist() == want.view(np.uint32).tolist()  # bit for bit, not approximately


@pytest.mark.parametrize("n, nt", [(1, 1), (8, 4)])
def test_matvec_tiles(raw: dict, reader: gguf.GGUFReader, n: int, nt: int) -> None:
    name = "blk.3.ffn_gate.weight"
    typ, (rows, cols), data = raw[name]
    x = np.random.default_rng(0).standard_normal((n, cols)).astype(np.float32)
    body = """(float *restrict y, const float *restrict x, const unsigned char *restrict w) {
  mm(y, ROWS, x, COLS, w, ROWS, COLS / 32, NX);
}
"""
    src = quant.c_source("mv", {"ROWS": rows, "COLS": cols, "NX": n, "D": 32, "EPS": 0}, {"mm": (typ, nt)}, body)
    packed = Tensor(quant.group(typ, quant.pack(typ, data, rows)))
    got = quant.kernel("mv", src, [Tensor.empty(n * rows)], [Tensor(x), packed])[0].numpy().reshape(n, rows)
    want = x.astype(np.float64) @ _reference(reader, name).astype(np.float64).T
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_unsupported_types_are_refused() -> None:
    with pytest.raises(ValueError, match="packed matrix"):
        quant.pack(quant.F16, np.zeros(64, np.uint8), 1)
