"""Llama-architecture decoder (SmolLM2) in tinygrad: GGUF weights, KV cache, greedy generation.

Shapes are fixed so TinyJit can replay the kernels: prefill runs in chunks of PREFILL_CHUNK tokens (the
last one padded) and decode runs one token at a time; the position is a bound symbolic variable, so one
captured graph serves every position up to max_context.
"""

from __future__ import annotations

import pathlib
from collections.abc import Callable
from typing import Any

import numpy as np
from tinygrad import Tensor, TinyJit, UOp, dtypes
from tinygrad.llm.gguf import gguf_load

MAX_NEW_TOKENS = 64
PREFILL_CHUNK = 32
SPLIT = 64


def _rms_norm(x: Tensor, w: Tensor, eps: float) -> Tensor:
    return x * (x.square().mean(-1, keepdim=True) + eps).rsqrt() * w


def _mv(x: Tensor, w: Tensor) -> Tensor:
    """x (T, i) @ w (o, i).T. For one row, tinygrad's default CPU kernel for a matvec leaves most of the
    bandwidth unused; splitting the reduction into 96-wide partial sums (two kernels) is ~2x faster."""
    o, i = w.shape
    c = SPLIT
    if x.shape[0] > 1 or not c or i % c:
        return x @ w.T
    s = i // c
    return (x.reshape(1, 1, s, c) * w.reshape(1, o, s, c)).sum(-1).contiguous().sum(-1).contiguous()


def _rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    # GGUF llama Q/K rows are permuted for llama.cpp's "normal" RoPE, which rotates adjacent pairs.
    *lead, hd = x.shape
    x = x.reshape(*lead, hd // 2, 2)
    x0, x1 = x[..., 0], x[..., 1]
    return Tensor.stack(x0 * cos - x1 * sin, x0 * sin + x1 * cos, dim=-1).reshape(*lead, hd)


class LlamaLM:
    def __init__(self, kv: dict[str, Any], sd: dict[str, Tensor], max_context: int) -> None:
        arch = kv["general.architecture"]
        if arch != "llama":
            raise ValueError(f"unsupported architecture {arch!r}")
        g = lambda k, d=None: kv.get(f"{arch}.{k}", d)  # noqa: E731
        self.n_layers, self.dim = int(g("block_count")), int(g("embedding_length"))
        self.n_heads, self.n_kv = int(g("attention.head_count")), int(g("attention.head_count_kv"))
        self.head_dim = self.dim // self.n_heads
        self.hidden = int(g("feed_forward_length"))
        self.eps = float(g("attention.layer_norm_rms_epsilon"))
        self.max_context = min(max_context, int(g("context_length")))
        theta = float(g("rope.freq_base", 10000.0))
        eos = kv.get("tokenizer.ggml.eos_token_id")
        toks: list[str] = kv.get("tokenizer.ggml.tokens", [])
        types: list[int] = kv.get("tokenizer.ggml.token_type", [])
        # Same end-of-generation set as the tokenizer: declared EOS plus ChatML/GPT end markers.
        self.eos_ids: set[int] = {int(eos)} if eos is not None else set()
        self.eos_ids |= {i for i, t in enumerate(toks) if t in ("<|im_end|>", "<|endoftext|>") and types[i] == 3}

        # Dequantise once at load: a float32 matvec beats re-unpacking Q4_1 nibbles on every token here.
        def w(name: str) -> Tensor:
            return sd[name].float().contiguous()

        self.tok_embd = w("token_embd.weight")
        self.output = w("output.weight") if "output.weight" in sd else self.tok_embd
        self.out_norm = w("output_norm.weight")
        # Q/K/V and gate/up share their input, so each pair runs as one wider matvec.
        self.layers = [
            {
                "attn_norm": w(f"blk.{i}.attn_norm.weight"),
                "qkv": Tensor.cat(*[w(f"blk.{i}.attn_{n}.weight") for n in "qkv"]).contiguous(),
                "attn_output": w(f"blk.{i}.attn_output.weight"),
                "ffn_norm": w(f"blk.{i}.ffn_norm.weight"),
                "gate_up": Tensor.cat(w(f"blk.{i}.ffn_gate.weight"), w(f"blk.{i}.ffn_up.weight")).contiguous(),
                "ffn_down": w(f"blk.{i}.ffn_down.weight"),
            }
            for i in range(self.n_layers)
        ]
        freqs = 1.0 / (theta ** (np.arange(0, self.head_dim, 2, dtype=np.float64) / self.head_dim))
        # Slots past max_context absorb the padding of a final prefill chunk.
        slots = self.max_context + PREFILL_CHUNK
        ang = np.arange(slots, dtype=np.float64)[:, None] * freqs[None, :]
        self.cos = Tensor(np.cos(ang).astype(np.float32)).contiguous()
        self.sin = Tensor(np.sin(ang).astype(np.float32)).contiguous()
        self.cache = [Tensor.zeros(2, self.n_kv, slots, self.head_dim).contiguous() for _ in self.layers]
        Tensor.realize(
            self.tok_embd,
            self.output,
            self.out_norm,
            self.cos,
            self.sin,
            *self.cache,
            *[t for lay in self.layers for t in lay.values()],
        )
        self._start = UOp.variable("start_pos", 0, self.max_context - 1)
        self._prefill = TinyJit(self._forward)
        self._decode = TinyJit(self._forward)

    @classmethod
    def load(cls, gguf_path: pathlib.Path, max_context: int = 1024) -> LlamaLM:
        kv, sd = gguf_load(pathlib.Path(gguf_path))
        return cls(kv, sd, max_context)

    def _forward(self, tokens: Tensor, start: UOp) -> Tensor:
        """tokens (T,) int32 at positions start..start+T-1 -> greedy next id for every row, (T,) int32."""
        T = tokens.shape[0]
        H, KV, hd, hidden = self.n_heads, self.n_kv, self.head_dim, self.hidden
        x = self.tok_embd[tokens]
        cos, sin = self.cos[start : start + T].reshape(1, T, -1), self.sin[start : start + T].reshape(1, T, -1)
        # Rows past the prompt in a padded chunk write junk into the cache beyond the prompt; decode
        # overwrites each slot before any query can see it, and the causal mask hides it until then.
        mask = Tensor.full((1, 1, T, start + T), float("-inf")).triu(start + 1) if T > 1 else None
        for lay, cache in zip(self.layers, self.cache):
            h = _rms_norm(x, lay["attn_norm"], self.eps)
            qkv = _mv(h, lay["qkv"])
            q = _rope(qkv[:, : H * hd].reshape(T, H, hd).transpose(0, 1), cos, sin)
            k = _rope(qkv[:, H * hd : (H + KV) * hd].reshape(T, KV, hd).transpose(0, 1), cos, sin)
            v = qkv[:, (H + KV) * hd :].reshape(T, KV, hd).transpose(0, 1)
            cache[:, :, start : start + T].assign(Tensor.stack(k, v)).realize()
            ck, cv = cache[0, :, 0 : start + T], cache[1, :, 0 : start + T]
            # GQA: each KV head serves H/KV query heads, grouped so K/V need no repeat.
            qg = q.reshape(KV, H // KV, T, hd)
            att = (qg @ ck.unsqueeze(1).transpose(-1, -2)) * (hd**-0.5)
            if mask is not None:
                att = att + mask
            o = (att.softmax(-1) @ cv.unsqueeze(1)).reshape(H, T, hd).transpose(0, 1).reshape(T, H * hd)
            x = x + _mv(o, lay["attn_output"])
            h = _rms_norm(x, lay["ffn_norm"], self.eps)
            gu = _mv(h, lay["gate_up"])
            x = (x + _mv(gu[:, :hidden].silu() * gu[:, hidden:], lay["ffn_down"])).contiguous()
        logits = _mv(_rms_norm(x, self.out_norm, self.eps), self.output)
        return logits.argmax(-1).cast(dtypes.int32).realize()

    def generate(
        self, prompt_ids: np.ndarray, max_tokens: int, progress: Callable[[int], None] | None = None
    ) -> tuple[list[int], str]:
        if not 1 <= max_tokens <= MAX_NEW_TOKENS:
            raise ValueError(f"max_tokens must be 1..{MAX_NEW_TOKENS}, got {max_tokens}")
        ids = np.asarray(prompt_ids, dtype=np.int32).reshape(-1)
        n = len(ids)
        if n == 0:
            raise ValueError("empty prompt")
        # Every generated token but the last is fed back, so it needs a cache slot too.
        if n + max_tokens - 1 > self.max_context:
            raise ValueError(f"prompt of {n} tokens + {max_tokens} new exceeds the {self.max_context}-token context")
        nxt = 0
        for s in range(0, n, PREFILL_CHUNK):
            chunk = np.zeros(PREFILL_CHUNK, dtype=np.int32)
            chunk[: min(PREFILL_CHUNK, n - s)] = ids[s : s + PREFILL_CHUNK]
            out = self._prefill(Tensor(chunk), self._start.bind(s)).numpy()
            nxt = int(out[min(PREFILL_CHUNK, n - s) - 1])
        out_ids: list[int] = []
        pos = n
        while True:
            if nxt in self.eos_ids:
                return out_ids, "stop"
            out_ids.append(nxt)
            if progress is not None:
                progress(len(out_ids))
            if len(out_ids) == max_tokens:
                return out_ids, "length"
            nxt = int(self._decode(Tensor([nxt], dtype=dtypes.int32), self._start.bind(pos)).item())
            pos += 1
