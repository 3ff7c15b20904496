"""GGUF quantised blocks re-packed for the fused decoder's kernels (kernels/quant.h dequantises them). Numpy only.

Each 32-element block keeps its quantised values and gets its f16 scales widened to f32, so a kernel never
converts: q*d is exact in float32 (a 4- or 8-bit q times an f16 scale), so q*d + m rounds once, as the
reference's does, and the kernels compute with the reference's exact weights (tests/test_llama_quant.py
checks it bit for bit).
"""

from __future__ import annotations

import numpy as np

from ..gguf_file import F16, F32, Q4_1, Q8_0

PACKED = {Q4_1: 24, Q8_0: 36}  # packed bytes per block (kernels/quant.h BS_3, BS_8)
G = 4  # rows per kernel tile, and per interleaved group of packed rows


def pack(typ: int, raw: np.ndarray, rows: int) -> np.ndarray:
    """GGUF blocks -> (rows, row bytes) uint8: Q4_1 as {f32 d, f32 m, 16 nibble bytes}, Q8_0 as {f32 d, 32 int8}."""
    if typ == Q4_1:
        b = raw.reshape(-1, 20)
        dm = b[:, :4].copy().view(np.float16).astype(np.float32).view(np.uint8)
        return np.concatenate([dm, b[:, 4:]], axis=1).reshape(rows, -1)
    if typ == Q8_0:
        b = raw.reshape(-1, 34)
        d = b[:, :2].copy().view(np.float16).astype(np.float32).view(np.uint8)
        return np.concatenate([d, b[:, 2:]], axis=1).reshape(rows, -1)
    raise ValueError(f"GGML type {typ} cannot be a packed matrix (Q4_1 and Q8_0 can)")


def group(typ: int, rows: np.ndarray) -> np.ndarray:
    """(rows, row bytes) -> flat bytes with the blocks of each G consecutive rows side by side: a kernel
    working on G rows at once then reads one sequential stream (G separate row streams ran 3x slower)."""
    if rows.shape[0] % G:
        raise ValueError(f"matrix rows ({rows.shape[0]}) must be a multiple of {G}")
    return np.ascontiguousarray(rows.reshape(rows.shape[0] // G, G, -1, PACKED[typ]).transpose(0, 2, 1, 3)).reshape(-1)


def f32(typ: int, raw: np.ndarray) -> np.ndarray:
    if typ == F32:
        return raw.view(np.float32).copy()
    if typ == F16:
        return raw.view(np.float16).astype(np.float32)
    raise ValueError(f"GGML type {typ} is not a float vector")
