"""Llama-architecture decoder (SmolLM2) for tinygrad's CPU device: packed GGUF weights, KV cache, greedy generation.

The CPU default (`decoder = "fused"`): its kernel is C source run through tinygrad's custom_kernel, so tinygrad
compiles, caches, captures and replays it, but it only runs where tinygrad compiles C (CPU). Other devices use
llama.py, whose kernels tinygrad generates.

Shapes are fixed so TinyJit can replay the kernels: prefill runs in chunks of PREFILL_CHUNK tokens (the
last one padded) and decode runs one token at a time. Each call takes one int32 tensor, the chunk's ids
followed by its start position and the row whose next token is wanted, so one captured graph per phase
serves every position up to max_context with no symbolic shapes.

Quantised matrices stay packed and are dequantised in registers (kernels/quant.h), so a decode step reads
~110 MB instead of 540 MB of float32. The whole forward pass is one C kernel (kernels/llama_forward.c): a
tinygrad launch costs ~80 us of Python here, which was a third of a step even at one kernel per layer half.
"""

from __future__ import annotations

import pathlib
from dataclasses import dataclass
from typing import Any

import numpy as np
from tinygrad import Tensor, TinyJit, dtypes

from .._kinds import DEFAULT_CONTEXT
from ..gguf_file import GGUFTensor, read_tensors
from . import ckernel, csource, quant
from .greedy import PREFILL_CHUNK, GreedyDecoder


@dataclass(frozen=True)
class LlamaDims:
    """The model's dimensions and GGML types, as kernels/llama_forward.c's defines."""

    d: int
    h: int
    kv: int
    hd: int
    ff: int
    v: int
    s: int  # KV cache slots
    nl: int
    eps: float
    g: int  # rows per packed group (quant.G)
    type_embd: int
    type_out: int
    type_qkv: int
    type_o: int
    type_gu: int
    type_down: int


@dataclass(frozen=True)
class Step:
    """One captured graph's chunk: T tokens, matmul tiles of NT rows."""

    t: int
    nt: int


class FusedLlamaLM(GreedyDecoder):
    def __init__(self, kv: dict[str, Any], raw: dict[str, GGUFTensor], max_context: int) -> None:
        theta = self._hparams(kv, max_context)
        self.ff = int(raw["blk.0.ffn_gate.weight"].shape[0])
        if self.dim % 32 or self.ff % 32 or self.head_dim % 16 or self.n_heads % self.n_kv:
            raise ValueError("dimensions must be multiples of the 32-element quant block")

        def mat(*names: str, interleave: bool = False) -> tuple[int, np.ndarray]:
            """Packed rows of one or more matrices of one GGML type, stacked (or row-interleaved)."""
            types = {raw[n].typ for n in names}
            if len(types) != 1:
                raise ValueError(f"{names} mix GGML types {types}")
            typ = types.pop()
            parts = [quant.pack(typ, raw[n].data, raw[n].shape[0]) for n in names]
            return typ, quant.group(typ, np.stack(parts, 1).reshape(-1, parts[0].shape[1]) if interleave
                                    else np.concatenate(parts))

        def vec(name: str) -> np.ndarray:
            return quant.f32(raw[name].typ, raw[name].data)

        def stacked(kind: str, *names: str, interleave: bool = False) -> Tensor:
            """One matrix kind of every layer back to back; the kernel needs one GGML type per kind."""
            got = [mat(*(f"blk.{i}.{n}.weight" for n in names), interleave=interleave) for i in range(self.n_layers)]
            if len(types := {t for t, _ in got}) != 1:
                raise ValueError(f"{kind} matrices mix GGML types {types}")
            self.types[kind] = types.pop()
            return Tensor(np.concatenate([w for _, w in got]))

        self.types: dict[str, int] = {}
        self.embd_type, embd = mat("token_embd.weight")
        self.vocab_size = int(raw["token_embd.weight"].shape[0])
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
        # The kernel's scratch, persistent too: its last vocab_size floats are the step's logits, which sampling
        # and logprobs read in place after the replay (greedy never does).
        nqkv = (self.n_heads + 2 * self.n_kv) * self.head_dim
        self._scratch = {n: Tensor.zeros(n * 2 * self.dim + n * max(nqkv + self.dim, 3 * self.ff) + self.vocab_size)
                         .contiguous().realize() for n in (PREFILL_CHUNK, 1)}
        self._last_t = 1

    @classmethod
    def load(cls, gguf_path: pathlib.Path, max_context: int = DEFAULT_CONTEXT, warmup: bool = True) -> FusedLlamaLM:
        """Pack the GGUF's weights. `warmup` traces and captures both JIT graphs now (seconds), so the first
        real request runs at steady speed."""
        kv, raw = read_tensors(pathlib.Path(gguf_path))
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
        self._last_t = PREFILL_CHUNK if jit is self._prefill else 1
        ids = self._ids[self._last_t]
        view = np.frombuffer(ids.uop.buffer.as_memoryview(force_zero_copy=True), np.int32)
        view[:] = 0
        view[: len(tokens)], view[-2:] = tokens, (start, last)
        out = jit(ids).uop.buffer.as_memoryview(force_zero_copy=True)
        return int(np.frombuffer(out, np.int32)[0])

    def _logits(self) -> np.ndarray:
        scratch = self._scratch[self._last_t].uop.buffer.as_memoryview(force_zero_copy=True)
        return np.frombuffer(scratch, np.float32)[-self.vocab_size:]

    def _forward(self, ids: Tensor) -> Tensor:
        """ids (T + 2,) int32: T tokens, their start position, the row to predict from -> next id, (1,) int32."""
        T, D, H, KV, HD = ids.shape[0] - 2, self.dim, self.n_heads, self.n_kv, self.head_dim
        FF, V = self.ff, self.vocab_size
        nqkv, ty = (H + 2 * KV) * HD, self.types
        dims = LlamaDims(d=D, h=H, kv=KV, hd=HD, ff=FF, v=V, s=self.slots, nl=self.n_layers, eps=self.eps,
                         g=quant.G, type_embd=self.embd_type, type_out=self.out_type, type_qkv=ty["q"],
                         type_o=ty["o"], type_gu=ty["gu"], type_down=ty["d"])
        src = csource.source("llama_forward.c", dims, Step(t=T, nt=4 if T % 4 == 0 else 1))
        scratch = self._scratch[T]
        assert scratch.shape[0] == T * 2 * D + T * max(nqkv + D, 3 * FF) + V
        macs = T * self.n_layers * D * (nqkv + D + 3 * FF) + D * V
        mem = sum(w.nbytes() for w in (self.wqkv, self.wo, self.wgu, self.wd, self.output))
        return ckernel.kernel("forward", src, [Tensor.empty(1, dtype=dtypes.int32), scratch, self.cache],
                              [ids, *self.weights], inout=(2,), ops=2 * macs, mem=mem)[0].realize()
