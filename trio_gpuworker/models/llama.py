"""Llama-shaped decoder (llama, qwen2, qwen3: models/architectures.py) as tinygrad-generated kernels: GGUF weights,
KV cache, greedy generation.

This is the decoder for every device tinygrad drives (CUDA, NV, ...), and `decoder = "graph"` on CPU. On CPU the
default is llama_fused.py (one hand-written kernel per step over packed weights, ~14x faster there); both
produce the reference's greedy tokens (tests/test_llama_fidelity.py).

Shapes are fixed so TinyJit can replay the kernels: prefill runs in chunks of PREFILL_CHUNK tokens (the
last one padded) and decode runs one token at a time. Positions are bound symbolic variables, so one
captured graph per phase serves every position up to max_context.
"""

from __future__ import annotations

import pathlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from tinygrad import Tensor, TinyJit, UOp, dtypes, function
from tinygrad.uop.ops import resolve

from .._kinds import DEFAULT_CONTEXT
from ..gguf_file import GGUFTensor, read_tensors
from . import quant
from .architectures import BIASES, HEAD_NORMS, llama_layout
from .greedy import PREFILL_CHUNK, GreedyDecoder

_SPLIT = 64


def _rms_norm(x: Tensor, w: Tensor, eps: float) -> Tensor:
    return x * (x.square().mean(-1, keepdim=True) + eps).rsqrt() * w


def _mv(x: Tensor, w: Tensor) -> Tensor:
    """x (T, i) @ w (o, i).T. For one row, tinygrad's default CPU matvec kernel leaves bandwidth unused;
    partial sums over 64-wide slices, reduced by a second kernel, decode ~25% faster here."""
    o, i = w.shape
    if resolve(x.shape[0] != 1) or i % _SPLIT:
        return x @ w.T
    s = i // _SPLIT
    return (x.reshape(1, 1, s, _SPLIT) * w.reshape(1, o, s, _SPLIT)).sum(-1).contiguous().sum(-1)


def _rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    # Q/K rows are ordered for llama.cpp's "normal" RoPE, which rotates adjacent pairs (models/architectures.py).
    *lead, hd = x.shape
    x = x.reshape(*lead, hd // 2, 2)
    x0, x1 = x[..., 0], x[..., 1]
    return Tensor.stack(x0 * cos - x1 * sin, x0 * sin + x1 * cos, dim=-1).reshape(*lead, hd)


@dataclass(frozen=True)
class _Dims:
    n_heads: int
    n_kv: int
    head_dim: int
    eps: float
    biases: bool  # q/k/v biases
    head_norms: bool  # q/k RMS norms per head, ahead of RoPE


def _project(h: Tensor, w: Tensor, b: Tensor, heads: int, d: _Dims, norm: Tensor | None = None) -> Tensor:
    """h @ w.T (+ b) as (heads, T, head_dim), each head RMS-normed by `norm` where the model has head norms."""
    y = _mv(h, w) + b if d.biases else _mv(h, w)
    y = y.reshape(h.shape[0], heads, d.head_dim)
    if norm is not None and d.head_norms:
        y = _rms_norm(y, norm, d.eps)
    return y.transpose(0, 1)


# One traced body shared by all layers (weights are explicit inputs), so tinygrad schedules it once
# instead of once per layer: that is most of the first-call cost.
@function(precompile=True)
def _block(
    x: Tensor, cache: Tensor, cos: Tensor, sin: Tensor, start: UOp, d: _Dims,
    attn_norm: Tensor, wq: Tensor, wk: Tensor, wv: Tensor, wo: Tensor,
    ffn_norm: Tensor, wg: Tensor, wu: Tensor, wd: Tensor,
    bq: Tensor, bk: Tensor, bv: Tensor, qn: Tensor, kn: Tensor, pos: Tensor,
) -> Tensor:
    T, (H, KV, hd) = x.shape[0], (d.n_heads, d.n_kv, d.head_dim)
    h = _rms_norm(x, attn_norm, d.eps)
    q = _rope(_project(h, wq, bq, H, d, qn), cos, sin)
    k = _rope(_project(h, wk, bk, KV, d, kn), cos, sin)
    v = _project(h, wv, bv, KV, d)
    # Write this step's K/V into the cache and read it back in the same graph. Rows past the prompt in
    # a padded chunk write junk beyond the prompt; decode overwrites each slot before a query can see it.
    kv = Tensor(cache.uop.after(cache[:, :, start : start + T].uop.store(Tensor.stack(k, v).uop)))
    ck, cv = kv[0, :, 0 : start + T], kv[1, :, 0 : start + T]
    # GQA: each KV head serves H/KV query heads, grouped so K/V need no repeat.
    att = (q.reshape(KV, H // KV, T, hd) @ ck.unsqueeze(1).transpose(-1, -2)) * (hd**-0.5)
    if resolve(T != 1):
        # Causal mask from a position table: a symbolic-shaped mask passed in or built with triu
        # trips tinygrad's kernel-graph check inside a function.
        future = pos[0 : start + T].reshape(1, -1) > pos[start : start + T].reshape(-1, 1)
        att = att + future.where(float("-inf"), 0.0)
    o = (att.softmax(-1) @ cv.unsqueeze(1)).reshape(H, T, hd).transpose(0, 1).reshape(T, H * hd)
    x = x + _mv(o, wo)
    h = _rms_norm(x, ffn_norm, d.eps)
    return (x + _mv(_mv(h, wg).silu() * _mv(h, wu), wd)).contiguous()


class LlamaLM(GreedyDecoder):
    def __init__(self, kv: dict[str, Any], raw: dict[str, GGUFTensor], max_context: int) -> None:
        inv_freq = self._hparams(kv, raw, max_context)
        raw = llama_layout(kv, raw, self.head_dim)

        # Dequantise once at load (models/quant.py, any GGUF type): a float32 matvec beats re-unpacking Q4_1
        # nibbles on every token here.
        def w(name: str) -> Tensor:
            t = raw[name]
            return Tensor(quant.dequantize(t.typ, t.data).reshape(t.shape)).contiguous()

        self.tok_embd = w("token_embd.weight")
        self.vocab_size = int(self.tok_embd.shape[0])
        self.output = w("output.weight") if "output.weight" in raw else self.tok_embd
        self.out_norm = w("output_norm.weight")
        # A model without biases or head norms passes one zero in their place, which _block never reads.
        unused = Tensor.zeros(1).contiguous()
        extras = (*BIASES, *HEAD_NORMS)
        has = {n: self.biases for n in BIASES} | {n: self.head_norms for n in HEAD_NORMS}
        self.layers = [
            {k: w(f"blk.{i}.{k}.weight") for k in
             ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")}
            | {n: w(f"blk.{i}.{n}") if has[n] else unused for n in extras}
            for i in range(self.n_layers)
        ]
        # Slots past max_context absorb the padding of a final prefill chunk.
        slots = self.max_context + PREFILL_CHUNK
        ang = np.arange(slots, dtype=np.float64)[:, None] * inv_freq[None, :]
        self.cos = Tensor(np.cos(ang).astype(np.float32)).contiguous()
        self.sin = Tensor(np.sin(ang).astype(np.float32)).contiguous()
        self.pos = Tensor.arange(slots, dtype=dtypes.int32).contiguous()
        self.cache = [Tensor.zeros(2, self.n_kv, slots, self.head_dim).contiguous() for _ in self.layers]
        Tensor.realize(self.tok_embd, self.output, self.out_norm, self.cos, self.sin, self.pos, *self.cache, unused,
                       *{id(t): t for lay in self.layers for t in lay.values()}.values())
        self.dims = _Dims(self.n_heads, self.n_kv, self.head_dim, self.eps, self.biases, self.head_norms)
        self._start = UOp.variable("start_pos", 0, self.max_context - 1)
        self._last = UOp.variable("last_row", 0, PREFILL_CHUNK - 1)
        self._prefill = TinyJit(self._forward)
        self._decode = TinyJit(self._forward)
        self._last_logits: Tensor | None = None

    @classmethod
    def load(cls, gguf_path: pathlib.Path, max_context: int = DEFAULT_CONTEXT, warmup: bool = True) -> LlamaLM:
        """Dequantise the GGUF's weights to float32. `warmup` traces and captures both JIT graphs now
        (seconds), so the first real request runs at steady speed."""
        kv, raw = read_tensors(pathlib.Path(gguf_path))
        lm = cls(kv, raw, max_context)
        if warmup:
            lm.warmup()
        return lm

    def _prefill_step(self, tokens: np.ndarray, start: int, last: int, slot: int = 0) -> int:
        assert slot == 0, "one cache slot: this decoder does not batch"
        chunk = np.zeros(PREFILL_CHUNK, dtype=np.int32)
        chunk[: len(tokens)] = tokens
        nxt, self._last_logits = self._prefill(Tensor(chunk), self._start.bind(start), self._last.bind(last))
        return int(nxt.item())

    def _decode_step(self, token: int, pos: int) -> int:
        nxt, self._last_logits = self._decode(Tensor([token], dtype=dtypes.int32), self._start.bind(pos))
        return int(nxt.item())

    def _logits(self, row: int = 0) -> np.ndarray:
        assert self._last_logits is not None, "no step has run"
        return self._last_logits.numpy().reshape(-1)

    def warmup(self, progress: Callable[[int], None] | None = None) -> None:
        super().warmup(progress)
        self._last_logits = None  # a JIT output: not part of the model the JIT cache stores

    def _forward(self, tokens: Tensor, start: UOp, last: UOp | None = None) -> tuple[Tensor, Tensor]:
        """tokens (T,) int32 at positions start..start+T-1 -> (greedy next id after row `last`, (1,) int32, and
        that row's logits, (1, V) float32: realized anyway for the argmax, read only when sampling)."""
        T = tokens.shape[0]
        x = self.tok_embd[tokens]
        cos, sin = self.cos[start : start + T].reshape(1, T, -1), self.sin[start : start + T].reshape(1, T, -1)
        for lay, cache in zip(self.layers, self.cache, strict=True):
            x = _block(x, cache, cos, sin, start, self.dims, *lay.values(), self.pos)
        if last is not None:
            x = x[last : last + 1]
        logits = _mv(_rms_norm(x, self.out_norm, self.eps), self.output).contiguous()
        nxt = logits.argmax(-1).cast(dtypes.int32)
        Tensor.realize(nxt, logits)
        return nxt, logits
