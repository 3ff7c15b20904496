"""The decoder architectures both decoders run (llama, qwen2, qwen3), each as llama's block over one tensor set.

Qwen2 adds biases to the q, k and v projections; Qwen3 an RMS norm over each q and k head ahead of RoPE, and a head
size of its own (attention.key_length). Both decoders apply a bias or a head norm wherever a GGUF has one.

RoPE: llama's GGUF q/k rows are ordered for a rotation of adjacent pairs (llama.cpp's "normal" mode), Qwen's
rotate the two halves of each head ("neox" mode). Both decoders rotate adjacent pairs, so a neox file's q/k rows
(with their biases and head norms) are reordered at load: a head's dimensions i and i + head_dim / 2 become 2i and
2i + 1, which then rotate together by frequency i as before. Attention scores are sums over a head's dimensions,
the same in any order, and V is untouched, so the block computes what the file's model does
(docs/models.md, "Architectures").
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from ..gguf_file import GGUFTensor

# general.architecture -> whether its RoPE rotates halves (neox) rather than adjacent pairs
ARCHITECTURES: dict[str, bool] = {"llama": False, "qwen2": True, "qwen3": True}
# per-layer tensors an architecture may add to llama's: q/k/v biases, q/k head norms
BIASES = ("attn_q.bias", "attn_k.bias", "attn_v.bias")
HEAD_NORMS = ("attn_q_norm.weight", "attn_k_norm.weight")
_ROTATED = ("attn_q.weight", "attn_k.weight", "attn_q.bias", "attn_k.bias", *HEAD_NORMS)


def architecture(kv: Mapping[str, Any]) -> str:
    """The GGUF's general.architecture; ValueError naming it when the decoders do not run it."""
    arch = kv.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"unsupported architecture {arch!r} (served: {', '.join(ARCHITECTURES)})")
    return str(arch)


def pairs_order(head_dim: int) -> np.ndarray:
    """A head's neox dimension order as adjacent pairs: [0, hd/2, 1, hd/2 + 1, ...]."""
    half = head_dim // 2
    return np.stack([np.arange(half), np.arange(half) + half], axis=1).reshape(-1)


def _reorder(t: GGUFTensor, head_dim: int) -> GGUFTensor:
    """Rows of `t` (a matrix's rows, a vector's elements) reordered by pairs_order within each head."""
    rows = t.shape[0]
    if rows % head_dim:
        raise ValueError(f"{rows} rows are not whole heads of {head_dim}")
    order = (np.arange(0, rows, head_dim)[:, None] + pairs_order(head_dim)).reshape(-1)
    return GGUFTensor(t.typ, t.shape, np.ascontiguousarray(t.data.reshape(rows, -1)[order]).reshape(-1))


def optional(raw: Mapping[str, GGUFTensor], names: tuple[str, ...], n_layers: int) -> bool:
    """Whether every layer has all of `names` (True) or none of them (False); ValueError for a mix."""
    have = {f"blk.{i}.{n}" in raw for i in range(n_layers) for n in names}
    if len(have) > 1:
        raise ValueError(f"some layers have {', '.join(names)} and some do not")
    return have.pop()


def llama_layout(kv: Mapping[str, Any], raw: Mapping[str, GGUFTensor], head_dim: int) -> dict[str, GGUFTensor]:
    """The GGUF's tensors as the decoders read them: a neox architecture's q/k rows in adjacent pairs."""
    if not ARCHITECTURES[architecture(kv)]:
        return dict(raw)
    return {name: _reorder(t, head_dim) if name.startswith("blk.") and name.split(".", 2)[2] in _ROTATED else t
            for name, t in raw.items()}
