"""BERT and XLM-RoBERTa encoders and cross-encoders for tinygrad's CPU device as one fused C kernel
(kernels/bert_encode.c).

The CPU default (`encoder = "fused"`); other devices run bert.py, whose kernels tinygrad generates. The kernel
is C source run through tinygrad's custom_kernel (models/ckernel.py), so tinygrad compiles, caches, captures
and replays it, and it runs only where tinygrad compiles C.

Rows are packed back to back, without padding, into calls of at most CAP tokens, and every call has the same
buffers: one captured graph serves every batch, with no length buckets, no per-shape compiles and no padded
work. The kernel uses `threads` cores (kernels/threads.h); tinygrad's own CPU runner uses one.
"""

from __future__ import annotations

import pathlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from tinygrad import Tensor, TinyJit, dtypes
from tinygrad.nn.state import safe_load_metadata

from .._kinds import DEFAULT_MAX_TOKENS, MAX_THREADS, POOLINGS
from . import ckernel, csource
from .bert import BertConfig, bare, check_pooling, check_rows, check_types, checked_tensors, pool
from .cross_encoder import head_names, head_shapes, num_labels

Progress = Callable[[int], None] | None

PW, NR = 16, 32  # kernels/gemm.h: packed panel width; column counts are multiples of NR
CAP = 2048  # tokens per kernel call
MB = 192  # rows per row block: each block streams the layer's weights (7 MB for MiniLM) once; 48 ran 15% slower
_MR_MAX = 16  # kernels/bert_math.h MR is at most this
_FLOATS = {"F64": np.float64, "F32": np.float32, "F16": np.float16}  # safetensors dtypes (BF16 by hand)
_ACTS = {"gelu": 0, "gelu_new": 1, "gelu_pytorch_tanh": 1, "relu": 2}


@dataclass(frozen=True)
class BertDims:
    """The model's dimensions, as kernels/bert_encode.c's defines."""

    h: int
    nh: int
    hd: int
    ff: int
    nl: int
    eps: float
    act: int  # 0 GELU (erf), 1 GELU (tanh), 2 ReLU


@dataclass(frozen=True)
class Capacity:
    """One call's buffers: tokens, the longest sequence (rounded up to NR), rows per row block, threads, the
    scratch floats they need (the kernel's layout, checked by the kernel at compile time), and the poolings
    written per sequence (POOLINGS)."""

    cap: int
    maxlp: int
    mb: int
    threads: int
    scratch: int
    pools: int = len(POOLINGS)


def supported(cfg: BertConfig) -> None:
    """ValueError unless the kernel's tiles fit the model: hidden and FFN sizes in whole panels."""
    if cfg.hidden_size % NR or cfg.intermediate_size % NR:
        raise ValueError(f"the fused encoder needs hidden and intermediate sizes that are multiples of {NR}, "
                         f"got {cfg.hidden_size} and {cfg.intermediate_size} (encoder = 'graph' runs any)")


def panels(w: np.ndarray) -> np.ndarray:
    """An (out, in) weight -> panels of PW output columns, each `in` rows of PW floats (kernels/gemm.h)."""
    n, k = w.shape
    if n % NR:
        raise ValueError(f"weight rows ({n}) must be a multiple of {NR}")
    return np.ascontiguousarray(w.reshape(n // PW, PW, k).transpose(0, 2, 1)).reshape(-1)


def scratch_floats(d: BertDims, cap: int, maxlp: int, mb: int, threads: int) -> int:
    """kernels/bert_encode.c: x, q|k|v and attention output for every token, then per thread an FFN row block,
    K transposed and V packed, a tile's scores."""
    return cap * 5 * d.h + threads * (mb * d.ff + 2 * d.hd * maxlp + _MR_MAX * maxlp)


def pack_weights(cfg: BertConfig, w: dict[str, np.ndarray]) -> list[np.ndarray]:
    """Hugging Face BERT weights -> the encode kernel's weight arguments, in order (kernels/bert_encode.c)."""
    e, att = "embeddings.", "attention.self."
    layers = [f"encoder.layer.{n}." for n in range(cfg.num_hidden_layers)]

    def stack(fn: Callable[[str], np.ndarray]) -> np.ndarray:
        return np.concatenate([fn(p).reshape(-1) for p in layers]).astype(np.float32)

    def qkv(p: str, part: str) -> np.ndarray:
        return np.concatenate([w[p + att + x + part] for x in ("query", "key", "value")])

    def ln(name: str) -> Callable[[str], np.ndarray]:
        return lambda p: np.concatenate([w[p + name + ".weight"], w[p + name + ".bias"]])

    def dense(name: str) -> list[np.ndarray]:
        return [stack(lambda p: panels(w[p + name + ".weight"])), stack(lambda p: w[p + name + ".bias"])]

    return [
        w[e + "word_embeddings.weight"], w[e + "position_embeddings.weight"], w[e + "token_type_embeddings.weight"],
        ln("LayerNorm")(e).astype(np.float32),
        stack(lambda p: panels(qkv(p, ".weight"))), stack(lambda p: qkv(p, ".bias")),
        *dense("attention.output.dense"), stack(ln("attention.output.LayerNorm")),
        *dense("intermediate.dense"), *dense("output.dense"), stack(ln("output.LayerNorm")),
    ]


def pack_rows(view: np.ndarray, rows: list[np.ndarray], types: list[np.ndarray] | None,
              positions: list[np.ndarray]) -> None:
    """The kernel's `in` buffer (kernels/bert_encode.c) for rows of at most CAP tokens in all."""
    lens = np.array([len(r) for r in rows], np.int32)
    n = int(lens.sum())
    if n > CAP:
        raise ValueError(f"{n} tokens do not fit one call of {CAP}")
    view[0], view[1] = len(rows), n
    view[2 : 3 + len(rows)] = np.concatenate([[0], np.cumsum(lens)])
    view[3 + CAP : 3 + CAP + n] = np.concatenate(rows)
    view[3 + 2 * CAP : 3 + 2 * CAP + n] = np.concatenate(types) if types is not None else 0
    view[3 + 3 * CAP : 3 + 3 * CAP + n] = np.concatenate(positions)


IN_INTS = 3 + 4 * CAP  # the `in` buffer: counts, offsets, ids, token types, position ids


class FusedBert:
    """Packed weights and the captured kernel; `_pooled` runs rows to their poolings (POOLINGS' order)."""

    def __init__(self, cfg: BertConfig, w: dict[str, np.ndarray],
                 max_tokens: int = DEFAULT_MAX_TOKENS, threads: int = 1) -> None:
        if not 2 <= max_tokens <= min(cfg.max_tokens, CAP):
            raise ValueError(f"max_tokens {max_tokens} must be in [2, {min(cfg.max_tokens, CAP)}]")
        if not 1 <= threads <= MAX_THREADS:
            raise ValueError(f"threads must be 1..{MAX_THREADS}, got {threads}")
        supported(cfg)
        h, nh = cfg.hidden_size, cfg.num_attention_heads
        self.cfg, self.max_tokens, self.threads = cfg, max_tokens, threads
        self.spec = BertDims(h=h, nh=nh, hd=h // nh, ff=cfg.intermediate_size, nl=cfg.num_hidden_layers,
                             eps=cfg.layer_norm_eps, act=_ACTS[cfg.hidden_act])
        maxlp = -(-max_tokens // NR) * NR
        self.capacity = Capacity(cap=CAP, maxlp=maxlp, mb=MB, threads=threads,
                                 scratch=scratch_floats(self.spec, CAP, maxlp, MB, threads))
        self.weights = [Tensor(a) for a in pack_weights(cfg, w)]
        # Persistent inputs, written in place before each replay: sequence count, token count, offsets, ids and
        # token types; and the host table (addresses of this process's pthread functions and expf).
        self._in = Tensor.zeros(IN_INTS, dtype=dtypes.int32).contiguous()
        self._host = Tensor.zeros(ckernel.HOST_TABLE_WORDS, dtype=dtypes.uint64).contiguous()
        Tensor.realize(self._in, self._host, *self.weights)
        self._jit = TinyJit(self._forward)
        self.call_tokens = CAP  # rows per call are packed up to this many tokens

    @staticmethod
    def read(artifact_path: pathlib.Path, shapes: dict[str, tuple[int, ...]]) -> dict[str, np.ndarray]:
        """The safetensors weights as float32 arrays to pack, after the graph encoder's checks
        (bert.checked_tensors), straight from a memmap of the file: no device copies, no cast kernels."""
        checked_tensors(artifact_path, shapes)
        _, start, meta = safe_load_metadata(artifact_path)
        data = np.memmap(artifact_path, np.uint8, "r").view(np.ndarray)
        names = {bare(k): k for k in meta if k != "__metadata__"}
        out = {}
        for name, shape in shapes.items():
            v = meta[names[name]]
            lo, hi = (start + int(o) for o in v["data_offsets"])
            raw = data[lo:hi]
            if v["dtype"] == "BF16":
                a = (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
            else:
                a = raw.view(_FLOATS[v["dtype"]]).astype(np.float32)
            out[name] = a.reshape(shape)
        return out

    def _forward(self, inp: Tensor) -> Tensor:
        src = csource.source("bert_encode.c", self.spec, self.capacity)
        out, scr = Tensor.empty(CAP * self.capacity.pools * self.spec.h), Tensor.empty(self.capacity.scratch)
        d, toks = self.spec, CAP
        macs = toks * d.nl * d.h * (4 * d.h + 2 * d.ff)
        mem = sum(w.nbytes() for w in self.weights[4:])
        return ckernel.kernel("encode", src, [out, scr], [inp, self._host, *self.weights],
                              ops=2 * macs, mem=mem)[0].realize()

    def warmup(self, progress: Progress = None) -> None:
        """Compile, then capture the kernel's graph (later calls replay it): seconds, once."""
        for k in range(2):
            self._pooled([np.ones(2, np.int32)], None)
            if progress is not None:
                progress(k + 1)

    def _pooled(self, rows: list[np.ndarray], types: list[np.ndarray] | None, progress: Progress = None) -> np.ndarray:
        """(len(rows), pools * hidden): each row's final hidden states pooled every way, in POOLINGS' order. Rows
        go in calls of at most CAP tokens, in order; `progress(rows done)` after each call."""
        width = self.capacity.pools * self.spec.h
        out = np.zeros((len(rows), width), np.float32)
        np.frombuffer(self._host.uop.buffer.as_memoryview(force_zero_copy=True), np.uint64)[:] = \
            ckernel.host_table(self.threads)
        view = np.frombuffer(self._in.uop.buffer.as_memoryview(force_zero_copy=True), np.int32)
        done = 0
        while done < len(rows):
            end, n = done, 0
            while end < len(rows) and n + len(rows[end]) <= self.call_tokens:
                n += len(rows[end])
                end += 1
            pack_rows(view, rows[done:end], types[done:end] if types is not None else None,
                      [self.cfg.positions(r) for r in rows[done:end]])
            res = self._jit(self._in).uop.buffer.as_memoryview(force_zero_copy=True)
            out[done:end] = np.frombuffer(res, np.float32, (end - done) * width).reshape(-1, width)
            done = end
            if progress is not None:
                progress(done)
        return out


class FusedBertEncoder(FusedBert):
    """bert.BertEncoder's interface on the fused kernel."""

    @classmethod
    def load(cls, artifact_path: pathlib.Path, config: dict[str, Any], max_tokens: int = DEFAULT_MAX_TOKENS,
             threads: int = 1) -> FusedBertEncoder:
        cfg = BertConfig.from_dict(config)
        supported(cfg)
        return cls(cfg, cls.read(artifact_path, cfg.shapes()), min(max_tokens, cfg.max_tokens), threads)

    @property
    def dims(self) -> int:
        return self.spec.h

    def embed(self, rows: list[np.ndarray], pooling: str, normalize: bool, progress: Progress = None) -> np.ndarray:
        check_pooling(pooling)
        ids = check_rows(rows, "rows", self.cfg.vocab_size, self.max_tokens)
        return pool(self._pooled(ids, None, progress), pooling, normalize)


class FusedCrossEncoder(FusedBert):
    """cross_encoder.BertCrossEncoder's interface on the fused kernel: out(tanh(dense([CLS]))), the head in numpy
    (two small matmuls per batch)."""

    def __init__(self, cfg: BertConfig, w: dict[str, np.ndarray], num_labels: int, max_tokens: int = DEFAULT_MAX_TOKENS,
                 threads: int = 1) -> None:
        super().__init__(cfg, w, max_tokens, threads)
        self.num_labels = num_labels
        dense, out = head_names(cfg)
        self.pool_w, self.pool_b = w[dense + ".weight"], w[dense + ".bias"]
        self.cls_w, self.cls_b = w[out + ".weight"], w[out + ".bias"]

    @classmethod
    def load(cls, artifact_path: pathlib.Path, config: dict[str, Any], max_tokens: int = DEFAULT_MAX_TOKENS,
             threads: int = 1) -> FusedCrossEncoder:
        cfg = BertConfig.from_dict(config)
        supported(cfg)
        n = num_labels(config)
        w = cls.read(artifact_path, cfg.shapes() | head_shapes(cfg, n))
        return cls(cfg, w, n, min(max_tokens, cfg.max_tokens), threads)

    def logits(self, pairs: list[np.ndarray], token_type_ids: list[np.ndarray] | None,
               progress: Progress = None) -> np.ndarray:
        """Raw classifier logits, shape (n, num_labels)."""
        ids = check_rows(pairs, "rows", self.cfg.vocab_size, self.max_tokens)
        tts = check_types(ids, token_type_ids, self.cfg.type_vocab_size, self.max_tokens) \
            if token_type_ids is not None else None
        h = self.spec.h
        at = POOLINGS.index("cls") * h
        cls_h = self._pooled(ids, tts, progress)[:, at : at + h]
        pooled = np.tanh(cls_h @ self.pool_w.T + self.pool_b)
        return np.ascontiguousarray(pooled @ self.cls_w.T + self.cls_b, dtype=np.float32)

    def score(self, pairs: list[np.ndarray], token_type_ids: list[np.ndarray] | None,
              progress: Progress = None) -> np.ndarray:
        """One float32 relevance per pair: the single logit of a num_labels == 1 reranker."""
        if self.num_labels != 1:
            raise ValueError(f"score() needs a single-logit reranker, this model has num_labels={self.num_labels}")
        return np.ascontiguousarray(self.logits(pairs, token_type_ids, progress)[:, 0])
