"""Tiny random-weight llama GGUFs, written with the `gguf` package, each tensor in the GGML type a test asks for.

Weights are random normals encoded by the `gguf` package's own quantiser where it has one; the K-quants (which it
cannot quantise) are random valid blocks: random integers and scale bytes under finite f16 scales sized so the
weights come out about as large as the normals. A type the project does not read is random bytes of its block
size. The vocabulary is byte-level BPE (256 byte tokens, one merge, ChatML control tokens), so the daemon's chat
tokenizer reads it too.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as T

from tests.support.tiny_vocab import Vocab

MATRICES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


@dataclass(frozen=True)
class Dims:
    """K-quant rows are whole 256-weight blocks, so every row length (dim, ff, heads * head_dim) is a multiple of
    256. `head_dim` 0: dim // heads."""

    dim: int = 256
    heads: int = 4
    kv: int = 2
    ff: int = 512
    layers: int = 2
    context: int = 256
    head_dim: int = 0

    @property
    def hd(self) -> int:
        return self.head_dim or self.dim // self.heads


def _bytes_to_unicode() -> list[str]:
    """GPT-2's byte-level alphabet: byte b's token text."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b], extra = chr(256 + extra), extra + 1
    return [out[b] for b in range(256)]


TOKENS = [*_bytes_to_unicode(), "Ġt", "<|im_start|>", "<|im_end|>", "<|endoftext|>"]
TOKEN_TYPES = [1] * 257 + [3, 3, 3]
EOS = TOKENS.index("<|im_end|>")
DEFAULT_VOCAB = Vocab("gpt2", TOKENS, TOKEN_TYPES, bos=None, eos=EOS, template=CHATML, merges=["Ġ t"], pre="default")


def _k_blocks(rng: np.random.Generator, n: int, typ: T, std: float) -> np.ndarray:
    """n random valid blocks of a K-quant with weights of about `std`."""
    size = gguf.GGML_QUANT_SIZES[typ][1]
    b = rng.integers(0, 256, (n, size), dtype=np.uint8)
    if typ == T.Q6_K:  # d * scale (int8) * (q - 32): |scale| ~ 64, |q - 32| ~ 18
        b[:, 208:210] = np.full((n, 1), std / 64 / 18, np.float16).view(np.uint8)
        return b
    top = 15 if typ == T.Q4_K else 31  # d * sc * q - dmin * mn: sc, mn ~ 32; dmin centres the weights on 0
    d = np.full((n, 1), std * 2 / 32 / top, np.float16)
    dmin = np.full((n, 1), std / 32, np.float16)
    b[:, 0:4] = np.concatenate([d, dmin], axis=1).view(np.uint8)
    return b


def encode(rng: np.random.Generator, w: np.ndarray, typ: T) -> np.ndarray:
    """Float weights `w` (outermost first) in GGML type `typ`, as GGUFWriter.add_tensor takes them with that
    raw_dtype; a K-quant is random blocks of about `w`'s spread instead."""
    block, size = gguf.GGML_QUANT_SIZES[typ]
    rows = int(np.prod(w.shape[:-1]))
    if typ in (T.Q4_K, T.Q5_K, T.Q6_K):
        return _k_blocks(rng, rows * w.shape[-1] // block, typ, float(w.std())).reshape(rows, -1)
    try:
        return gguf.quants.quantize(w, typ)
    except NotImplementedError:  # a type this project refuses: any bytes of its size do
        return rng.integers(0, 256, (rows, w.shape[-1] // block * size), dtype=np.uint8)


TypeOf = Callable[[str], T] | Mapping[str, T]


def _type(types: TypeOf, name: str) -> T:
    """A tensor's type: from a function of its name, or a map of its name's kind ("attn_q", "token_embd",
    "output", "norm") with F32 for what the map leaves out."""
    if callable(types):
        return types(name)
    kind = "norm" if name.endswith("norm.weight") else name.split(".")[-2]
    return types.get(kind, T.F32)


# What each architecture adds to llama's tensors, per layer: Qwen2's q/k/v biases, Qwen3's q/k RMS norms.
EXTRAS: dict[str, tuple[str, ...]] = {"qwen2": ("attn_q.bias", "attn_k.bias", "attn_v.bias"),
                                      "qwen3": ("attn_q_norm.weight", "attn_k_norm.weight")}


def _extra_shapes(arch: str, dims: Dims, i: int) -> dict[str, tuple[int, ...]]:
    size = {"attn_q.bias": dims.heads * dims.hd, "attn_k.bias": dims.kv * dims.hd, "attn_v.bias": dims.kv * dims.hd,
            "attn_q_norm.weight": dims.hd, "attn_k_norm.weight": dims.hd}
    return {f"blk.{i}.{n}": (size[n],) for n in EXTRAS.get(arch, ())}


def _random(rng: np.random.Generator, name: str, shape: tuple[int, ...]) -> np.ndarray:
    """Biases about as large as the projections they are added to, norm weights near 1, matrices scaled so each
    output is about as large as its input."""
    if name.endswith(".bias"):
        return rng.standard_normal(shape) * 0.5
    if len(shape) == 1:
        return 1 + rng.standard_normal(shape) * 0.1
    return rng.standard_normal(shape) * (0.1 if name == "token_embd.weight" else shape[-1] ** -0.5)


def write_llama(path: Path, types: TypeOf, dims: Dims = Dims(), *, tied: bool = True, seed: int = 0,
                arch: str = "llama", rope_freqs: np.ndarray | None = None, rope_base: float = 10000.0,
                vocab: Vocab | None = None) -> Path:
    """A random llama-shaped GGUF at `path` with its tensors in `types` (see _type); `tied`: no output.weight;
    `arch` its general.architecture (and key prefix), with that architecture's EXTRAS; `rope_freqs`: llama.cpp's
    RoPE frequency factors (rope_freqs.weight); `vocab`: its tokenizer (default: this module's byte-level one)."""
    rng = np.random.default_rng(seed)
    hd = dims.hd
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(dims.layers)
    w.add_context_length(dims.context)
    w.add_embedding_length(dims.dim)
    w.add_feed_forward_length(dims.ff)
    w.add_head_count(dims.heads)
    w.add_head_count_kv(dims.kv)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(rope_base)
    if dims.head_dim:
        w.add_key_length(hd)
        w.add_value_length(hd)
    vocab = vocab or DEFAULT_VOCAB
    vocab.write(w)
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (len(vocab.tokens), dims.dim),
                                          "output_norm.weight": (dims.dim,)}
    if not tied:
        shapes["output.weight"] = (len(vocab.tokens), dims.dim)
    rows = {"attn_q": dims.heads * hd, "attn_k": dims.kv * hd, "attn_v": dims.kv * hd, "attn_output": dims.dim,
            "ffn_gate": dims.ff, "ffn_up": dims.ff, "ffn_down": dims.dim}
    cols = {"attn_output": dims.heads * hd, "ffn_down": dims.ff}
    for i in range(dims.layers):
        shapes[f"blk.{i}.attn_norm.weight"] = shapes[f"blk.{i}.ffn_norm.weight"] = (dims.dim,)
        for m in MATRICES:
            shapes[f"blk.{i}.{m}.weight"] = (rows[m], cols.get(m, dims.dim))
        shapes.update(_extra_shapes(arch, dims, i))
    for name, shape in shapes.items():
        x = _random(rng, name, shape)
        typ = T.F32 if name.endswith(".bias") else _type(types, name)
        w.add_tensor(name, encode(rng, x.astype(np.float32), typ), raw_dtype=typ)
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32), raw_dtype=T.F32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def llama3_rope_factors(dims: Dims, theta: float, factor: float, low: float, high: float, original: int) -> np.ndarray:
    """Llama 3's rope scaling as llama.cpp's converter writes it (rope_freqs.weight): per frequency, 1 above the high
    frequency cut, `factor` below the low one, and the smooth blend between."""
    hd = dims.hd
    out = []
    for freq in 1.0 / theta ** (np.arange(0, hd, 2, dtype=np.float64) / hd):
        wavelen = 2 * np.pi / freq
        if wavelen < original / high:
            out.append(1.0)
        elif wavelen > original / low:
            out.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, np.float32)


# A llama.cpp *_K_M-like mix: Q4_K for most matrices, Q6_K for attn_v, half the ffn_down and the embedding, Q5_0
# where llama.cpp falls back for rows that are not whole 256-weight blocks (here attn_k, to have one).
def k_m_mix(name: str) -> T:
    if name.endswith("norm.weight"):
        return T.F32
    if name in ("token_embd.weight", "output.weight") or ".attn_v." in name or name == "blk.0.ffn_down.weight":
        return T.Q6_K
    return T.Q5_0 if ".attn_k." in name else T.Q4_K
