"""Llama-architecture decoder (SmolLM2) in tinygrad: packed GGUF weights, KV cache, greedy generation.

Shapes are fixed so TinyJit can replay the kernels: prefill runs in chunks of PREFILL_CHUNK tokens (the
last one padded) and decode runs one token at a time. Each call takes one int32 tensor, the chunk's ids
followed by its start position and the row whose next token is wanted, so one captured graph per phase
serves every position up to max_context with no symbolic shapes.

Quantised matrices stay packed (quant.py): a decode step reads ~90 MB instead of 540 MB of float32, in
62 kernels (embedding, an attention and an FFN kernel per layer, head + argmax).
"""

from __future__ import annotations

import pathlib
from collections.abc import Callable
from typing import Any

import numpy as np
from tinygrad import Tensor, TinyJit, dtypes

from trio_gpuworker.gguf_meta import end_of_generation_ids

from . import quant
from ._jitstate import restore_written_sets, written_sets

MAX_NEW_TOKENS = 64
PREFILL_CHUNK = 32
DEFAULT_CONTEXT = 2048


class LlamaLM:
    def __init__(self, kv: dict[str, Any], raw: dict[str, quant.Raw], max_context: int) -> None:
        arch = kv["general.architecture"]
        if arch != "llama":
            raise ValueError(f"unsupported architecture {arch!r}")
        g = lambda k, d=None: kv.get(f"{arch}.{k}", d)  # noqa: E731
        self.n_layers, self.dim = int(g("block_count")), int(g("embedding_length"))
        self.n_heads, self.n_kv = int(g("attention.head_count")), int(g("attention.head_count_kv"))
        self.head_dim = int(g("attention.key_length", self.dim // self.n_heads))
        if int(g("rope.dimension_count", self.head_dim)) != self.head_dim:
            raise ValueError("partial RoPE is not supported")
        self.eps = float(g("attention.layer_norm_rms_epsilon"))
        self.max_context = min(max_context, int(g("context_length")))
        theta = float(g("rope.freq_base", 10000.0))
        self.eos_ids: set[int] = end_of_generation_ids(kv)
        if self.dim % 32 or self.head_dim % 16 or self.n_heads % self.n_kv:
            raise ValueError("dimensions must be multiples of the 32-element quant block")

        def mat(*names: str, interleave: bool = False) -> tuple[int, Tensor]:
            """Packed rows of one or more matrices of one GGML type, stacked (or row-interleaved)."""
            types = {raw[n][0] for n in names}
            if len(types) != 1:
                raise ValueError(f"{names} mix GGML types {types}")
            typ = types.pop()
            parts = [quant.pack(typ, raw[n][2], raw[n][1][0]) for n in names]
            packed = np.stack(parts, 1).reshape(-1, parts[0].shape[1]) if interleave else np.concatenate(parts)
            return typ, Tensor(quant.group(typ, packed))

        def vec(name: str) -> Tensor:
            return Tensor(quant.f32(raw[name][0], raw[name][2]))

        self.embd_type, self.tok_embd = mat("token_embd.weight")
        self.vocab_size = int(raw["token_embd.weight"][1][0])
        self.out_type, self.output = mat("output.weight") if "output.weight" in raw else (self.embd_type, self.tok_embd)
        self.out_norm = vec("output_norm.weight")
        self.ff = int(raw["blk.0.ffn_gate.weight"][1][0])
        self.layers: list[dict[str, Tensor]] = []
        self.types: dict[str, int] = {}
        for i in range(self.n_layers):
            b = f"blk.{i}."
            (tq, wqkv), (to, wo) = mat(*(b + f"attn_{n}.weight" for n in "qkv")), mat(b + "attn_output.weight")
            (tgu, wgu), (td, wd) = mat(b + "ffn_gate.weight", b + "ffn_up.weight", interleave=True), \
                mat(b + "ffn_down.weight")
            t = {"q": tq, "o": to, "gu": tgu, "d": td}
            self.types = self.types or t
            if t != self.types:
                raise ValueError(f"layer {i}: quant types {t} differ from layer 0's {self.types}")
            self.layers.append({"attn_norm": vec(b + "attn_norm.weight"), "wqkv": wqkv, "wo": wo,
                                "ffn_norm": vec(b + "ffn_norm.weight"), "wgu": wgu, "wd": wd})
        # Slots past max_context absorb the padding of a final prefill chunk.
        self.slots = self.max_context + PREFILL_CHUNK
        # RoPE factors in float64, computed as the reference does (complex exponential of pos * inv_freq).
        inv_freq = theta ** (-np.arange(0, self.head_dim, 2, dtype=np.float64) / self.head_dim)
        rot = np.exp(1j * np.arange(self.slots)[:, None] * inv_freq[None, :])
        self.rope = Tensor(np.concatenate([rot.real, rot.imag], axis=1).reshape(-1))
        self.cache = [Tensor.zeros(2 * self.n_kv * self.slots * self.head_dim).contiguous() for _ in self.layers]
        Tensor.realize(self.tok_embd, self.output, self.out_norm, self.rope, *self.cache,
                       *[t for lay in self.layers for t in lay.values()])
        self._prefill = TinyJit(self._forward)
        self._decode = TinyJit(self._forward)

    def __getstate__(self) -> dict[str, Any]:
        """Weights, KV caches and both captured graphs, for the JIT cache (worker/_jitcache.py)."""
        return {**self.__dict__, "_written": written_sets({"p": self._prefill, "d": self._decode})}

    def __setstate__(self, state: dict[str, Any]) -> None:
        written = state.pop("_written", {})
        self.__dict__.update(state)
        restore_written_sets({"p": self._prefill, "d": self._decode}, written)

    def probe(self) -> int:
        """The greedy next token after one fixed token at position 0: a cheap replay of the decode graph."""
        return int(self._decode(Tensor(np.array([7, 0, 0], dtype=np.int32))).item())

    @classmethod
    def load(cls, gguf_path: pathlib.Path, max_context: int = DEFAULT_CONTEXT, warmup: bool = True) -> LlamaLM:
        """Pack the GGUF's weights. `warmup` traces and captures both JIT graphs now (seconds), so the first
        real request runs at steady speed."""
        kv, raw = quant.gguf_raw(pathlib.Path(gguf_path))
        lm = cls(kv, raw, max_context)
        if warmup:
            lm.warmup()
        return lm

    def warmup(self, progress: Callable[[int], None] | None = None) -> None:
        """Trace and capture both JIT graphs. `progress` sees 1..4 after the (slow) first prefill calls."""
        # TinyJit runs eagerly once, captures on the second call and replays from the third: two prefill
        # chunks and three decode steps reach replay on both graphs.
        self.generate(np.zeros(PREFILL_CHUNK + 1, dtype=np.int32), 4, progress, ignore_eos=True)

    def _forward(self, ids: Tensor) -> Tensor:
        """ids (T + 2,) int32: T tokens, their start position, the row to predict from -> next id, (1,) int32."""
        T, D, H, KV, HD = ids.shape[0] - 2, self.dim, self.n_heads, self.n_kv, self.head_dim
        ty, nqkv = self.types, (H + 2 * KV) * HD
        x = quant.kernel("embed", quant.embed_src(T, D, self.embd_type), [Tensor.empty(T * D)], [self.tok_embd, ids])[0]
        attn = quant.attn_src(T, D, H, KV, HD, self.slots, self.eps, ty["q"], ty["o"])
        ffn = quant.ffn_src(T, D, self.ff, self.eps, ty["gu"], ty["d"])
        for lay, cache in zip(self.layers, self.cache, strict=True):
            x = quant.kernel("attn", attn, [Tensor.empty(T * D), Tensor.empty(T * (2 * D + nqkv)), cache],
                             [x, lay["attn_norm"], lay["wqkv"], lay["wo"], self.rope, ids], inout=(2,),
                             ops=2 * T * D * (nqkv + D), mem=lay["wqkv"].nbytes() + lay["wo"].nbytes())[0]
            x = quant.kernel("ffn", ffn, [Tensor.empty(T * D), Tensor.empty(T * (D + 3 * self.ff))],
                             [x, lay["ffn_norm"], lay["wgu"], lay["wd"]],
                             ops=6 * T * D * self.ff, mem=lay["wgu"].nbytes() + lay["wd"].nbytes())[0]
        head = quant.head_src(T, D, self.vocab_size, self.eps, self.out_type)
        return quant.kernel("head", head, [Tensor.empty(1, dtype=dtypes.int32), Tensor.empty(self.vocab_size)],
                            [x, self.out_norm, self.output, ids], ops=2 * D * self.vocab_size,
                            mem=self.output.nbytes())[0].realize()

    def generate(
        self,
        prompt_ids: np.ndarray,
        max_tokens: int,
        progress: Callable[[int], None] | None = None,
        *,
        ignore_eos: bool = False,
    ) -> tuple[list[int], str]:
        """Greedy continuation of `prompt_ids`: (generated ids without the stop token, "stop" | "length").

        `progress(n)` is called after each generated token (n = 1, 2, ...). `ignore_eos` keeps going past
        end-of-generation tokens (warm-up, benchmarks). ValueError when max_tokens is outside
        1..MAX_NEW_TOKENS, or the prompt is empty, not integers, holds an id outside the vocabulary, or
        prompt + max_tokens exceeds max_context."""
        if not 1 <= max_tokens <= MAX_NEW_TOKENS:
            raise ValueError(f"max_tokens must be 1..{MAX_NEW_TOKENS}, got {max_tokens}")
        ids = np.asarray(prompt_ids).reshape(-1)
        n = len(ids)
        if n == 0:
            raise ValueError("empty prompt")
        if ids.dtype.kind not in "iu":
            raise ValueError(f"prompt ids must be integers, got {ids.dtype}")
        if n + max_tokens > self.max_context:
            raise ValueError(f"prompt of {n} tokens + {max_tokens} new exceeds the {self.max_context}-token context")
        # An out-of-range id would index past the embedding table rather than fail.
        if ids.min() < 0 or ids.max() >= self.vocab_size:
            raise ValueError(f"prompt holds token ids outside 0..{self.vocab_size - 1}")
        nxt = 0
        for s in range(0, n, PREFILL_CHUNK):
            r = min(PREFILL_CHUNK, n - s)
            chunk = np.zeros(PREFILL_CHUNK + 2, dtype=np.int32)
            chunk[:r], chunk[PREFILL_CHUNK:] = ids[s : s + r], (s, r - 1)
            nxt = int(self._prefill(Tensor(chunk)).item())
        out_ids: list[int] = []
        pos = n
        while True:
            if nxt in self.eos_ids and not ignore_eos:
                return out_ids, "stop"
            out_ids.append(nxt)
            if progress is not None:
                progress(len(out_ids))
            if len(out_ids) == max_tokens:
                return out_ids, "length"
            nxt = int(self._decode(Tensor(np.array([nxt, pos, 0], dtype=np.int32))).item())
            pos += 1
