"""Daemon-side tokenization for encoder and cross-encoder models (never imports tinygrad).

Matches sentence-transformers / Hugging Face fast tokenizers exactly: the same ``tokenizers`` Rust
pipeline, truncation to ``max_tokens`` including [CLS]/[SEP] (``longest_first`` for pairs), and no
padding, whatever padding/truncation the shipped tokenizer.json configures (all-MiniLM-L6-v2's says
pad and truncate to 128, which sentence-transformers overrides to its max_seq_length of 256).
"""

from __future__ import annotations

import pathlib

import numpy as np
from tokenizers import Tokenizer

from ._kinds import DEFAULT_MAX_TOKENS


class EmbeddingTokenizer:
    def __init__(self, tokenizer: Tokenizer, max_tokens: int = DEFAULT_MAX_TOKENS) -> None:
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 2:
            raise ValueError(f"max_tokens must be an int >= 2 (room for [CLS] and [SEP]), got {max_tokens!r}")
        self.max_tokens = max_tokens
        self._tok = tokenizer
        self._tok.no_padding()
        self._tok.enable_truncation(max_length=max_tokens, strategy="longest_first", stride=0, direction="right")
        # A pair needs room for 3 specials plus at least one token of each side, else tokenizers raises per call.
        self.pair_specials = self._tok.num_special_tokens_to_add(is_pair=True)
        self.single_specials = self._tok.num_special_tokens_to_add(is_pair=False)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        # truncation is a setting of the Tokenizer object, shared across threads: /tokenize's untruncated
        # encodings use a copy of its own, made on first use
        self._untruncated: Tokenizer | None = None

    @property
    def tokenizer(self) -> Tokenizer:
        """The underlying ``tokenizers.Tokenizer`` (truncation at ``max_tokens``, no padding)."""
        return self._tok

    @classmethod
    def from_file(cls, tokenizer_json: pathlib.Path, max_tokens: int = DEFAULT_MAX_TOKENS) -> EmbeddingTokenizer:
        path = pathlib.Path(tokenizer_json)
        try:
            tok = Tokenizer.from_file(str(path))
        except Exception as e:
            raise ValueError(f"cannot load tokenizer {str(path)!r}: {e}") from e
        return cls(tok, max_tokens)

    @staticmethod
    def _strs(texts: list[str], what: str) -> list[str]:
        if isinstance(texts, str):
            raise TypeError(f"{what} must be a list of str, not a single str")
        texts = list(texts)
        if bad := [i for i, t in enumerate(texts) if not isinstance(t, str)]:
            raise TypeError(f"{what}[{bad[0]}] is {type(texts[bad[0]]).__name__}, expected str")
        return texts

    def encode(self, texts: list[str]) -> list[np.ndarray]:
        """Token ids per text, [CLS] ... [SEP], at most ``max_tokens`` long, as int32 arrays."""
        texts = self._strs(texts, "texts")
        if not texts:
            return []
        return [np.asarray(e.ids, dtype=np.int32) for e in self._tok.encode_batch(texts, add_special_tokens=True)]

    def encode_checked(self, texts: list[str], *, special: bool = True) -> tuple[list[np.ndarray], list[int]]:
        """`encode` (or `encode_plain` without specials), and the indices of the texts that truncation cut."""
        texts = self._strs(texts, "texts")
        if not texts:
            return [], []
        enc = self._tok.encode_batch(texts, add_special_tokens=special)
        return [np.asarray(e.ids, dtype=np.int32) for e in enc], [i for i, e in enumerate(enc) if e.overflowing]

    def encode_full(self, texts: list[str], *, special: bool = True) -> list[np.ndarray]:
        """Token ids without truncation (what /tokenize reports)."""
        texts = self._strs(texts, "texts")
        if self._untruncated is None:
            tok = Tokenizer.from_str(self._tok.to_str())
            tok.no_truncation()
            self._untruncated = tok
        if not texts:
            return []
        enc = self._untruncated.encode_batch(texts, add_special_tokens=special)
        return [np.asarray(e.ids, dtype=np.int32) for e in enc]

    def decode(self, ids: list[int]) -> str:
        """The text of `ids`, special tokens included (as /detokenize returns it)."""
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def encode_plain(self, texts: list[str]) -> list[np.ndarray]:
        """Token ids without [CLS]/[SEP], at most ``max_tokens`` each: what RERANK sends, since the worker
        composes (and truncates) the query/document pairs itself."""
        texts = self._strs(texts, "texts")
        if not texts:
            return []
        return [np.asarray(e.ids, dtype=np.int32) for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def encode_pair(self, query: str, docs: list[str]) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """([CLS] query [SEP] doc [SEP] ids, token_type_ids) per doc, truncated longest_first like HF."""
        if not isinstance(query, str):
            raise TypeError(f"query is {type(query).__name__}, expected str")
        docs = self._strs(docs, "docs")
        if self.max_tokens < self.pair_specials + 2:
            raise ValueError(f"max_tokens {self.max_tokens} is too small for a pair")
        if not docs:
            return [], []
        enc = self._tok.encode_batch([(query, d) for d in docs], add_special_tokens=True)
        return [np.asarray(e.ids, dtype=np.int32) for e in enc], [np.asarray(e.type_ids, dtype=np.int32) for e in enc]
