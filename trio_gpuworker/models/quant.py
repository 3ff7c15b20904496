"""GGUF tensor types: dequantised to float32, or re-packed for the fused decoder's kernels (kernels/quant.h
dequantises those). Numpy only.

Every quantised type is blocks of small integers q with a float32 scale (and for some an offset) per group of
weights, w = scale * q (+ offset): `dequantize` computes exactly that, rounding as the `gguf` package's dequantiser
does, so both give the same float32 bits (tests/test_gguf_types.py). The kernels read packed layouts of their own
(LAYOUTS; kernels/quant.h decodes each): two of 32 weights, Q8_0 {f32 d, 32 int8} and F32 {32 floats}; Q4_1 in
256-weight blocks {f16 d[8], f16 m[8], 128 nibble bytes}, a row's last blocks, where it is not whole 256-weight
blocks, as GGUF's own 20 bytes (TAIL); and the K-quants' 256-weight blocks with their f16 scales widened to f32,
Q4_K {f32 d, f32 dmin, 8 sub-block scales, 8 mins, 128 nibble bytes}, Q5_K (the same, then the 32 fifth-bit bytes
before the nibbles) and Q6_K {f32 d, 16 int8 scales, 128 low-nibble bytes, 64 high-bit bytes}. Q4_1's, Q4_K's and
Q6_K's integers are in an order of their own, where each 4-byte lane of a 64-byte load holds one sub-block's (Q4_1,
Q4_K) or group's (Q6_K) weights (kernels/quant.h). Q4_0 and Q5_0 pack as Q8_0 with the same scale; every integer
keeps its bits, so the kernels compute with the type's exact weights (q*d is exact in float32 and q*d + m rounds
once, as the dequantiser's does). F16, BF16 and Q5_1 are dequantised at load and packed as F32.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..gguf_file import BF16, BLOCKS, F16, F32, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0, type_name

# the kernels' packed layouts, named by GGML type: (weights, bytes) per block (kernels/quant.h BW_t and BS_t)
LAYOUTS = {F32: (32, 128), Q4_1: (256, 160), Q8_0: (32, 36), Q4_K: (256, 152), Q5_K: (256, 184), Q6_K: (256, 212)}
# bytes of each 32-weight block after a row's whole blocks, by layout (kernels/quant.h TBS_t): a Q4_1 row that is not
# whole 256-weight blocks ends in GGUF's own Q4_1 blocks
TAIL = {Q4_1: 20}
G = 4  # rows per kernel tile, and per interleaved group of packed rows
# the packed layout each GGML type takes in the kernels; a type not here is dequantised to F32
KERNEL_TYPE = {Q4_1: Q4_1, Q4_K: Q4_K, Q5_K: Q5_K, Q6_K: Q6_K, Q8_0: Q8_0, Q4_0: Q8_0, Q5_0: Q8_0}


class Groups(NamedTuple):
    """A quantised tensor as w = scale * q (+ offset): q (groups, k) small integers in float32, scale and offset
    (groups, 1) float32; offset None where the type has none."""

    scale: np.ndarray
    q: np.ndarray
    offset: np.ndarray | None


def _f16(b: np.ndarray) -> np.ndarray:
    """(n, 2) bytes -> (n, 1) float32."""
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """(n, 16) bytes -> (n, 32): the low nibbles are weights 0-15, the high ones 16-31."""
    return np.concatenate([qs & 15, qs >> 4], axis=1)


def _bits(qh: np.ndarray) -> np.ndarray:
    """(n, 4) bytes -> (n, 32) the bits of their little-endian uint32, lowest first."""
    return np.unpackbits(np.ascontiguousarray(qh), axis=1, bitorder="little")


def _q4_0(b: np.ndarray) -> Groups:
    return Groups(_f16(b[:, :2]), _nibbles(b[:, 2:]).astype(np.float32) - 8, None)


def _q4_1(b: np.ndarray) -> Groups:
    return Groups(_f16(b[:, :2]), _nibbles(b[:, 4:]).astype(np.float32), _f16(b[:, 2:4]))


def _q5_0(b: np.ndarray) -> Groups:
    q = _nibbles(b[:, 6:]) | _bits(b[:, 2:6]) << 4
    return Groups(_f16(b[:, :2]), q.astype(np.float32) - 16, None)


def _q5_1(b: np.ndarray) -> Groups:
    q = _nibbles(b[:, 8:]) | _bits(b[:, 4:8]) << 4
    return Groups(_f16(b[:, :2]), q.astype(np.float32), _f16(b[:, 2:4]))


def _q8_0(b: np.ndarray) -> Groups:
    return Groups(_f16(b[:, :2]), np.ascontiguousarray(b[:, 2:]).view(np.int8).astype(np.float32), None)


def _k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's 12 scale bytes -> the 8 sub-blocks' 6-bit scales and mins, (n, 8) each."""
    lo, mid, hi = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = np.concatenate([lo & 63, (hi & 15) | (lo >> 6) << 4], axis=1)
    mn = np.concatenate([mid & 63, (hi >> 4) | (mid >> 6) << 4], axis=1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _k_low(qs: np.ndarray) -> np.ndarray:
    """Q4_K / Q5_K's 128 nibble bytes -> (n, 8, 32): 32 bytes per pair of sub-blocks, low nibbles first."""
    pairs = qs.reshape(-1, 4, 1, 32)
    return np.concatenate([pairs & 15, pairs >> 4], axis=2).reshape(-1, 8, 32)


def _k_groups(b: np.ndarray, q: np.ndarray) -> Groups:
    """Q4_K / Q5_K: sub-block s of a 256-weight block is d * sc[s] * q - dmin * mn[s]."""
    sc, mn = _k_scales(b[:, 4:16])
    scale, offset = _f16(b[:, :2]) * sc, -(_f16(b[:, 2:4]) * mn)
    return Groups(scale.reshape(-1, 1), q.reshape(-1, 32).astype(np.float32), offset.reshape(-1, 1))


def _q4_k(b: np.ndarray) -> Groups:
    return _k_groups(b, _k_low(b[:, 16:]))


def _q5_k(b: np.ndarray) -> Groups:
    # bit s of high byte l is weight l's fifth bit in sub-block s
    high = (b[:, 16:48, None] >> np.arange(8, dtype=np.uint8)) & 1
    return _k_groups(b, _k_low(b[:, 48:]) | high.transpose(0, 2, 1) << 4)


def _q6_k(b: np.ndarray) -> Groups:
    """Q6_K: 16 groups of 16 weights, d * scale[g] * (q - 32); each 128-weight half takes its low 4 bits from
    64 bytes (low nibbles then high nibbles) and its high 2 bits from 32 (bits 0-1, 2-3, 4-5, 6-7)."""
    ql = b[:, :128].reshape(-1, 2, 1, 64) >> np.array([0, 4], np.uint8)[:, None]
    qh = b[:, 128:192].reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8)[:, None]
    q = (ql & 15).reshape(-1, 256) | (qh & 3).reshape(-1, 256) << 4
    scale = _f16(b[:, 208:210]) * np.ascontiguousarray(b[:, 192:208]).view(np.int8).astype(np.float32)
    return Groups(scale.reshape(-1, 1), q.reshape(-1, 16).astype(np.float32) - 32, None)


_GROUPS = {Q4_0: _q4_0, Q4_1: _q4_1, Q5_0: _q5_0, Q5_1: _q5_1, Q8_0: _q8_0, Q4_K: _q4_k, Q5_K: _q5_k, Q6_K: _q6_k}


def groups(typ: int, raw: np.ndarray) -> Groups:
    """A quantised tensor's raw GGUF blocks as scales, integers and offsets."""
    if typ not in _GROUPS:
        raise ValueError(f"{type_name(typ)} is not a quantised type")
    return _GROUPS[typ](raw.reshape(-1, BLOCKS[typ][1]))


def dequantize(typ: int, raw: np.ndarray) -> np.ndarray:
    """Raw GGUF data of any type in gguf_file.BLOCKS -> flat float32, bit for bit the `gguf` package's values."""
    if typ == F32:
        return raw.view(np.float32).copy()
    if typ == F16:
        return raw.view(np.float16).astype(np.float32)
    if typ == BF16:
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    g = groups(typ, raw)
    w = g.scale * g.q
    return (w if g.offset is None else w + g.offset).reshape(-1)


def kernel_type(*types: int) -> int:
    """The packed layout the kernels read a matrix in whose tensors (rows stacked or interleaved) have these GGML
    types: theirs if they share one, else F32 (one matrix, one layout)."""
    packed = {KERNEL_TYPE.get(t, F32) for t in types}
    return packed.pop() if len(packed) == 1 else F32


def _f32(b: np.ndarray) -> np.ndarray:
    """(n, 2) f16 bytes -> (n, 4) bytes of the same value as float32."""
    return _f16(b).view(np.uint8)


def _lanes4(q: np.ndarray) -> np.ndarray:
    """4-bit weights (n, 8 sub-blocks, 32) -> 128 bytes in the kernels' order: byte 8s + e of half h holds weights
    8h + e (low nibble) and 16 + 8h + e (high) of sub-block s, so each 4-byte lane of a 64-byte load stays in one
    sub-block, and a sub-block's 8 bytes of each half, side by side, hold its weights 0-15 low and 16-31 high."""
    q = q.reshape(-1, 8, 2, 2, 8)  # sub-block s, nibble, half h, e
    return (q[:, :, 0] | q[:, :, 1] << 4).transpose(0, 2, 1, 3).reshape(-1, 128)


def _lanes_q4_k(b: np.ndarray) -> np.ndarray:
    """Q4_K's 128 nibble bytes (n, 128) -> the kernels' order (_lanes4)."""
    return _lanes4(_k_low(b))


def _native_q4_1(raw: np.ndarray, rows: int) -> np.ndarray:
    """GGUF Q4_1 rows -> the kernels' layout (module docstring): each 8 blocks {f16 d[8], f16 m[8], 128 nibble bytes
    in _lanes4's order}, then the row's last blocks, if it is not whole 256-weight blocks, as they are."""
    b = raw.reshape(rows, -1, 20)
    whole = b.shape[1] // 8 * 8
    sb = b[:, :whole].reshape(-1, 8, 20)
    q = _nibbles(sb[:, :, 4:].reshape(-1, 16)).reshape(-1, 8, 32)
    head = [sb[:, :, 0:2].reshape(-1, 16), sb[:, :, 2:4].reshape(-1, 16), _lanes4(q)]
    return np.concatenate([np.concatenate(head, axis=1).reshape(rows, -1), b[:, whole:].reshape(rows, -1)], axis=1)


def _lanes_q6_k(b: np.ndarray) -> np.ndarray:
    """Q6_K's 192 integer bytes (n, 210) -> the kernels' order: weight 4c + k of group g has its low 4 bits in
    byte 4g + k of half c / 2 (low nibble for even c) and its high 2 in bits 2c, 2c + 1 of byte 4g + k of qh."""
    q = (_q6_k(b).q + 32).astype(np.uint8).reshape(-1, 16, 4, 4)  # group g, chunk c, k
    ql = np.stack([q[:, :, 0] & 15 | (q[:, :, 1] & 15) << 4, q[:, :, 2] & 15 | (q[:, :, 3] & 15) << 4], axis=1)
    qh = sum((q[:, :, c] >> 4) << (2 * c) for c in range(4)).astype(np.uint8)
    return np.concatenate([ql.reshape(-1, 128), qh.reshape(-1, 64)], axis=1)


def _native_k(typ: int, b: np.ndarray) -> np.ndarray:
    """GGUF K-quant blocks (n, bytes) -> the kernels' layout of the same type (module docstring): the f16 scales
    as f32, Q4_K / Q5_K's 6-bit scales and mins one byte each; Q4_K's and Q6_K's integers reordered for the
    integer kernel (kernels/quant.h), Q5_K's bytes as they are."""
    if typ == Q6_K:
        return np.concatenate([_f32(b[:, 208:210]), b[:, 192:208], _lanes_q6_k(b)], axis=1)
    sc, mn = _k_scales(b[:, 4:16])
    head = [_f32(b[:, 0:2]), _f32(b[:, 2:4]), sc.astype(np.uint8), mn.astype(np.uint8)]
    if typ == Q4_K:
        return np.concatenate([*head, _lanes_q4_k(b[:, 16:])], axis=1)
    return np.concatenate([*head, b[:, 16:]], axis=1)  # Q5_K: qh (32 bytes) then qs


def pack(typ: int, raw: np.ndarray, rows: int, to: int | None = None) -> np.ndarray:
    """GGUF blocks of type `typ` -> (rows, row bytes) uint8 in layout `to` (default: kernel_type(typ)), as the
    module docstring lays each out; F32 is the dequantised row."""
    to = kernel_type(typ) if to is None else to
    if to == F32:
        return dequantize(typ, raw).view(np.uint8).reshape(rows, -1)
    if KERNEL_TYPE.get(typ) != to:
        raise ValueError(f"{type_name(typ)} cannot be packed as {type_name(to)} (it packs as "
                         f"{type_name(kernel_type(typ))})")
    if to in (Q4_K, Q5_K, Q6_K):
        return _native_k(typ, raw.reshape(-1, BLOCKS[typ][1])).reshape(rows, -1)
    if to == Q4_1:
        return _native_q4_1(raw, rows)
    g = groups(typ, raw)
    q = g.q.astype(np.int8).view(np.uint8)
    return np.concatenate([g.scale.view(np.uint8), q], axis=1).reshape(rows, -1)


def group(typ: int, rows: np.ndarray) -> np.ndarray:
    """(rows, row bytes) in packed layout `typ` -> flat bytes with the blocks of each G consecutive rows side by
    side (a row's whole blocks, then its tail's: TAIL): a kernel working on G rows at once then reads one
    sequential stream (G separate row streams ran 3x slower)."""
    n, width = rows.shape
    if n % G:
        raise ValueError(f"matrix rows ({n}) must be a multiple of {G}")
    block = LAYOUTS[typ][1]
    whole = width // block * block  # a tail is under one block's bytes (7 Q4_1 blocks: 140 < 160)

    def side_by_side(part: np.ndarray, size: int) -> np.ndarray:
        return part.reshape(n // G, G, -1, size).transpose(0, 2, 1, 3).reshape(n // G, -1)

    parts = [side_by_side(rows[:, :whole], block)]
    if whole < width:
        parts.append(side_by_side(rows[:, whole:], TAIL[typ]))
    return np.ascontiguousarray(np.concatenate(parts, axis=1)).reshape(-1)


def f32(typ: int, raw: np.ndarray) -> np.ndarray:
    """A vector (a norm's weights) of any type, as float32."""
    return dequantize(typ, raw)
