"""Quantised GGUF weights kept packed on the device, and the C helpers that dequantise them in registers.

tinygrad's own codegen reaches 1-2 GMAC/s on an unpacked-nibble matvec on this CPU and each launch costs
~40-80 us of Python, so the decoder's kernels are hand-written C compiled by tinygrad's clang pipeline (a
PROGRAM body in a custom kernel, `kernel` below): dequantise-and-multiply tiles, RMSNorm, and the GGUF
reading and re-packing they need. Each 32-element block dequantises to the reference's exact float32
weights: q*d is exact in float32 (a 4- or 8-bit q times an f16 scale), so q*d + m rounds once, as the
reference's does (tests/test_llama_quant.py checks it bit for bit).
"""

from __future__ import annotations

import pathlib
from typing import Any

import numpy as np
from tinygrad import Device, Tensor, UOp
from tinygrad.llm.gguf import read_int32, read_int64, read_str, read_uint32, read_uint64, readers
from tinygrad.renderer import Estimates
from tinygrad.uop.ops import KernelInfo, Ops, ProgramInfo

F32, F16, Q4_1, Q8_0 = 0, 1, 3, 8
# GGUF block (elements, bytes) -> packed bytes: f16 scales widened to f32 at load, so a kernel never converts.
_GGUF_BLOCK = {F32: (1, 4), F16: (1, 2), Q4_1: (32, 20), Q8_0: (32, 34)}
PACKED = {Q4_1: 24, Q8_0: 36}
Raw = tuple[int, tuple[int, ...], np.ndarray]  # ggml type, shape outermost first, raw bytes
G = 4  # rows per kernel tile, and per interleaved group of packed rows


def gguf_raw(path: pathlib.Path) -> tuple[dict[str, Any], dict[str, Raw]]:
    """(metadata, name -> Raw tensor) without dequantising anything."""
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF" or read_int32(f) not in (2, 3):
            raise ValueError(f"{path} is not a GGUF v2/v3 file")
        n_tensors, n_kv = read_int64(f), read_int64(f)
        kv: dict[str, Any] = {}
        for _ in range(n_kv):
            k = read_str(f)
            kv[k] = readers[read_int32(f)](f)
        infos = [(read_str(f), tuple(read_uint64(f) for _ in range(read_uint32(f))), read_int32(f), read_uint64(f))
                 for _ in range(n_tensors)]
        align = kv.get("general.alignment", 32)
        start = -(-f.tell() // align) * align
    data = np.memmap(path, np.uint8, "r", offset=start).view(np.ndarray)
    out = {}
    for name, dims, typ, off in infos:
        if typ not in _GGUF_BLOCK:
            raise ValueError(f"{name}: GGML type {typ} is not supported")
        el, nb = _GGUF_BLOCK[typ]
        out[name] = (typ, tuple(int(d) for d in reversed(dims)), data[off : off + int(np.prod(dims)) // el * nb])
    return kv, out


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


_HEAD = """typedef float v16 __attribute__((ext_vector_type(16), aligned(4)));
typedef float v8 __attribute__((ext_vector_type(8)));
typedef float v4 __attribute__((ext_vector_type(4)));
typedef unsigned char u16 __attribute__((ext_vector_type(16), aligned(1)));
typedef signed char s16 __attribute__((ext_vector_type(16), aligned(1)));
#define INL static inline __attribute__((always_inline))
INL float hsum(v16 a) { v8 b = a.lo + a.hi; v4 c = b.lo + b.hi; return (c.x + c.y) + (c.z + c.w); }
typedef int i16 __attribute__((ext_vector_type(16)));
INL void dq3(const unsigned char *p, v16 *lo, v16 *hi) {
  float d = ((const float *)p)[0], m = ((const float *)p)[1];
#ifdef __AVX512F__
  /* the block's 16 possible weights, looked up by nibble (vpermps reads the low 4 bits of each index) */
  const v16 iota = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  v16 tab = iota * d + m;  /* q*d is exact in float32 (4-bit q, f16 d): with or without FMA, the reference's weights */
  i16 q = __builtin_convertvector(*(const u16 *)(p + 8), i16);
  *lo = __builtin_ia32_permvarsf512(tab, q); *hi = __builtin_ia32_permvarsf512(tab, q >> 4);
#else
  u16 q = *(const u16 *)(p + 8);
  *lo = __builtin_convertvector(q & 15, v16) * d + m; *hi = __builtin_convertvector(q >> 4, v16) * d + m;
#endif
}
INL void dq8(const unsigned char *p, v16 *lo, v16 *hi) {
  float d = *(const float *)p;
  *lo = __builtin_convertvector(*(const s16 *)(p + 4), v16) * d;
  *hi = __builtin_convertvector(*(const s16 *)(p + 20), v16) * d;
}
typedef double v8d __attribute__((ext_vector_type(8), aligned(8)));
typedef long v8l __attribute__((ext_vector_type(8)));
/* exp(x) of 8 softmax terms (x <= 0) to ~1 ulp: x = k ln2 + r, |r| <= ln2/2, degree-12 Taylor series of e^r;
   a libm call per term was most of the attention time */
INL v8d vexp(v8d x) {
  v8l under = x < -708.0;
  x = (v8d)(((v8l)x & ~under) | ((v8l)(v8d)-708.0 & under));
  v8d k = (x * 1.4426950408889634 + 6755399441055744.0) - 6755399441055744.0;
  v8d r = x - k * 6.93147180369123816490e-01 - k * 1.90821492927058770002e-10, p = (v8d)(1.0 / 479001600.0);
  for (int i = 11; i >= 1; i--) { double f = 1; for (int j = 2; j <= i; j++) f *= j; p = p * r + 1.0 / f; }
  p = p * r + 1.0;
  return p * (v8d)((__builtin_convertvector(k, v8l) + 1023) << 52);
}
INL void rmsnorm(float *restrict h, const float *restrict x, const float *restrict w) {
  double ss = 0; for (int i = 0; i < D; i++) ss += (double)x[i] * x[i];
  float s = __builtin_sqrtf((float)(ss / D) + EPS);
  for (int i = 0; i < D; i++) h[i] = x[i] / s * w[i];
}
"""


def _mm(name: str, typ: int, NT: int) -> str:
    """y[t*ys + o] = x[t] . W[o] for t < n (a multiple of NT), o < O (a multiple of G). A G x NT tile of
    accumulators hides the FMA latency; each dequantised block is reused for NT rows of x."""
    bs = PACKED[typ]
    return f"""INL void {name}(float *restrict y, int ys, const float *restrict x, int xs,
                    const unsigned char *restrict w, int O, int nb, int n) {{
  for (int o = 0; o < O; o += {G}) for (int t = 0; t < n; t += {NT}) {{
    const unsigned char *g = w + (long)o * nb * {bs};
    v16 acc[{G}][{NT}], acc2[{G}][{NT}];
    for (int r = 0; r < {G}; r++) for (int j = 0; j < {NT}; j++) acc[r][j] = acc2[r][j] = (v16)0;
    for (int b = 0; b < nb; b++) {{
      v16 wl[{G}], wh[{G}];
      for (int r = 0; r < {G}; r++) dq{typ}(g + (b * {G} + r) * {bs}, &wl[r], &wh[r]);
      for (int j = 0; j < {NT}; j++) {{
        const float *xp = x + (t + j) * xs + b * 32; v16 xl = *(const v16 *)xp, xh = *(const v16 *)(xp + 16);
        /* one row of x: lo and hi halves get their own accumulators, for twice the independent FMA chains */
        for (int r = 0; r < {G}; r++) if ({NT} == 1) {{ acc[r][j] += wl[r] * xl; acc2[r][j] += wh[r] * xh; }}
                                      else {{ acc[r][j] += wl[r] * xl; acc[r][j] += wh[r] * xh; }}
      }}
    }}
    for (int r = 0; r < {G}; r++) for (int j = 0; j < {NT}; j++) y[(t + j) * ys + o + r] = hsum(acc[r][j] + acc2[r][j]);
  }}
}}
"""


def c_source(name: str, defs: dict[str, Any], mms: dict[str, tuple[int, int]], body: str) -> str:
    """A kernel's C: `#define`s, the helpers above, matmuls `name: (ggml type, rows per x tile)`, then
    `void name` + body. Everything but the entry point is inlined, so it is the first code in the image."""
    return ("".join(f"#define {k} {v}\n" for k, v in defs.items()) + _HEAD
            + "".join(_mm(n, typ, nt) for n, (typ, nt) in mms.items()) + f"void {name}{body}")


def kernel(name: str, src: str, outs: list[Tensor], ins: list[Tensor], inout: tuple[int, ...] = (),
           ops: int = 0, mem: int = 0) -> list[Tensor]:
    """Run C `src` (one function taking the buffers of outs then ins, in order) as a tinygrad kernel; `inout`
    are the indices of outs that it also reads (a KV cache). `ops`/`mem` are the estimates DEBUG=2 shows."""
    n, target = len(outs) + len(ins), Device[outs[0].device].renderer.target

    def fxn(*ps: UOp) -> UOp:
        sink = UOp.sink(arg=KernelInfo(name, estimates=Estimates(ops=ops, lds=mem, mem=mem)))
        info = ProgramInfo(name, (1, 1, 1), (1, 1, 1), (), tuple(range(n)), tuple(range(len(outs))),
                           inout + tuple(range(len(outs), n)), target)
        return UOp(Ops.PROGRAM, src=(sink, UOp(Ops.LINEAR, src=ps), UOp(Ops.SOURCE, arg=src)), arg=info)

    return outs[0].custom_kernel(*outs[1:], *ins, fxn=fxn)[: len(outs)]
