"""Llama-shaped decoder (llama, qwen2, qwen3: models/architectures.py) for tinygrad's CPU device: packed GGUF weights,
KV cache, greedy generation.

The CPU default (`decoder = "fused"`): its kernel is C source run through tinygrad's custom_kernel, so tinygrad
compiles, caches, captures and replays it, but it only runs where tinygrad compiles C (CPU). Other devices use
llama.py, whose kernels tinygrad generates.

Shapes are fixed so TinyJit can replay the kernels: prefill runs in chunks of PREFILL_CHUNK tokens (the
last one padded) and decode runs one token at a time. Each call takes one int32 tensor, the chunk's ids
followed by its start position and the row whose next token is wanted, so one captured graph per phase
serves every position up to max_context with no symbolic shapes.

Quantised matrices stay packed and are dequantised in registers (kernels/quant.h), so a decode step reads
~110 MB instead of 540 MB of float32. Each layer's q, k, v, o, gate|up and down matrices take the layout of their
own GGUF type (models/quant.py kernel_type), as llama.cpp's mixed files need: only gate and up, whose rows are
interleaved, share one, and a type with none (F16, BF16, Q5_1) is dequantised to float32 at load. The whole
forward pass is one C kernel (kernels/llama_forward.c): a tinygrad launch costs ~80 us of Python here, which was a
third of a step even at one kernel per layer half.
"""

from __future__ import annotations

import functools
import pathlib
from dataclasses import dataclass
from typing import Any

import numpy as np
from tinygrad import Tensor, TinyJit, dtypes

from .. import _hugepages
from .._kinds import DEFAULT_CONTEXT
from ..gguf_file import GGUFTensor, read_tensors
from . import ckernel, csource, quant
from .architectures import BIASES, HEAD_NORMS, llama_layout
from .greedy import BATCH, PREFILL_CHUNK, GreedyDecoder


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
    biases: int  # 1: q/k/v biases
    head_norms: int  # 1: q/k RMS norms per head, ahead of RoPE
    layouts: int  # a bit per layout (quant.LAYOUTS) some layer matrix is packed in
    type_embd: int
    type_out: int


@dataclass(frozen=True)
class Step:
    """One captured graph's chunk: T rows, matmul tiles of NT rows, SPLIT accumulators per row (kernels/qmatmul.h),
    HEADS rows predicted from (1: the chunk's last; T: every row, a batched decode step)."""

    t: int
    nt: int
    split: int
    heads: int


# The captured graphs: a prefill chunk, one token, and one token of each of BATCH sequences. The last two split
# their accumulators alike, so a sequence decoded in a batch is bit for bit the sequence decoded alone; the batched
# step's tile takes all its rows, so each weight is dequantised once a step.
PREFILL = Step(t=PREFILL_CHUNK, nt=4, split=0, heads=1)
DECODE = Step(t=1, nt=1, split=1, heads=1)
BATCHED = Step(t=BATCH, nt=BATCH, split=1, heads=BATCH)
STEPS = {s.t: s for s in (PREFILL, DECODE, BATCHED)}

# Each layer's matrices, in kernels/llama_forward.c's PART_ order: the part, its kind's buffer, its GGUF tensors
# (gate and up rows interleaved).
PARTS = (("q", "qkv", ("attn_q",)), ("k", "qkv", ("attn_k",)), ("v", "qkv", ("attn_v",)),
         ("o", "o", ("attn_output",)), ("gu", "gu", ("ffn_gate", "ffn_up")), ("d", "d", ("ffn_down",)))


def _resident(a: np.ndarray, pages: list[Any]) -> Tensor:
    """Packed weights (bytes) as a CPU tensor on huge pages (_hugepages.py), whose mapping joins `pages`: a decode
    step streams them whole."""
    mm, at = _hugepages.mapping(a.nbytes)
    np.frombuffer(mm, np.uint8, a.nbytes)[:] = a.reshape(-1).view(np.uint8)
    pages.append(mm)
    return Tensor.from_blob(at, a.shape, dtype=dtypes.uint8, device="CPU")


class FusedLlamaLM(GreedyDecoder):
    batches = True

    def __init__(self, kv: dict[str, Any], raw: dict[str, GGUFTensor], max_context: int, threads: int = 1) -> None:
        inv_freq = self._hparams(kv, raw, max_context)
        raw = llama_layout(kv, raw, self.head_dim)
        self.ff = int(raw["blk.0.ffn_gate.weight"].shape[0])
        qd = self.n_heads * self.head_dim
        if self.dim % 32 or self.ff % 32 or qd % 32 or self.head_dim % 16 or self.n_heads % self.n_kv:
            raise ValueError("dimensions must be multiples of the 32-element quant block")

        def mat(typ: int, *names: str, interleave: bool = False) -> np.ndarray:
            """Rows of one or more matrices packed in kernel layout `typ`, stacked (or row-interleaved)."""
            parts = [quant.pack(raw[n].typ, raw[n].data, raw[n].shape[0], typ) for n in names]
            return quant.group(typ, np.stack(parts, 1).reshape(-1, parts[0].shape[1]) if interleave
                               else np.concatenate(parts))

        self._pages: list[Any] = []  # the mappings the weights live in (resident)
        self._held: dict[int, np.ndarray] = {}  # each cache slot's prefilled prompt, while its positions hold it
        self._runs: dict[int, ckernel.Replay] = {}  # each captured graph, run straight through (ckernel.Replay)
        resident = functools.partial(_resident, pages=self._pages)

        def vec(name: str) -> np.ndarray:
            return quant.f32(raw[name].typ, raw[name].data)

        def per_layer(names: tuple[str, ...], present: bool) -> Tensor:
            """Vectors `names` of every layer back to back; one zero, which the kernel never reads, when absent."""
            if not present:
                return Tensor.zeros(1).contiguous()
            return Tensor(np.concatenate([vec(f"blk.{i}.{n}") for i in range(self.n_layers) for n in names]))

        def layers() -> tuple[dict[str, Tensor], np.ndarray]:
            """Each kind's buffer (its layers' parts back to back, each in its own layout) and the layer table:
            per layer and part, the layout and the byte offset in the kind's buffer."""
            chunks: dict[str, list[np.ndarray]] = {"qkv": [], "o": [], "gu": [], "d": []}
            table = np.zeros((self.n_layers, len(PARTS), 2), np.int64)
            for i in range(self.n_layers):
                for p, (part, kind, names) in enumerate(PARTS):
                    tensors = [f"blk.{i}.{n}.weight" for n in names]
                    typ = quant.kernel_type(*(raw[n].typ for n in tensors))
                    self.layouts[part].append(typ)
                    table[i, p] = typ, sum(c.nbytes for c in chunks[kind])
                    chunks[kind].append(mat(typ, *tensors, interleave=len(tensors) > 1))
            return {k: resident(np.concatenate(c)) for k, c in chunks.items()}, table.reshape(-1)

        self.layouts: dict[str, list[int]] = {part: [] for part, _, _ in PARTS}
        self.embd_type = quant.kernel_type(raw["token_embd.weight"].typ)
        embd = mat(self.embd_type, "token_embd.weight")
        self.vocab_size = int(raw["token_embd.weight"].shape[0])
        if "output.weight" in raw:
            self.out_type = quant.kernel_type(raw["output.weight"].typ)
            out = mat(self.out_type, "output.weight")
        else:
            self.out_type, out = self.embd_type, embd
        self.tok_embd = resident(embd)
        self.output = resident(out) if out is not embd else self.tok_embd
        self.out_norm = Tensor(vec("output_norm.weight"))
        self.attn_norm = Tensor(np.concatenate([vec(f"blk.{i}.attn_norm.weight") for i in range(self.n_layers)]))
        self.ffn_norm = Tensor(np.concatenate([vec(f"blk.{i}.ffn_norm.weight") for i in range(self.n_layers)]))
        kinds, table = layers()
        self.wqkv, self.wo, self.wgu, self.wd = kinds["qkv"], kinds["o"], kinds["gu"], kinds["d"]
        self.layer_table = Tensor(table)
        self.bqkv = per_layer(BIASES, self.biases)
        self.head_norm = per_layer(HEAD_NORMS, self.head_norms)
        # Slots past max_context absorb the padding of a final prefill chunk.
        self.slots = self.max_context + PREFILL_CHUNK
        # RoPE factors in float64, computed as the reference does (complex exponential of pos * inv_freq).
        rot = np.exp(1j * np.arange(self.slots)[:, None] * inv_freq[None, :])
        self.rope = Tensor(np.concatenate([rot.real, rot.imag], axis=1).reshape(-1))
        # A cache slot per sequence: slot 0 for generate(), 1..BATCH for the sequences of a batch (models/batched.py).
        # Left unwritten (the kernel reads only positions a sequence has written), so a page of it takes memory only
        # once a sequence reaches it: ~460 MB at the default context, most of it never touched.
        self.cache = Tensor.empty((BATCH + 1) * self.n_layers * 2 * self.n_kv * self.slots * self.head_dim)
        self.weights = [self.tok_embd, self.attn_norm, self.wqkv, self.wo, self.ffn_norm, self.wgu, self.wd,
                        self.rope, self.out_norm, self.output, self.bqkv, self.head_norm, self.layer_table]
        # The kernel's host table (kernels/threads.h): this process's pthread functions and expf, written before
        # each step.
        self.threads = threads
        self._host = Tensor.zeros(ckernel.HOST_TABLE_WORDS, dtype=dtypes.uint64).contiguous()
        Tensor.realize(self.cache, self._host, *self.weights)
        self._prefill = TinyJit(self._forward)
        self._decode = TinyJit(self._forward)
        self._batched = TinyJit(self._forward)
        self._jits = {PREFILL_CHUNK: self._prefill, 1: self._decode, BATCH: self._batched}
        # Persistent JIT inputs, written in place: a fresh Tensor(ids) and .item() schedule a copy each, which
        # cost ~2.5 ms of Python per decode step here.
        self._ids = {n: Tensor.zeros(3 * n + 1, dtype=dtypes.int32).contiguous().realize() for n in STEPS}
        # The kernel's scratch, persistent too: its last vocab_size floats are the step's logits, which sampling
        # and logprobs read in place after the replay (greedy never does).
        self._scratch = {s.t: Tensor.zeros(self._scratch_floats(s)).contiguous().realize() for s in STEPS.values()}
        self._last_t = 1

    @classmethod
    def load(cls, gguf_path: pathlib.Path, max_context: int = DEFAULT_CONTEXT, warmup: bool = True,
             threads: int = 1) -> FusedLlamaLM:
        """Pack the GGUF's weights. `warmup` traces and captures both JIT graphs now (seconds), so the first
        real request runs at steady speed. `threads`: the cores one step uses (AUTO_THREADS: its share of the node's,
        asked each step: _cores.py)."""
        kv, raw = read_tensors(pathlib.Path(gguf_path))
        lm = cls(kv, raw, max_context, threads)
        if warmup:
            lm.warmup()
        return lm

    def _scratch_floats(self, step: Step) -> int:
        """kernels/llama_forward.c's scratch: x and h, then q|k|v and the attention output or the gate/up pairs and
        their product, then the logits."""
        nqkv, qd = (self.n_heads + 2 * self.n_kv) * self.head_dim, self.n_heads * self.head_dim
        return step.t * 2 * self.dim + step.t * max(nqkv + qd, 3 * self.ff) + step.heads * self.vocab_size

    def __getstate__(self) -> dict[str, Any]:
        """What the JIT cache stores, less this process's own: the mappings its weights live in (a restored model's
        are the cache's copies, worker/_jitcache.py), the slots' prompts (a restored cache's contents are unknown:
        the cache's probe replays the graphs on zeros) and the graphs' straight runs (their runtimes')."""
        return {k: v for k, v in self.__dict__.items() if k not in ("_pages", "_held", "_runs")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _pages=[], _held={}, _runs={})

    def reused(self, ids: np.ndarray, slot: int) -> int:
        """The prompt's first positions that slot `slot`'s last prefill left there: a prefill chunk computes each
        row bit for bit as in any other chunk (kernels/qmatmul.h; attention reads the cache), so a prompt sharing
        a prefix with the last one (a chat's system prompt and earlier turns) runs only from where they part."""
        held = self._held.get(slot)
        if held is None:
            return 0
        m = min(len(held), len(ids) - 1)
        differ = np.flatnonzero(held[:m] != np.asarray(ids[:m]))
        return int(differ[0]) if len(differ) else m

    def _prefilled(self, ids: np.ndarray, slot: int) -> None:
        self._held[slot] = np.array(ids, np.int32)

    def forget_prompts(self) -> None:
        self._held.clear()

    def _prefill_step(self, tokens: np.ndarray, start: int, last: int, slot: int = 0) -> int:
        n = len(tokens)
        return self._step(PREFILL_CHUNK, tokens, np.arange(start, start + n), [slot] * n, last + 1)[0]

    def _decode_step(self, token: int, pos: int, slot: int = 0) -> int:
        return self._step(1, [token], [pos], [slot], 1)[0]

    def _batched_step(self, tokens: list[int], positions: list[int], slots: list[int]) -> list[int]:
        # one sequence left runs the one-token graph: same arithmetic, half the rows of the batched one's tile
        return self._step(BATCH if len(tokens) > 1 else 1, tokens, positions, slots, len(tokens))

    def _step(self, t: int, tokens: np.ndarray | list[int], positions: Any, slots: list[int], used: int) -> list[int]:
        """One replay of the T = `t` graph: `tokens` at `positions` in cache `slots`; the first `used` rows are
        real (a prefill chunk predicts after the last of them, a batched step after each)."""
        self._last_t = t
        for pos, sl in zip(positions, slots, strict=True):  # a row written over a held prompt's position ends it
            if (held := self._held.get(sl)) is not None and pos < len(held):
                del self._held[sl]
        ids = self._ids[t]
        view = np.frombuffer(ids.uop.buffer.as_memoryview(force_zero_copy=True), np.int32)
        view[:] = 0
        n = len(tokens)
        view[:n], view[t : t + n], view[2 * t : 2 * t + n], view[3 * t] = tokens, positions, slots, used
        np.frombuffer(self._host.uop.buffer.as_memoryview(force_zero_copy=True), np.uint64)[:] = \
            ckernel.host_table(self.threads)
        run = self._runs.get(t)
        if run is None:  # until the graph is captured (or where it cannot run straight through), TinyJit replays it
            out = self._jits[t](ids).uop.buffer.as_memoryview(force_zero_copy=True)
            if (run := ckernel.Replay.of(self._jits[t], [ids])) is not None:
                self._runs[t] = run
        else:
            out = run()
        return [int(v) for v in np.frombuffer(out, np.int32)[: used if STEPS[t].heads > 1 else 1]]

    def _logits(self, row: int = 0) -> np.ndarray:
        scratch = self._scratch[self._last_t].uop.buffer.as_memoryview(force_zero_copy=True)
        heads = STEPS[self._last_t].heads
        return np.frombuffer(scratch, np.float32)[-self.vocab_size * heads:].reshape(heads, -1)[row]

    def source(self, t: int) -> str:
        """The C source of the T = `t` step (kernels/llama_forward.c with this model's dimensions)."""
        H, KV, HD = self.n_heads, self.n_kv, self.head_dim
        used = {t for per_layer in self.layouts.values() for t in per_layer}
        dims = LlamaDims(d=self.dim, h=H, kv=KV, hd=HD, ff=self.ff, v=self.vocab_size, s=self.slots,
                         nl=self.n_layers, eps=self.eps, g=quant.G, type_embd=self.embd_type, type_out=self.out_type,
                         layouts=sum(1 << t for t in used), biases=int(self.biases), head_norms=int(self.head_norms))
        return csource.source("llama_forward.c", dims, STEPS[t])

    def _forward(self, ids: Tensor) -> Tensor:
        """ids (3T + 1,) int32: T tokens, their positions, their cache slots, the rows in use -> next ids (HEADS,)."""
        T, D, FF, V = (ids.shape[0] - 1) // 3, self.dim, self.ff, self.vocab_size
        nqkv, step, scratch = (self.n_heads + 2 * self.n_kv) * self.head_dim, STEPS[T], self._scratch[T]
        assert scratch.shape[0] == self._scratch_floats(step)
        macs = T * self.n_layers * D * (nqkv + self.n_heads * self.head_dim + 3 * FF) + D * V
        mem = sum(w.nbytes() for w in (self.wqkv, self.wo, self.wgu, self.wd, self.output))
        return ckernel.kernel("forward", self.source(T), [Tensor.empty(step.heads, dtype=dtypes.int32), scratch,
                              self.cache], [ids, self._host, *self.weights], inout=(2,), ops=2 * macs,
                              mem=mem)[0].realize()
