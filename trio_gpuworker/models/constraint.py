"""A GENERATE's grammar in the worker: llguidance's matcher over the model's vocabulary, masking each step's logits
(docs/architecture.md, 'Structured output').

`Grammars` belongs to one loaded decoder: it builds llguidance's tokenizer from the decoder's own (its tokens'
bytes, its end-of-generation ids) once, on the first grammar, and compiles each distinct grammar once (kept, most
recently used first); a request gets its own copy of the compiled matcher. `Constraint` is that copy as the
decode loop uses it: `allows(token)` checks (and takes) one token without computing a mask, so constrained greedy
decoding keeps the kernel's argmax whenever the grammar allows it; `masked(logits)` is the logits with every
token the grammar forbids at -inf, for a sampled pick or a greedy argmax the grammar refused.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import llguidance
import numpy as np
from llguidance.gbnf_to_lark import any_to_lark

COMPILED = 64  # distinct grammars a decoder keeps compiled


class Constraint:
    """One request's grammar state."""

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        self._m = matcher
        self._v = vocab_size
        self._bits = np.full((1, (vocab_size + 31) // 32), -1, dtype=np.int32)

    def _check(self) -> None:
        if self._m.is_error():
            raise ValueError(f"the grammar cannot go on: {self._m.get_error()}")

    def allows(self, token: int) -> bool:
        """Whether the grammar allows `token` next; if it does, it is taken."""
        return bool(self._m.try_consume_tokens([token]) == 1)

    def allowed(self) -> np.ndarray:
        """The tokens the grammar allows next, as booleans (vocab_size,)."""
        self._m.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        self._check()
        return np.unpackbits(self._bits.view(np.uint8), bitorder="little")[: self._v].astype(bool)

    def masked(self, logits: np.ndarray) -> np.ndarray:
        """A copy of float32 `logits` with the tokens the grammar forbids at -inf. ValueError if it allows none."""
        ok = self.allowed()
        if not ok.any():
            raise ValueError("the grammar allows no token of this vocabulary here")
        return np.where(ok, logits, np.float32(-np.inf))

    def take(self, token: int) -> None:
        """`token`, picked from `masked()` logits, is the next one."""
        self._m.consume_token(token)
        self._check()

    @property
    def done(self) -> bool:
        """The grammar is complete and allows nothing more (end-of-generation has been taken, or is all it
        allows): generation stops here."""
        return bool(self._m.is_stopped())


class Grammars:
    """The compiled grammars of one decoder's vocabulary."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_ids: set[int]) -> None:
        self._tokenizer_json = tokenizer.to_str()  # a `tokenizers.Tokenizer`: the decoder's own vocabulary
        self.vocab_size = vocab_size
        self._eos = sorted(eos_ids)
        self._ll: Any = None
        self._compiled: OrderedDict[str, Any] = OrderedDict()

    def constraint(self, grammar: str) -> Constraint:
        """A fresh Constraint of `grammar` (Lark, or GBNF). ValueError if llguidance cannot compile it."""
        matcher = self._compiled.get(grammar)
        if matcher is None:
            if self._ll is None:
                self._ll = llguidance.LLTokenizer(self._tokenizer_json, n_vocab=self.vocab_size,
                                                  eos_token=self._eos or None)
            try:
                lark = any_to_lark(grammar)
            except Exception as exc:  # its parser's own errors: the grammar's
                raise ValueError(f"not a grammar llguidance reads: {exc}") from None
            matcher = llguidance.LLMatcher(self._ll, llguidance.LLMatcher.grammar_from_lark(lark), log_level=0)
            if matcher.is_error():
                raise ValueError(f"the grammar does not compile: {matcher.get_error()}")
            self._compiled[grammar] = matcher
            while len(self._compiled) > COMPILED:
                self._compiled.popitem(last=False)
        self._compiled.move_to_end(grammar)
        return Constraint(matcher.deep_copy(), self.vocab_size)


__all__ = ["COMPILED", "Constraint", "Grammars"]
