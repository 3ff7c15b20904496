"""Tiny seeded random BERT cross-encoders saved as transformers saves them, query/document rows for them, and
transformers' own outputs on those rows: the references the graph and the fused cross-encoders are checked against."""

from __future__ import annotations

import json
import pathlib

import numpy as np
import torch
import transformers

# Two buckets out of order, an uneven count that needs a padded micro-batch, a 1-token row. Every test uses the same
# lengths, hence the same two (length, batch) shapes: tinygrad's per-shape kernel generation dominates the run time.
LENGTHS = [5, 40, 1, 16, 64, 9, 3, 33, 12, 2, 7]
TINY = dict(
    vocab_size=97,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=64,
    max_position_embeddings=64,
    type_vocab_size=2,
    hidden_act="gelu",
    layer_norm_eps=1e-12,
)


def save(model: torch.nn.Module, path: pathlib.Path) -> tuple[pathlib.Path, dict]:
    """`model` saved under `path` as safetensors: the file and its config.json's contents."""
    model.save_pretrained(path, safe_serialization=True)
    return path / "model.safetensors", json.loads((path / "config.json").read_text())


def tiny_model(path: pathlib.Path, num_labels: int, seed: int) -> tuple[torch.nn.Module, pathlib.Path, dict]:
    """A BertForSequenceClassification of TINY's dimensions, every weight random, saved under `path`: the model,
    its safetensors file and its config."""
    torch.manual_seed(seed)
    cfg = transformers.BertConfig(**TINY, num_labels=num_labels)
    model = transformers.BertForSequenceClassification(cfg).eval()
    # Default init (std 0.02, LayerNorm = identity) would leave most paths untested; make every weight matter.
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    return (model, *save(model, path))


def pairs(rng: np.random.Generator, lengths: list[int]) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Random query/document rows of `lengths` (CLS first) and their token types."""
    ids, tts = [], []
    for n in lengths:
        q = int(rng.integers(0, n - 1)) if n > 2 else 0
        x = rng.integers(1, TINY["vocab_size"], n).astype(np.int32)
        x[0] = 2
        ids.append(x)
        tts.append(np.r_[np.zeros(q + 1, np.int32), np.ones(n - q - 1, np.int32)])
    return ids, tts


def torch_out(model: torch.nn.Module, ids: list[np.ndarray], tts: list[np.ndarray] | None) -> torch.Tensor:
    """transformers' output for the padded rows `ids` (token types `tts`, None: all zeros)."""
    L = max(len(x) for x in ids)
    x, t, m = (torch.zeros(len(ids), L, dtype=torch.long) for _ in range(3))
    for i, a in enumerate(ids):
        x[i, : len(a)], m[i, : len(a)] = torch.from_numpy(a.astype(np.int64)), 1
        if tts is not None:
            t[i, : len(a)] = torch.from_numpy(tts[i].astype(np.int64))
    with torch.no_grad():
        return model(input_ids=x, attention_mask=m, token_type_ids=t)
