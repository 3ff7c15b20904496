"""An independent BERT encoder in float64 numpy, from Hugging Face weight names (kernel test reference).

One sequence at a time, exactly as BertModel computes it (embeddings, post-LayerNorm layers, erf GELU);
it shares no code with trio_gpuworker.
"""

from __future__ import annotations

import math

import numpy as np


def _ln(x: np.ndarray, w: np.ndarray, b: np.ndarray, eps: float) -> np.ndarray:
    mu = x.mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + eps) * w + b


def gelu(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + np.vectorize(math.erf)(x / math.sqrt(2.0)))


def hidden(w: dict[str, np.ndarray], cfg: dict, ids: np.ndarray, types: np.ndarray | None = None,
           positions: np.ndarray | None = None) -> np.ndarray:
    """(len(ids), hidden) final hidden states of one sequence (at positions 0, 1, ... unless given)."""
    g = {k: v.astype(np.float64) for k, v in w.items()}
    eps, nh = cfg["layer_norm_eps"], cfg["num_attention_heads"]
    e = "embeddings."
    tt = np.zeros_like(ids) if types is None else types
    x = g[e + "word_embeddings.weight"][ids] + g[e + "token_type_embeddings.weight"][tt]
    x = x + g[e + "position_embeddings.weight"][np.arange(len(ids)) if positions is None else positions]
    x = _ln(x, g[e + "LayerNorm.weight"], g[e + "LayerNorm.bias"], eps)
    L, h = x.shape
    hd = h // nh

    def lin(p: str, name: str, v: np.ndarray) -> np.ndarray:
        return v @ g[p + name + ".weight"].T + g[p + name + ".bias"]

    for n in range(cfg["num_hidden_layers"]):
        p = f"encoder.layer.{n}."
        q, k, v = (lin(p, f"attention.self.{t}", x).reshape(L, nh, hd).transpose(1, 0, 2)
                   for t in ("query", "key", "value"))
        s = q @ k.transpose(0, 2, 1) / math.sqrt(hd)
        s = np.exp(s - s.max(-1, keepdims=True))
        ctx = ((s / s.sum(-1, keepdims=True)) @ v).transpose(1, 0, 2).reshape(L, h)
        x = _ln(x + lin(p, "attention.output.dense", ctx), g[p + "attention.output.LayerNorm.weight"],
                g[p + "attention.output.LayerNorm.bias"], eps)
        x = _ln(x + lin(p, "output.dense", gelu(lin(p, "intermediate.dense", x))), g[p + "output.LayerNorm.weight"],
                g[p + "output.LayerNorm.bias"], eps)
    return x
