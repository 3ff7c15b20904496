"""Each model's tokenizer, loaded once and run off the event loop: an encoder's tokenizer.json
(`EmbeddingTokenizer`) and a generate model's GGUF vocabulary with its chat template (`ChatTokenizer`).

Tokenization never runs on the loop, however small: `tokenizers` shares one rayon pool, so even a 3-word
encode_batch on the loop waits there for a large one that a thread is running. Reading a tokenizer's file stalls
the loop too: the first use loads it in a thread.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import trio

from .._errors import ModelNotFound

if TYPE_CHECKING:
    from .._config import ModelConfig
    from ..llm_tokenizer import ChatTokenizer
    from ..tokenization import EmbeddingTokenizer

T = TypeVar("T")
# Tokenization and template threads at once, whatever the number of requests: half the CPUs, so the event
# loop always has a core (tokenizers' encode_batch fans out on its own pool besides).
CPU_THREADS = max(1, min(4, (os.cpu_count() or 2) // 2))


class Tokenizers:
    """The tokenizers of the models `model_config` names (the Supervisor's configuration, as a reload leaves it)."""

    def __init__(self, model_config: Callable[[str], ModelConfig]) -> None:
        self._config = model_config
        self._cache: dict[str, Any] = {}
        self.cpu = trio.CapacityLimiter(CPU_THREADS)

    async def off_loop(self, fn: Callable[[], T]) -> T:
        """`fn()` in one of the CPU_THREADS."""
        return await trio.to_thread.run_sync(fn, limiter=self.cpu)

    def encoder(self, model: str) -> EmbeddingTokenizer:
        """An encoder model's tokenizer (ModelNotFound for a generate model), loaded on this thread the first time."""
        tok = self._cache.get(model)
        if tok is None:
            from ..tokenization import EmbeddingTokenizer

            mc = self._config(model)
            if not mc.encoder:
                raise ModelNotFound(f"{model!r} is not an encoder model")
            path = mc.tokenizer_path or mc.path.with_name("tokenizer.json")
            tok = self._cache[model] = EmbeddingTokenizer.from_file(path, mc.max_tokens)
        return tok  # type: ignore[no-any-return]

    async def encoder_loaded(self, model: str) -> EmbeddingTokenizer:
        """`encoder`, its first load in a thread."""
        if model not in self._cache:
            await trio.to_thread.run_sync(self.encoder, model, limiter=self.cpu)
        return self.encoder(model)

    def chat(self, model: str) -> ChatTokenizer:
        """A generate model's tokenizer and chat template, from its GGUF, loaded on this thread the first time."""
        tok = self._cache.get(model)
        if tok is None:
            from ..llm_tokenizer import ChatTokenizer

            tok = self._cache[model] = ChatTokenizer.from_gguf(self._config(model).path)
        return tok  # type: ignore[no-any-return]

    async def chat_loaded(self, model: str) -> ChatTokenizer:
        """`chat`, in a thread."""
        return await trio.to_thread.run_sync(self.chat, model, limiter=self.cpu)

    def forget(self, model: str) -> None:
        """Drop a model's tokenizer (its settings changed); the next use loads it again."""
        self._cache.pop(model, None)
