"""A tiny random BERT (one layer, 32 wide) written as a safetensors checkpoint, token ids for it, and a daemon
config serving it: real workers load and search it in seconds, where MiniLM takes minutes."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from tests.support.state import short_dir

TINY = {"vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
        "intermediate_size": 64, "max_position_embeddings": 32, "type_vocab_size": 2, "layer_norm_eps": 1e-12,
        "hidden_act": "gelu", "model_type": "bert"}


def write_tiny_bert(folder: Path) -> Path:
    """A random BertModel checkpoint (safetensors + config.json) with TINY's dimensions."""
    rng = np.random.default_rng(3)
    h, i, L = TINY["hidden_size"], TINY["intermediate_size"], "encoder.layer.0."
    shapes = {"embeddings.word_embeddings.weight": (TINY["vocab_size"], h),
              "embeddings.position_embeddings.weight": (TINY["max_position_embeddings"], h),
              "embeddings.token_type_embeddings.weight": (2, h),
              "embeddings.LayerNorm.weight": (h,), "embeddings.LayerNorm.bias": (h,)}
    for w in ("attention.self.query", "attention.self.key", "attention.self.value", "attention.output.dense"):
        shapes[L + w + ".weight"], shapes[L + w + ".bias"] = (h, h), (h,)
    for ln in ("attention.output.LayerNorm", "output.LayerNorm"):
        shapes[L + ln + ".weight"], shapes[L + ln + ".bias"] = (h,), (h,)
    shapes |= {L + "intermediate.dense.weight": (i, h), L + "intermediate.dense.bias": (i,),
               L + "output.dense.weight": (h, i), L + "output.dense.bias": (h,)}
    header, blobs, at = {}, [], 0
    for name, shape in shapes.items():
        blob = (rng.standard_normal(shape) * 0.2).astype("<f4").tobytes()
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [at, at + len(blob)]}
        blobs.append(blob)
        at += len(blob)
    meta = json.dumps(header).encode()
    meta += b" " * (-len(meta) % 8)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "model.safetensors"
    path.write_bytes(len(meta).to_bytes(8, "little") + meta + b"".join(blobs))
    (folder / "config.json").write_text(json.dumps(TINY))
    return path


# two rows of token ids for the tiny model, of different lengths
IDS = [np.array([1, 5, 9, 2], np.int32), np.array([1, 7, 7, 3, 11, 2], np.int32)]


def tiny_daemon_config(tmp_path: Path, beam: int) -> Path:
    """A daemon config serving the tiny model with `beam`, state (kernel and JIT caches) under tmp_path."""
    model = write_tiny_bert(tmp_path / "model")
    conf = tmp_path / f"beam{beam}.toml"
    # BEAM_MIN_PROGRESS: one round of candidates per kernel, which keeps the real search short
    conf.write_text(f"""
[daemon]
state_dir = "{tmp_path / "state"}"
runtime_dir = "{short_dir("gw-beam-")}"
[models.tiny]
path = "{model}"
beam = {beam}
runtime_config = {{ warmup_shapes = [[16, 1]], encoder = "graph" }}  # BEAM tunes tinygrad-generated kernels
[[lanes]]
id = "t"
models = ["tiny"]
replicas = 1
env = {{ BEAM_MIN_PROGRESS = "1000000" }}
""")
    return conf
