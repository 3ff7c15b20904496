"""BERT and XLM-RoBERTa encoders (all-MiniLM-L6-v2, bge, e5, multilingual-e5 and friends) in tinygrad, with
bucketed, JIT-compiled batches.

Weights use the Hugging Face BertModel / XLMRobertaModel names (an optional ``bert.`` or ``roberta.`` prefix is
accepted, so a ...ForSequenceClassification checkpoint loads too). XLM-RoBERTa is BERT's body with its positions
counted from the padding id + 1 and one token type. Inputs are token ids that already carry [CLS]/[SEP] (<s>/</s>);
this module never tokenizes.
"""

from __future__ import annotations

import abc
import math
import pathlib
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
from tinygrad import Device, Tensor, TinyJit, dtypes
from tinygrad.nn.state import safe_load, safe_load_metadata

from .._kinds import DEFAULT_MAX_TOKENS, POOLINGS
from .shapes import BATCH_SIZES, buckets, plan_rows, sizes_for, tuned_shapes

Progress = Callable[[int], None] | None

def _gelu(x: Tensor) -> Tensor:
    return x.gelu(approximate="none")  # HF "gelu" is the exact erf form


def _gelu_tanh(x: Tensor) -> Tensor:
    return x.gelu(approximate="tanh")


def _relu(x: Tensor) -> Tensor:
    return x.relu()


# module-level functions, not lambdas: a model pickles (the JIT cache stores it) with its activation by name
_ACTS: dict[str, Callable[[Tensor], Tensor]] = {"gelu": _gelu, "gelu_new": _gelu_tanh, "gelu_pytorch_tanh": _gelu_tanh,
                                                "relu": _relu}


# model_type -> the prefix of the encoder body's weights in its task checkpoints (...ForSequenceClassification)
ARCHITECTURES = {"bert": "bert.", "xlm-roberta": "roberta."}


@dataclass(frozen=True)
class BertConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float
    hidden_act: str
    model_type: str = "bert"  # one of ARCHITECTURES
    pad_token_id: int = 1  # XLM-RoBERTa's: where its positions start (below)
    bos_token_id: int = 0  # XLM-RoBERTa's <s> and </s>
    eos_token_id: int = 2

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> BertConfig:
        if not isinstance(config, dict):
            raise ValueError(f"encoder config must be a JSON object, got {type(config).__name__}")
        if (kind := config.get("model_type", "bert")) not in ARCHITECTURES:
            raise ValueError(f"encoder config: unsupported model_type {kind!r} (served: {', '.join(ARCHITECTURES)})")
        if (pet := config.get("position_embedding_type", "absolute")) != "absolute":
            raise ValueError(f"encoder config: unsupported position_embedding_type {pet!r}, expected 'absolute'")
        vals: dict[str, Any] = {}
        for name in (
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "intermediate_size",
            "max_position_embeddings",
            "type_vocab_size",
        ):
            v = config.get(name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"encoder config: {name} must be a positive int, got {v!r}")
            vals[name] = v
        if kind != "bert":
            vals |= _token_ids(config, {"pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 2}, vals["vocab_size"])
        eps = config.get("layer_norm_eps", 1e-12)
        if isinstance(eps, bool) or not isinstance(eps, int | float) or not 0 < eps < 1:
            raise ValueError(f"encoder config: layer_norm_eps must be a float in (0, 1), got {eps!r}")
        act = config.get("hidden_act", "gelu")
        if act not in _ACTS:
            raise ValueError(f"encoder config: unsupported hidden_act {act!r} (supported: {sorted(_ACTS)})")
        if (h := vals["hidden_size"]) % (nh := vals["num_attention_heads"]):
            raise ValueError(f"encoder config: hidden_size {h} is not divisible by num_attention_heads {nh}")
        out = cls(**vals, layer_norm_eps=float(eps), hidden_act=act, model_type=kind)
        if out.max_tokens < 2:
            raise ValueError(f"encoder config: max_position_embeddings {out.max_position_embeddings} leaves "
                             f"{out.max_tokens} positions past the padding id")
        return out

    @property
    def roberta(self) -> bool:
        return self.model_type == "xlm-roberta"

    @property
    def first_position(self) -> int:
        """The position id of a row's first token: XLM-RoBERTa counts from its padding id + 1."""
        return self.pad_token_id + 1 if self.roberta else 0

    @property
    def max_tokens(self) -> int:
        """The longest row the position table holds."""
        return self.max_position_embeddings - self.first_position

    @property
    def special_ids(self) -> tuple[int, int] | None:
        """XLM-RoBERTa's (<s>, </s>), which wrap rows and pairs where BERT's [CLS] and [SEP] do; None for BERT,
        whose ids the daemon's tokenizer gives."""
        return (self.bos_token_id, self.eos_token_id) if self.roberta else None

    def positions(self, row: np.ndarray) -> np.ndarray:
        """One row's position ids as transformers numbers them: 0, 1, ... for BERT; for XLM-RoBERTa the count of
        non-padding tokens so far plus the padding id, and the padding id on a padding token."""
        if not self.roberta:
            return np.arange(len(row), dtype=np.int32)
        real = row != self.pad_token_id
        return np.where(real, np.cumsum(real) + self.pad_token_id, self.pad_token_id).astype(np.int32)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor the encoder body needs, by Hugging Face name (without the ``bert.`` prefix)."""
        h, i = self.hidden_size, self.intermediate_size
        s: dict[str, tuple[int, ...]] = {
            "embeddings.word_embeddings.weight": (self.vocab_size, h),
            "embeddings.position_embeddings.weight": (self.max_position_embeddings, h),
            "embeddings.token_type_embeddings.weight": (self.type_vocab_size, h),
            "embeddings.LayerNorm.weight": (h,),
            "embeddings.LayerNorm.bias": (h,),
        }
        for n in range(self.num_hidden_layers):
            p = f"encoder.layer.{n}."
            for w in ("attention.self.query", "attention.self.key", "attention.self.value", "attention.output.dense"):
                s[p + w + ".weight"], s[p + w + ".bias"] = (h, h), (h,)
            for ln in ("attention.output.LayerNorm", "output.LayerNorm"):
                s[p + ln + ".weight"], s[p + ln + ".bias"] = (h,), (h,)
            s[p + "intermediate.dense.weight"], s[p + "intermediate.dense.bias"] = (i, h), (i,)
            s[p + "output.dense.weight"], s[p + "output.dense.bias"] = (h, i), (h,)
        return s


def _token_ids(config: dict[str, Any], defaults: dict[str, int], vocab: int) -> dict[str, int]:
    out = {}
    for name, default in defaults.items():
        v = config.get(name, default)
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < vocab:
            raise ValueError(f"encoder config: {name} must be an id below vocab_size {vocab}, got {v!r}")
        out[name] = v
    return out


def bare(name: str) -> str:
    """A tensor's name without a task checkpoint's prefix (``bert.``, ``roberta.``) on the encoder body's."""
    for prefix in ARCHITECTURES.values():
        if name.startswith(prefix):
            return name[len(prefix):]
    return name


def load_weights(artifact_path: pathlib.Path, shapes: dict[str, tuple[int, ...]]) -> dict[str, Tensor]:
    """Reads a safetensors file, checks every needed tensor is there with the right shape, moves them to the device.

    A leading ``bert.`` or ``roberta.`` is stripped from names; tensors not in ``shapes`` (position_ids, unused
    heads) are ignored.
    """
    found = checked_tensors(artifact_path, shapes)
    # DISK tensors -> device float32 buffers, realized now so the first request does not pay for the copy.
    out = {k: found[k].to(Device.DEFAULT).cast(dtypes.float32).contiguous() for k in shapes}
    Tensor.realize(*out.values())
    return out


def checked_tensors(artifact_path: pathlib.Path, shapes: dict[str, tuple[int, ...]]) -> dict[str, Tensor]:
    """The safetensors file's tensors (lazy DISK views, named `bare`), once every one of ``shapes`` is
    there, float, with its shape, and the file is not truncated (ValueError otherwise)."""
    path = pathlib.Path(artifact_path)
    if not path.is_file():
        raise ValueError(f"model artifact {str(path)!r} is not a file")
    try:
        _, start, meta = safe_load_metadata(path)
        end = start + max((int(v["data_offsets"][1]) for k, v in meta.items() if k != "__metadata__"), default=0)
    except Exception as e:
        raise ValueError(f"model artifact {str(path)!r} is not a readable safetensors file: {e}") from e
    # A truncated file would otherwise surface as a DISK read error deep inside realize(), or as a view past the
    # end of the file.
    if end > (size := path.stat().st_size):
        raise ValueError(f"model artifact {str(path)!r} is truncated: data ends at byte {end}, file has {size}")
    try:
        raw = safe_load(path)
    except Exception as e:
        raise ValueError(f"model artifact {str(path)!r} is not a readable safetensors file: {e}") from e
    found = {bare(k): v for k, v in raw.items()}
    if missing := [k for k in shapes if k not in found]:
        raise ValueError(f"model artifact {str(path)!r} lacks {len(missing)} tensor(s), e.g. {missing[:3]}")
    if bad := [
        f"{k}: {tuple(found[k].shape)} != {want}" for k, want in shapes.items() if tuple(found[k].shape) != want
    ]:
        raise ValueError(f"model artifact {str(path)!r} has ill-shaped tensor(s): {'; '.join(bad[:3])}")
    if nonfloat := [k for k in shapes if not dtypes.is_float(found[k].dtype)]:
        raise ValueError(f"model artifact {str(path)!r} has non-float tensor(s): {nonfloat[:3]}")
    return found


def check_rows(rows: Sequence[np.ndarray], what: str, limit: int, max_tokens: int) -> list[np.ndarray]:
    """Each row a 1-D integer array of 1..max_tokens values in [0, limit), as int32 (ValueError otherwise)."""
    out = []
    for i, r in enumerate(rows):
        a = np.asarray(r)
        if a.ndim != 1 or not np.issubdtype(a.dtype, np.integer):
            raise ValueError(f"{what}[{i}] must be a 1-D integer array, got {a.dtype} {a.shape}")
        if not 1 <= len(a) <= max_tokens:
            raise ValueError(f"{what}[{i}] has {len(a)} tokens, must be 1..{max_tokens}")
        if len(a) and (a.min() < 0 or a.max() >= limit):
            raise ValueError(f"{what}[{i}] has ids outside [0, {limit})")
        out.append(a.astype(np.int32, copy=False))
    return out


def check_types(rows: list[np.ndarray], types: Sequence[np.ndarray], limit: int, max_tokens: int) -> list[np.ndarray]:
    """token_type_ids rows for `rows` (checked): one per row, each as long as its row."""
    if len(types) != len(rows):
        raise ValueError(f"got {len(types)} token_type_ids rows for {len(rows)} rows")
    tts = check_rows(types, "token_type_ids", limit, max_tokens)
    if bad := [i for i, (a, t) in enumerate(zip(rows, tts, strict=True)) if len(a) != len(t)]:
        raise ValueError(f"token_type_ids[{bad[0]}] length differs from its row")
    return tts


def _linear(x: Tensor, wt: Tensor, b: Tensor) -> Tensor:
    return x.linear(wt, b)


def _t(w: Tensor) -> Tensor:
    """(out, in) -> (in, out) contiguous: a matmul then reads weights along the output axis, which tinygrad
    vectorises (BEAM finds ~1.6x faster kernels than for the transposed view)."""
    return w.T.contiguous()


class BertBody:
    """Embeddings + transformer layers; ``__call__`` maps (B, L) ids to (B, L, hidden) states."""

    def __init__(self, cfg: BertConfig, w: dict[str, Tensor]) -> None:
        self.cfg, self.act = cfg, _ACTS[cfg.hidden_act]
        e = "embeddings."
        self.word, self.pos, self.typ = (w[e + n + "_embeddings.weight"] for n in ("word", "position", "token_type"))
        self.emb_ln = (w[e + "LayerNorm.weight"], w[e + "LayerNorm.bias"])
        self.layers: list[dict[str, Tensor]] = []
        for n in range(cfg.num_hidden_layers):
            p, a = f"encoder.layer.{n}.", f"encoder.layer.{n}.attention."
            qkv = [a + f"self.{x}" for x in ("query", "key", "value")]
            self.layers.append(
                {
                    # One fused QKV matmul: fewer, larger kernels.
                    "qkv_w": _t(Tensor.cat(*[w[x + ".weight"] for x in qkv])),
                    "qkv_b": Tensor.cat(*[w[x + ".bias"] for x in qkv]).contiguous(),
                    "o_w": _t(w[a + "output.dense.weight"]),
                    "o_b": w[a + "output.dense.bias"],
                    "ln1_w": w[a + "output.LayerNorm.weight"],
                    "ln1_b": w[a + "output.LayerNorm.bias"],
                    "i_w": _t(w[p + "intermediate.dense.weight"]),
                    "i_b": w[p + "intermediate.dense.bias"],
                    "f_w": _t(w[p + "output.dense.weight"]),
                    "f_b": w[p + "output.dense.bias"],
                    "ln2_w": w[p + "output.LayerNorm.weight"],
                    "ln2_b": w[p + "output.LayerNorm.bias"],
                }
            )
        Tensor.realize(*[t for lw in self.layers for t in lw.values()])

    def _ln(self, x: Tensor, wb: tuple[Tensor, Tensor]) -> Tensor:
        return x.layernorm(eps=self.cfg.layer_norm_eps) * wb[0] + wb[1]

    def __call__(self, ids: Tensor, token_types: Tensor, positions: Tensor, mask: Tensor) -> Tensor:
        (B, L), nh = ids.shape, self.cfg.num_attention_heads
        hd = self.cfg.hidden_size // nh
        # Activations stay (B*L, hidden): the dense kernels (96% of the time) then depend on B*L alone, so
        # micro-batch shapes with equal token counts share their compiled and BEAM-tuned kernels.
        x = self._ln(self.word[ids] + self.pos[positions] + self.typ[token_types], self.emb_ln).reshape(B * L, -1)
        # Additive key mask as in HF (finfo.min there; any huge negative underflows exp() to exactly 0).
        bias = ((1.0 - mask.float()) * -1e9).reshape(B, 1, 1, L)
        for lw in self.layers:
            q, k, v = _linear(x, lw["qkv_w"], lw["qkv_b"]).contiguous().reshape(B, L, 3, nh, hd).permute(2, 0, 3, 1, 4)
            s = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(hd)) + bias
            s = (s - s.max(-1, keepdim=True)).exp()
            p = (s / s.sum(-1, keepdim=True)).contiguous()
            ctx = (p @ v).permute(0, 2, 1, 3).reshape(B * L, nh * hd)
            x = self._ln(x + _linear(ctx, lw["o_w"], lw["o_b"]), (lw["ln1_w"], lw["ln1_b"]))
            x = self._ln(
                x + _linear(self.act(_linear(x, lw["i_w"], lw["i_b"])), lw["f_w"], lw["f_b"]),
                (lw["ln2_w"], lw["ln2_b"]),
            )
        return x.reshape(B, L, -1)


class BucketedBert(abc.ABC):
    """Shared driver: validates rows, pads them to length buckets, runs fixed-shape micro-batches through a
    TinyJit per (length, batch) and reports progress. Subclasses define ``_head`` (what the JIT returns)."""

    SIZES: ClassVar[tuple[int, ...]] = BATCH_SIZES

    def __init__(self, cfg: BertConfig, weights: dict[str, Tensor], max_tokens: int = DEFAULT_MAX_TOKENS) -> None:
        if not 2 <= max_tokens <= cfg.max_tokens:
            raise ValueError(f"max_tokens {max_tokens} must be in [2, {cfg.max_tokens}] (the position table's)")
        self.cfg, self.body, self.max_tokens = cfg, BertBody(cfg, weights), max_tokens
        self.buckets = buckets(max_tokens)
        # one TinyJit per (length, batch); the JIT cache puts restored ones in (worker/_warmcache.py)
        self.jits: dict[tuple[int, int], Any] = {}
        self._tuned: dict[int, int] = {}  # length -> the largest BEAM-tuned batch size

    def captured(self, shape: tuple[int, int]) -> bool:
        return getattr(self.jits.get(shape), "captured", None) is not None

    @property
    def dims(self) -> int:
        return self.cfg.hidden_size

    @abc.abstractmethod
    def _head(self, h: Tensor, mask: Tensor) -> Tensor:
        """The task head on the encoder's hidden states (pooling, or pooler + classifier)."""

    def _forward(self, ids: Tensor, tt: Tensor, pos: Tensor, mask: Tensor) -> Tensor:
        return self._head(self.body(ids, tt, pos, mask), mask).realize()

    def _sizes(self, length: int) -> tuple[int, ...]:
        return sizes_for(length, self.SIZES)

    def shapes_for(self, lengths: Sequence[int]) -> list[tuple[int, int]]:
        """The (length, batch) shapes a run of rows with these token counts uses (none for counts it refuses)."""
        if not all(1 <= n <= self.max_tokens for n in lengths):
            return []
        return [(L, B) for L, B, _ in plan_rows(lengths, self.buckets, self.SIZES, self._tuned)]

    def all_shapes(self) -> list[tuple[int, int]]:
        """Every (length, batch) micro-batch shape this model can run, smallest first."""
        return [(L, B) for L in self.buckets for B in self._sizes(L)]

    @classmethod
    def tuned_shapes(cls, max_tokens: int) -> list[tuple[int, int]]:
        return tuned_shapes(max_tokens, cls.SIZES)

    def warmup(self, shapes: Sequence[tuple[int, int]], progress: Progress = None,
               around: Callable[[tuple[int, int]], AbstractContextManager[None]] | None = None,
               tuned: bool = False) -> None:
        """Compiles and captures the TinyJits for ``shapes`` ((length, batch) pairs from ``all_shapes``) ahead of
        traffic: on CPU tinygrad's first run of a new shape spends seconds generating kernels. ``around(shape)``
        wraps a shape's compile and capture (the worker's BEAM search); ``tuned`` says it searched, so the batch
        plan pads remainders up to these shapes (plan_batches)."""
        for k, (L, B) in enumerate(shapes):
            if L not in self.buckets or B not in self._sizes(L):
                raise ValueError(f"({L}, {B}) is not a micro-batch shape of this model")
            if tuned:
                self._tuned[L] = max(B, self._tuned.get(L, 0))
            # Two runs: the first compiles, the second captures the JIT (later calls replay). A JIT restored
            # from the cache is captured already.
            if not self.captured((L, B)):
                with around((L, B)) if around is not None else nullcontext():
                    for _ in range(2):
                        self._run([np.ones(L, np.int32)] * B, None, self._width(), None)
            if progress is not None:
                progress(k + 1)

    @abc.abstractmethod
    def _width(self) -> int:
        """Columns of the model's output per row."""

    def _run(
        self, rows: Sequence[np.ndarray], types: Sequence[np.ndarray] | None, width: int, progress: Progress
    ) -> np.ndarray:
        ids = check_rows(rows, "rows", self.cfg.vocab_size, self.max_tokens)
        if types is not None:
            tts = check_types(ids, types, self.cfg.type_vocab_size, self.max_tokens)
        out = np.zeros((len(ids), width), np.float32)
        done = 0
        for L, B, sel in plan_rows([len(a) for a in ids], self.buckets, self.SIZES, self._tuned):
            take = len(sel)
            x, t, p, m = (np.zeros((B, L), np.int32) for _ in range(4))
            for j, i in enumerate(sel):
                n = len(ids[i])
                x[j, :n], p[j, :n], m[j, :n] = ids[i], self.cfg.positions(ids[i]), 1
                if types is not None:
                    t[j, :n] = tts[i]
            # Padded rows attend to one token so no softmax row is all-masked; their output is dropped.
            m[take:, 0] = 1
            if (jit := self.jits.get((L, B))) is None:
                jit = self.jits[(L, B)] = TinyJit(self._forward)
            res = jit(*(Tensor(a, device=Device.DEFAULT) for a in (x, t, p, m))).numpy()
            out[sel] = res[:take].reshape(take, width)
            done += take
            if progress is not None:
                progress(done)
        return out


class BertEncoder(BucketedBert):
    @classmethod
    def load(cls, artifact_path: pathlib.Path, config: dict[str, Any],
             max_tokens: int = DEFAULT_MAX_TOKENS) -> BertEncoder:
        cfg = BertConfig.from_dict(config)
        return cls(cfg, load_weights(artifact_path, cfg.shapes()), max_tokens=min(max_tokens, cfg.max_tokens))

    def _width(self) -> int:
        return len(POOLINGS) * self.dims

    def _head(self, h: Tensor, mask: Tensor) -> Tensor:
        # Every pooling in one JIT so the cache key stays (length, batch); choosing one is a host-side slice. Rows
        # are padded on the right: a row's last token is where its mask steps down.
        m = mask.float().unsqueeze(-1)
        mean = (h * m).sum(1) / m.sum(1).maximum(1e-9)
        top = (m > 0).where(h, float("-inf")).max(1)
        last = m - m[:, 1:].pad(((0, 0), (0, 1), (0, 0)))
        return Tensor.stack(mean, h[:, 0], top, (h * last).sum(1), dim=1)

    def embed(self, rows: list[np.ndarray], pooling: str, normalize: bool, progress: Progress = None) -> np.ndarray:
        check_pooling(pooling)
        return pool(self._run(rows, None, self._width(), progress), pooling, normalize)


def check_pooling(pooling: str) -> None:
    if pooling not in POOLINGS:
        raise ValueError(f"pooling must be one of {', '.join(POOLINGS)}, got {pooling!r}")


def pool(every: np.ndarray, pooling: str, normalize: bool) -> np.ndarray:
    """(n, len(POOLINGS) * dims), each row's poolings in POOLINGS' order (mean | [CLS] | max | last token) -> (n,
    dims) of one pooling, optionally unit length."""
    k = len(POOLINGS)
    v = np.ascontiguousarray(every.reshape(len(every), k, every.shape[1] // k)[:, POOLINGS.index(pooling)])
    # torch.nn.functional.normalize semantics: x / max(||x||, 1e-12)
    if normalize:
        v /= np.maximum(np.linalg.norm(v, axis=1, keepdims=True), 1e-12)
    return v
