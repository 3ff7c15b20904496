"""Chat tokenizer of a GGUF decoder, built from its metadata alone: the vocabulary (byte-level BPE or SentencePiece),
its special tokens and its chat template (docs/models.md, "Tokenizers").

Daemon side: no tinygrad import. The `tokenizers.Tokenizer` built here tokenizes as llama.cpp does, which is what
the model's own tokenizer does where a generic GGUF conversion (transformers') differs:
- byte-level BPE splits text with its pre-tokenizer type's regex (tokenizer.ggml.pre), and for "smollm" splits
  digits one by one *before* the byte-level regex, which changes how whitespace runs in front of digits group;
- SentencePiece prepends its space to every stretch of text, also one that already starts with a space, and to
  each stretch after a special token, as llama.cpp's SentencePiece tokenizer (and Llama 2's own tokenizer.json)
  does. Pieces merge in score order, and a character outside the vocabulary falls back to its bytes' tokens.
Control, unknown and user-defined tokens are matched whole in the text (llama.cpp's parse_special).
"""

from __future__ import annotations

import pathlib
from collections.abc import Iterable, Mapping
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from trio_gpuworker._errors import InvalidRequest
from trio_gpuworker.chat_template import ChatTemplate
from trio_gpuworker.gguf_file import end_of_generation_ids, read_metadata

# llama.cpp's token types
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED = 1, 2, 3, 4
_SPACE = "\u2581"  # SentencePiece's space

# Pre-tokenizer regexes of the models' own tokenizer.json files.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre -> (digits split one by one first, the split regex: None for GPT-2's, byte-level's own)
PRE_TOKENIZERS: dict[str, tuple[bool, str | None]] = {
    "default": (False, None), "gpt-2": (False, None), "smollm": (True, None),
    "llama-bpe": (False, _LLAMA3_SPLIT), "qwen2": (False, _QWEN2_SPLIT), "deepseek-r1-qwen": (False, _QWEN2_SPLIT),
}
# tokenizer.ggml.model -> what it is, for the README's table and the refusal message
TOKENIZER_MODELS = {"gpt2": "byte-level BPE", "llama": "SentencePiece"}
_NAMED_SPECIALS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "unk_token": "unknown_token_id",
                   "pad_token": "padding_token_id"}


def _byte_level(meta: Mapping[str, Any], tokens: list[str]) -> Tokenizer:
    pre = str(meta.get("tokenizer.ggml.pre", "default"))
    if pre not in PRE_TOKENIZERS:
        raise ValueError(f"unsupported pre-tokenizer {pre!r} (served: {', '.join(PRE_TOKENIZERS)})")
    digits, split = PRE_TOKENIZERS[pre]
    # Byte-level tokens never hold a raw space, so each merge splits into exactly two parts.
    merges = [tuple(m.split(" ")) for m in meta.get("tokenizer.ggml.merges") or []]
    tk = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False,
                              byte_fallback=False))
    steps = [pre_tokenizers.Digits(individual_digits=True)] if digits else []
    if split is not None:
        steps.append(pre_tokenizers.Split(Regex(split), behavior="isolated"))
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=split is None))
    tk.pre_tokenizer = steps[0] if len(steps) == 1 else pre_tokenizers.Sequence(steps)
    tk.decoder = decoders.ByteLevel()
    return tk


def _score_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """SentencePiece BPE merges the adjacent pair whose joined piece scores highest: every split of a normal piece
    into two normal pieces, best-scoring piece first (ties by id, then the shorter left part)."""
    normal = {t: i for i, (t, ty) in enumerate(zip(tokens, types, strict=True)) if ty == _NORMAL}
    ranked = []
    for t, i in normal.items():
        for k in range(1, len(t)):
            if t[:k] in normal and t[k:] in normal:
                ranked.append((-scores[i], i, k, t[:k], t[k:]))
    return [(a, b) for *_, a, b in sorted(ranked)]


def _sentencepiece(meta: Mapping[str, Any], tokens: list[str], types: list[int]) -> Tokenizer:
    scores = list(meta.get("tokenizer.ggml.scores") or [])
    if len(scores) != len(tokens):
        raise ValueError("a SentencePiece vocabulary needs a score per token (tokenizer.ggml.scores)")
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    tk = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=_score_merges(tokens, scores, types),
                              unk_token=tokens[unk] if isinstance(unk, int) else None, fuse_unk=True,
                              byte_fallback=True))
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    space = normalizers.Replace(" ", _SPACE)
    tk.normalizer = normalizers.Sequence([normalizers.Prepend(_SPACE), space]) if prefix else space
    steps = [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    tk.decoder = decoders.Sequence([*steps, decoders.Strip(" ", 1, 0)] if prefix else steps)
    return tk


def _add_specials(tk: Tokenizer, tokens: list[str], types: list[int]) -> None:
    """Control and unknown tokens as special tokens, user-defined ones as added tokens: each matched whole."""
    typed = list(zip(tokens, types, strict=True))
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, ty in typed
                           if ty in (_CONTROL, _UNKNOWN)])
    tk.add_tokens([AddedToken(t, special=False, normalized=False) for t, ty in typed if ty == _USER_DEFINED])
    if tk.get_vocab_size(with_added_tokens=True) != len(tokens):
        raise ValueError("special tokens do not map onto the GGUF vocabulary")


def build_tokenizer(meta: Mapping[str, Any]) -> Tokenizer:
    """The GGUF's tokenizer (tokenizer.ggml.*) as a `tokenizers.Tokenizer`; ValueError naming what it does not
    build."""
    model = meta.get("tokenizer.ggml.model")
    if model not in TOKENIZER_MODELS:
        served = ", ".join(f"{k} ({v})" for k, v in TOKENIZER_MODELS.items())
        raise ValueError(f"unsupported tokenizer model {model!r} (served: {served})")
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    types: list[int] = list(meta.get("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens))
    tk = _byte_level(meta, tokens) if model == "gpt2" else _sentencepiece(meta, tokens, types)
    _add_specials(tk, tokens, types)
    return tk


class ChatTokenizer:
    def __init__(self, tokenizer: Tokenizer, *, eos_ids: set[int], bos_id: int | None, add_bos: bool,
                 template: ChatTemplate | None, context_length: int | None = None, eos_id: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.eos_id = eos_id  # the GGUF's eos_token_id (end of generation may have more ids: eos_ids)
        self.context_length = context_length  # the GGUF's {arch}.context_length, where it has one
        self.eos_ids = eos_ids
        self.bos_id = bos_id
        self.add_bos = add_bos
        self.template = template

    @classmethod
    def from_gguf(cls, path: str | pathlib.Path) -> ChatTokenizer:
        return cls.from_metadata(read_metadata(path))

    @classmethod
    def from_metadata(cls, meta: Mapping[str, Any]) -> ChatTokenizer:
        tokens = meta["tokenizer.ggml.tokens"]
        specials = {name: tokens[i] for name, key in _NAMED_SPECIALS.items()
                    if isinstance(i := meta.get(f"tokenizer.ggml.{key}"), int) and 0 <= i < len(tokens)}
        source = meta.get("tokenizer.chat_template")
        bos = meta.get("tokenizer.ggml.bos_token_id")
        # llama.cpp adds BOS to a SentencePiece vocabulary whose file does not say otherwise
        add_bos = meta.get("tokenizer.ggml.add_bos_token", meta.get("tokenizer.ggml.model") == "llama")
        context = meta.get(f"{meta.get('general.architecture')}.context_length")
        return cls(build_tokenizer(meta), eos_ids=end_of_generation_ids(dict(meta)),
                   bos_id=int(bos) if isinstance(bos, int) else None, add_bos=bool(add_bos),
                   template=ChatTemplate(str(source), specials) if source else None,
                   context_length=int(context) if isinstance(context, int) else None,
                   eos_id=eos if isinstance(eos := meta.get("tokenizer.ggml.eos_token_id"), int) else None)

    def encode(self, text: str, add_special: bool = False) -> list[int]:
        ids: list[int] = self.tokenizer.encode(text, add_special_tokens=False).ids
        if add_special and self.add_bos and self.bos_id is not None:
            ids.insert(0, self.bos_id)
        return ids

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special)

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None) -> str:
        """The GGUF's chat template rendered over `messages` (and `tools`, for a template that uses them:
        chat_template.py). InvalidRequest when the GGUF has none or the template refuses the messages."""
        if self.template is None:
            raise InvalidRequest("the model's GGUF has no chat template (tokenizer.chat_template): send a prompt")
        return self.template.render(messages, add_generation_prompt, tools)
