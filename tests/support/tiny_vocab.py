"""Tiny tokenizer vocabularies in GGUF metadata, trained by the tokenizers' own libraries on a small corpus.

SentencePiece: a BPE model trained by `sentencepiece` (byte fallback, identity normalisation, digits split, as
Llama 2's), written out as llama.cpp's converter writes one (pieces, scores, token types). Byte-level BPE: merges
trained by `tokenizers` over a pre-tokenizer type's split, written as a GPT-2 style vocabulary with ChatML control
tokens and one user-defined token. Each GGUF holds metadata only: a tokenizer reads nothing else.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

# llama.cpp's token types
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

_WORDS = ("the quick brown fox jumps over lazy dog hello world serve model worker daemon token tokens tokenizer "
          "prompt reply stream batch cache naïve café résumé über straße 日本語 東京 Привет мир العربية "
          "I'm you're it's they'd've don't can't 😀 🚀 déjà vu").split()
_PUNCT = (".", ",", "!", "?", ";", ":", " —", "...", "\n", "\n\n", "  ", "\t", " (", ")", '"', "'")

# Chat templates in transformers' dialect: ChatML with a default system turn (SmolLM2's and Qwen2's shape), and
# Llama 2's, which checks that roles alternate and writes BOS and EOS itself.
CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
LLAMA2 = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
    "{% set system_message = false %}{% endif %}{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}"
)


def corpus(n: int = 600, seed: int = 0) -> list[str]:
    """`n` lines of words, numbers and punctuation drawn at random."""
    rng = np.random.default_rng(seed)
    lines = []
    for _ in range(n):
        parts = []
        for _ in range(int(rng.integers(3, 14))):
            r = rng.random()
            parts.append(str(rng.integers(0, 10 ** int(rng.integers(1, 6)))) if r < 0.12 else str(rng.choice(_WORDS)))
            parts.append(str(rng.choice(_PUNCT)) if rng.random() < 0.3 else " ")
        lines.append("".join(parts).strip())
    return lines


@dataclass(frozen=True)
class Vocab:
    """A tokenizer as GGUF metadata (tokenizer.ggml.*, tokenizer.chat_template)."""

    model: str  # "llama" (SentencePiece) or "gpt2" (byte-level BPE)
    tokens: list[str]
    types: list[int]
    bos: int | None
    eos: int
    template: str
    scores: list[float] | None = None
    merges: list[str] | None = None
    pre: str | None = None
    unk: int | None = None
    add_bos: bool | None = None

    def write(self, w: gguf.GGUFWriter) -> None:
        w.add_tokenizer_model(self.model)
        if self.pre is not None:
            w.add_tokenizer_pre(self.pre)
        w.add_token_list(self.tokens)
        w.add_token_types(self.types)
        if self.scores is not None:
            w.add_token_scores(self.scores)
        if self.merges is not None:
            w.add_token_merges(self.merges)
        if self.bos is not None:
            w.add_bos_token_id(self.bos)
        if self.unk is not None:
            w.add_unk_token_id(self.unk)
        if self.add_bos is not None:
            w.add_add_bos_token(self.add_bos)
        w.add_eos_token_id(self.eos)
        w.add_chat_template(self.template)

    def write_gguf(self, path: Path, arch: str = "llama") -> Path:
        """A GGUF at `path` holding this vocabulary and no tensors."""
        w = gguf.GGUFWriter(str(path), arch)
        self.write(w)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        return path


def sentencepiece_model(vocab_size: int = 700) -> bytes:
    """A serialised SentencePiece BPE model trained on `corpus()` (Llama 2's settings), with `<|user|>` as a
    user-defined symbol."""
    import sentencepiece as spm

    out = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus()), model_writer=out, vocab_size=vocab_size, model_type="bpe",
        byte_fallback=True, normalization_rule_name="identity", remove_extra_whitespaces=False, split_digits=True,
        add_dummy_prefix=True, user_defined_symbols=["<|user|>"], hard_vocab_limit=False, minloglevel=2,
        character_coverage=1.0, num_threads=1)
    return out.getvalue()


def sentencepiece_vocab(model: bytes, template: str = LLAMA2) -> Vocab:
    """The model's pieces as llama.cpp's converter writes them: score and type per piece."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_proto=model)
    types = []
    for i in range(sp.vocab_size()):
        kinds = ((sp.is_unknown, UNKNOWN), (sp.is_control, CONTROL), (sp.is_unused, UNUSED), (sp.is_byte, BYTE))
        types.append(next((t for f, t in kinds if f(i)), NORMAL))
    tokens = [sp.id_to_piece(i) for i in range(sp.vocab_size())]
    types[tokens.index("<|user|>")] = USER_DEFINED
    return Vocab("llama", tokens, types, bos=sp.bos_id(), eos=sp.eos_id(), unk=sp.unk_id(), template=template,
                 scores=[sp.get_score(i) for i in range(sp.vocab_size())])


BPE_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def byte_level_vocab(pre: str, split: str | None, vocab_size: int = 700, template: str = CHATML) -> Vocab:
    """Byte-level BPE merges trained on `corpus()` over `split` (a pre-tokenizer regex; None: GPT-2's), as GGUF
    pre-tokenizer type `pre`, with ChatML control tokens and `<think>` user-defined."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers

    tk = Tokenizer(models.BPE())
    level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=split is None)
    tk.pre_tokenizer = level if split is None else pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(split), behavior="isolated"), level])
    tk.train_from_iterator(corpus(), trainers.BpeTrainer(
        vocab_size=vocab_size, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    model = json.loads(tk.to_str())["model"]
    tokens = sorted(model["vocab"], key=model["vocab"].get)
    merges = [" ".join(m) if isinstance(m, list) else m for m in model["merges"]]
    tokens += [*BPE_SPECIALS, "<think>"]
    types = [NORMAL] * (len(tokens) - 4) + [CONTROL] * 3 + [USER_DEFINED]
    return Vocab("gpt2", tokens, types, bos=None, eos=tokens.index("<|im_end|>"), template=template,
                 merges=merges, pre=pre)
