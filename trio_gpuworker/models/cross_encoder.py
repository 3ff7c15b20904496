"""BERT and XLM-RoBERTa sequence-classification cross-encoders (ms-marco-MiniLM, bge-reranker and friends) on the
shared encoder body."""

from __future__ import annotations

import pathlib
from typing import Any

import numpy as np
from tinygrad import Tensor

from .._kinds import DEFAULT_MAX_TOKENS
from .bert import BertConfig, BucketedBert, Progress, load_weights


class BertCrossEncoder(BucketedBert):
    """Scores ``[CLS] query [SEP] doc [SEP]`` rows (``<s> query </s></s> doc </s>``) as ...ForSequenceClassification
    does: out(tanh(dense([CLS]))), with the layers `head_names` gives."""

    def __init__(self, cfg: BertConfig, weights: dict[str, Tensor], num_labels: int,
                 max_tokens: int = DEFAULT_MAX_TOKENS) -> None:
        super().__init__(cfg, weights, max_tokens)
        self.num_labels = num_labels
        dense, out = head_names(cfg)
        self.pool_w, self.pool_b = weights[dense + ".weight"], weights[dense + ".bias"]
        self.cls_w, self.cls_b = weights[out + ".weight"], weights[out + ".bias"]

    @classmethod
    def load(cls, artifact_path: pathlib.Path, config: dict[str, Any],
             max_tokens: int = DEFAULT_MAX_TOKENS) -> BertCrossEncoder:
        cfg = BertConfig.from_dict(config)
        n = num_labels(config)
        shapes = cfg.shapes() | head_shapes(cfg, n)
        return cls(cfg, load_weights(artifact_path, shapes), n, max_tokens=min(max_tokens, cfg.max_tokens))

    def _width(self) -> int:
        return self.num_labels

    def _head(self, h: Tensor, mask: Tensor) -> Tensor:
        return h[:, 0].linear(self.pool_w.T, self.pool_b).tanh().linear(self.cls_w.T, self.cls_b)

    def logits(
        self, pairs: list[np.ndarray], token_type_ids: list[np.ndarray] | None, progress: Progress = None
    ) -> np.ndarray:
        """Raw classifier logits, shape (n, num_labels)."""
        return self._run(pairs, token_type_ids, self._width(), progress)

    def score(
        self, pairs: list[np.ndarray], token_type_ids: list[np.ndarray] | None, progress: Progress = None
    ) -> np.ndarray:
        """One float32 relevance per pair: the single logit of a num_labels == 1 reranker.

        Several labels have no agreed relevance score (sentence-transformers returns them all), so that is refused
        rather than guessed; ``logits`` serves those models.
        """
        if self.num_labels != 1:
            raise ValueError(f"score() needs a single-logit reranker, this model has num_labels={self.num_labels}")
        return np.ascontiguousarray(self.logits(pairs, token_type_ids, progress)[:, 0])


def num_labels(config: dict[str, Any]) -> int:
    """A BertForSequenceClassification config's label count (checked), as HF derives it."""
    # HF derives num_labels from id2label when num_labels itself is absent.
    n = config.get("num_labels", len(config.get("id2label") or {}) or 2)
    if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
        raise ValueError(f"cross-encoder config: num_labels must be a positive int, got {n!r}")
    if (pt := config.get("problem_type")) not in (
        None,
        "regression",
        "single_label_classification",
        "multi_label_classification",
    ):
        raise ValueError(f"cross-encoder config: unsupported problem_type {pt!r}")
    return n


def head_names(cfg: BertConfig) -> tuple[str, str]:
    """The classification head's two layers: BERT's pooler and classifier; XLM-RoBERTa's classifier.dense and
    classifier.out_proj (the same tanh between them, on the first token)."""
    return ("classifier.dense", "classifier.out_proj") if cfg.roberta else ("pooler.dense", "classifier")


def head_shapes(cfg: BertConfig, n: int) -> dict[str, tuple[int, ...]]:
    h = cfg.hidden_size
    dense, out = head_names(cfg)
    return {dense + ".weight": (h, h), dense + ".bias": (h,), out + ".weight": (n, h), out + ".bias": (n,)}
