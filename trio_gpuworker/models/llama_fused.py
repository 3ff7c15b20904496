"""Llama-architecture decoder (SmolLM2) for tinygrad's CPU device: packed GGUF weights, KV cache, greedy generation.

The CPU default (`decoder = "fused"`): its kernel is C source run through tinygrad's custom_kernel, so tinygrad
compiles, caches, captures and replays it, but it only runs where tinygrad compiles C (CPU). Other devices use
llama.py, whose kernels tinygrad generates.

Shapes are fixed so TinyJit can replay the kernels: prefill runs in chunks of PREFILL_CHUNK tokens (the
last one padded) and decode runs one token at a time. Each call takes one int32 tensor, the chunk's ids
followed by its start position and the row whose next token is wanted, so one captured graph per phase
serves every position up to max_context with no symbolic shapes.

Quantised matrices stay packed and are dequantised in registers (quant.py), so a decode step reads ~110 MB
instead of 540 MB of float32. The whole forward pass is one C kernel: a tinygrad launch costs ~80 us of
Python here, which was a third of a step even at one kernel per layer half.
"""

from __future__ import annotations

import pathlib
from typing import Any

import numpy as np
from tinygrad import Tensor, TinyJit, dtypes

from . import quant
from .greedy import DEFAULT_CONTEXT, PREFILL_CHUNK, GreedyDecoder

# Layer weights are stacked: layer l's block of a kind starts at l * its size. Scratch: x, h, then either
# q|k|v + attention output, or gate/up pairs + their product; logits last.
_FORWARD = """(int *restrict out, float *restrict scr, float *restrict cache, const int *restrict ids,
    const unsigned char *restrict embd, const float *restrict an, const unsigned char *restrict wqkv,
    const unsigned char *restrict wo, const float *restrict fn, const unsigned char *restrict wgu,
    const unsigned char *restrict wd, const double *restrict rope, const float *restrict on,
    const unsigned char *restrict wout) {
  /* rows past the one predicted from are padding: skip them, up to the matmul tile */
  int start = ids[T], n = (ids[T + 1] + NT) / NT * NT;
  float *x = scr, *h = x + T * D, *qkv = h + T * D, *ao = qkv + T * NQKV, *gu = qkv, *a = gu + T * 2 * FF;
  float *lg = qkv + T * (NQKV + D > 3 * FF ? NQKV + D : 3 * FF);
  double sc[GQ][S + 8];
  for (int t = 0; t < n; t++) for (int b = 0; b < D / 32; b++) {
    v16 lo, hi; dqe(embd + (((long)(ids[t] / G) * (D / 32) + b) * G + ids[t] % G) * BSE, &lo, &hi);
    *(v16 *)(x + t * D + b * 32) = lo; *(v16 *)(x + t * D + b * 32 + 16) = hi;
  }
  for (int l = 0; l < NL; l++) {
    float *kc = cache + (long)l * 2 * KV * S * HD, *vc = kc + (long)KV * S * HD;
    for (int t = 0; t < n; t++) rmsnorm(h + t * D, x + t * D, an + l * D);
    mmq(qkv, NQKV, h, D, wqkv + (long)l * SZQKV, NQKV, D / 32, n);
    for (int t = 0; t < n; t++) {
      int pos = start + t; float *q = qkv + t * NQKV, *v = q + (H + KV) * HD;
      const double *cs = rope + (long)pos * HD;
      /* q and k heads are adjacent; pairs (2i, 2i+1) rotate in double like the reference's complex128 */
      for (int i = 0; i < (H + KV) * HD / 2; i++) {
        #pragma clang fp contract(off)
        double re = q[2 * i], im = q[2 * i + 1], c = cs[i % (HD / 2)], s = cs[HD / 2 + i % (HD / 2)];
        q[2 * i] = (float)(re * c - im * s); q[2 * i + 1] = (float)(re * s + im * c);
      }
      for (int g = 0; g < KV; g++) for (int i = 0; i < HD; i++) {
        kc[((long)g * S + pos) * HD + i] = q[(H + g) * HD + i]; vc[((long)g * S + pos) * HD + i] = v[g * HD + i];
      }
    }
    /* the H / KV query heads sharing a KV head go together: each cached K and V row is read once */
    for (int t = 0; t < n; t++) for (int g = 0; g < KV; g++) {
      int pos = start + t; const float *q = qkv + t * NQKV + g * GQ * HD;
      /* the reference divides float32 scores by a float64 sqrt, so its softmax runs in float64 */
      double mx[GQ], sum[GQ], o[GQ][HD];
      for (int r = 0; r < GQ; r++) { mx[r] = -__builtin_inf(); sum[r] = 0; for (int i = 0; i < HD; i++) o[r][i] = 0; }
      for (int j = 0; j <= pos; j++) {
        const float *k = kc + ((long)g * S + j) * HD;
        for (int r = 0; r < GQ; r++) {
          v16 d = (v16)0;
          for (int i = 0; i < HD; i += 16) d += *(const v16 *)(q + r * HD + i) * *(const v16 *)(k + i);
          sc[r][j] = hsum(d) / SQRT_HD; mx[r] = sc[r][j] > mx[r] ? sc[r][j] : mx[r];
        }
      }
      for (int r = 0; r < GQ; r++) {
        for (int j = pos + 1; j < pos + 8; j++) sc[r][j] = mx[r];
        for (int j = 0; j <= pos; j += 8) *(v8d *)(sc[r] + j) = vexp(*(v8d *)(sc[r] + j) - mx[r]);
        for (int j = 0; j <= pos; j++) sum[r] += sc[r][j];
      }
      for (int j = 0; j <= pos; j++) {
        const float *vv = vc + ((long)g * S + j) * HD;
        for (int r = 0; r < GQ; r++) {
          double p = sc[r][j] / sum[r];
          for (int i = 0; i < HD; i++) o[r][i] += p * vv[i];
        }
      }
      for (int r = 0; r < GQ; r++) for (int i = 0; i < HD; i++) ao[t * D + (g * GQ + r) * HD + i] = (float)o[r][i];
    }
    mmo(h, D, ao, D, wo + (long)l * SZO, D, D / 32, n);
    for (int i = 0; i < n * D; i++) x[i] = x[i] + h[i];
    for (int t = 0; t < n; t++) rmsnorm(h + t * D, x + t * D, fn + l * D);
    mmgu(gu, 2 * FF, h, D, wgu + (long)l * SZGU, 2 * FF, D / 32, n);
    for (int i = 0; i < n * FF; i++) { float g = gu[2 * i]; a[i] = g / (1.0f + __builtin_expf(-g)) * gu[2 * i + 1]; }
    mmd(h, D, a, FF, wd + (long)l * SZD, D, FF / 32, n);
    for (int i = 0; i < n * D; i++) x[i] = x[i] + h[i];
  }
  rmsnorm(h, x + ids[T + 1] * D, on);
  mmh(lg, V, h, D, wout, V, D / 32, 1);
  int best = 0; for (int i = 1; i < V; i++) if (lg[i] > lg[best]) best = i;  /* first max, like numpy */
  out[0] = best;
}
"""


class FusedLlamaLM(GreedyDecoder):
    def __init__(self, kv: dict[str, Any], raw: dict[str, quant.Raw], max_context: int) -> None:
        theta = self._hparams(kv, max_context)
        self.ff = int(raw["blk.0.ffn_gate.weight"][1][0])
        if self.dim % 32 or self.ff % 32 or self.head_dim % 16 or self.n_heads % self.n_kv:
            raise ValueError("dimensions must be multiples of the 32-element quant block")

        def mat(*names: str, interleave: bool = False) -> tuple[int, np.ndarray]:
            """Packed rows of one or more matrices of one GGML type, stacked (or row-interleaved)."""
            types = {raw[n][0] for n in names}
            if len(types) != 1:
                raise ValueError(f"{names} mix GGML types {types}")
            typ = types.pop()
            parts = [quant.pack(typ, raw[n][2], raw[n][1][0]) for n in names]
            return typ, quant.group(typ, np.stack(parts, 1).reshape(-1, parts[0].shape[1]) if interleave
                                    else np.concatenate(parts))

        def vec(name: str) -> np.ndarray:
            return quant.f32(raw[name][0], raw[name][2])

        def stacked(kind: str, *names: str, interleave: bool = False) -> Tensor:
            """One matrix kind of every layer back to back; the kernel needs one GGML type per kind."""
            got = [mat(*(f"blk.{i}.{n}.weight" for n in names), interleave=interleave) for i in range(self.n_layers)]
            if len(types := {t for t, _ in got}) != 1:
                raise ValueError(f"{kind} matrices mix GGML types {types}")
            self.types[kind] = types.pop()
            return Tensor(np.concatenate([w for _, w in got]))

        self.types: dict[str, int] = {}
        self.embd_type, embd = mat("token_embd.weight")
        self.vocab_size = int(raw["token_embd.weight"][1][0])
        self.out_type, out = mat("output.weight") if "output.weight" in raw else (self.embd_type, embd)
        self.tok_embd = Tensor(embd)
        self.output = Tensor(out) if out is not embd else self.tok_embd
        self.out_norm = Tensor(vec("output_norm.weight"))
        self.attn_norm = Tensor(np.concatenate([vec(f"blk.{i}.attn_norm.weight") for i in range(self.n_layers)]))
        self.ffn_norm = Tensor(np.concatenate([vec(f"blk.{i}.ffn_norm.weight") for i in range(self.n_layers)]))
        self.wqkv = stacked("q", "attn_q", "attn_k", "attn_v")
        self.wo = stacked("o", "attn_output")
        self.wgu = stacked("gu", "ffn_gate", "ffn_up", interleave=True)
        self.wd = stacked("d", "ffn_down")
        # Slots past max_context absorb the padding of a final prefill chunk.
        self.slots = self.max_context + PREFILL_CHUNK
        # RoPE factors in float64, computed as the reference does (complex exponential of pos * inv_freq).
        inv_freq = theta ** (-np.arange(0, self.head_dim, 2, dtype=np.float64) / self.head_dim)
        rot = np.exp(1j * np.arange(self.slots)[:, None] * inv_freq[None, :])
        self.rope = Tensor(np.concatenate([rot.real, rot.imag], axis=1).reshape(-1))
        self.cache = Tensor.zeros(self.n_layers * 2 * self.n_kv * self.slots * self.head_dim).contiguous()
        self.weights = [self.tok_embd, self.attn_norm, self.wqkv, self.wo, self.ffn_norm, self.wgu, self.wd,
                        self.rope, self.out_norm, self.output]
        Tensor.realize(self.cache, *self.weights)
        self._prefill = TinyJit(self._forward)
        self._decode = TinyJit(self._forward)
        # Persistent JIT inputs, written in place: a fresh Tensor(ids) and .item() schedule a copy each, which
        # cost ~2.5 ms of Python per decode step here.
        self._ids = {n: Tensor.zeros(n + 2, dtype=dtypes.int32).contiguous().realize() for n in (PREFILL_CHUNK, 1)}

    @classmethod
    def load(cls, gguf_path: pathlib.Path, max_context: int = DEFAULT_CONTEXT, warmup: bool = True) -> FusedLlamaLM:
        """Pack the GGUF's weights. `warmup` traces and captures both JIT graphs now (seconds), so the first
        real request runs at steady speed."""
        kv, raw = quant.gguf_raw(pathlib.Path(gguf_path))
        lm = cls(kv, raw, max_context)
        if warmup:
            lm.warmup()
        return lm

    def _prefill_step(self, tokens: np.ndarray, start: int, last: int) -> int:
        return self._step(self._prefill, tokens, start, last)

    def _decode_step(self, token: int, pos: int) -> int:
        return self._step(self._decode, [token], pos, 0)

    def _step(self, jit: TinyJit, tokens: np.ndarray | list[int], start: int, last: int) -> int:
        """One replay: `tokens` at positions start.., the next id after row `last`."""
        ids = self._ids[PREFILL_CHUNK if jit is self._prefill else 1]
        view = np.frombuffer(ids.uop.buffer.as_memoryview(force_zero_copy=True), np.int32)
        view[:] = 0
        view[: len(tokens)], view[-2:] = tokens, (start, last)
        out = jit(ids).uop.buffer.as_memoryview(force_zero_copy=True)
        return int(np.frombuffer(out, np.int32)[0])

    def _forward(self, ids: Tensor) -> Tensor:
        """ids (T + 2,) int32: T tokens, their start position, the row to predict from -> next id, (1,) int32."""
        T, D, H, KV, HD = ids.shape[0] - 2, self.dim, self.n_heads, self.n_kv, self.head_dim
        FF, V = self.ff, self.vocab_size
        nqkv, nt, ty = (H + 2 * KV) * HD, 4 if T % 4 == 0 else 1, self.types
        defs = {"T": T, "D": D, "H": H, "KV": KV, "HD": HD, "FF": FF, "V": V, "S": self.slots, "NL": self.n_layers,
                "NQKV": nqkv, "NT": nt, "GQ": H // KV, "EPS": f"{self.eps!r}f", "SQRT_HD": f"{float(np.sqrt(HD))!r}",
                "G": quant.G, "dqe": f"dq{self.embd_type}", "BSE": quant.PACKED[self.embd_type],
                **{f"SZ{k.upper()}": getattr(self, f"w{k}").nbytes() // self.n_layers for k in ("qkv", "o", "gu", "d")}}
        src = quant.c_source("forward", defs, {"mmq": (ty["q"], nt), "mmo": (ty["o"], nt), "mmgu": (ty["gu"], nt),
                                               "mmd": (ty["d"], nt), "mmh": (self.out_type, 1)}, _FORWARD)
        scratch = Tensor.empty(T * 2 * D + T * max(nqkv + D, 3 * FF) + V)
        macs = T * self.n_layers * D * (nqkv + D + 3 * FF) + D * V
        mem = sum(w.nbytes() for w in (self.wqkv, self.wo, self.wgu, self.wd, self.output))
        return quant.kernel("forward", src, [Tensor.empty(1, dtype=dtypes.int32), scratch, self.cache],
                            [ids, *self.weights], inout=(2,), ops=2 * macs, mem=mem)[0].realize()
