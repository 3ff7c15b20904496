"""Chat tokenizer for GGUF byte-level BPE models (SmolLM2), built from the GGUF metadata alone.

Daemon side: no tinygrad import. The `tokenizers.Tokenizer` built here matches the model's original
`tokenizer.json` (and llama.cpp), which a generic GGUF->HF conversion does not always do: for the
"smollm" pre-tokenizer digits are split one by one *before* the byte-level regex, which changes how
whitespace runs in front of digits are grouped.
"""

from __future__ import annotations

import pathlib
import re
from collections.abc import Iterable, Mapping

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from trio_gpuworker.gguf_file import end_of_generation_ids, read_metadata

_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types

# tokenizer.ggml.pre -> whether digits are split individually ahead of the byte-level regex.
_PRE_DIGITS: dict[str, bool] = {"smollm": True, "gpt-2": False, "default": False}

# The SmolLM2 template: ChatML, with a default system turn when the first message is not a system one.
_DEFAULT_SYSTEM = re.compile(
    r"messages\[0\]\['role'\]\s*!=\s*'system'\s*%\}\{\{\s*'<\|im_start\|>system(?:\n|\\n)(.*?)<\|im_end\|>(?:\n|\\n)'",
    re.S,
)


class ChatTokenizer:
    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        eos_ids: set[int],
        bos_id: int | None,
        add_bos: bool,
        default_system: str | None,
    ) -> None:
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.bos_id = bos_id
        self.add_bos = add_bos
        self.default_system = default_system

    @classmethod
    def from_gguf(cls, path: str | pathlib.Path) -> ChatTokenizer:
        return cls.from_metadata(read_metadata(path))

    @classmethod
    def from_metadata(cls, meta: Mapping[str, object]) -> ChatTokenizer:
        if meta.get("tokenizer.ggml.model") != "gpt2":
            raise ValueError(f"unsupported tokenizer model {meta.get('tokenizer.ggml.model')!r} (need byte-level BPE)")
        pre = str(meta.get("tokenizer.ggml.pre", "default"))
        if pre not in _PRE_DIGITS:
            raise ValueError(f"unsupported pre-tokenizer {pre!r}")
        tokens: list[str] = list(meta["tokenizer.ggml.tokens"])  # type: ignore[call-overload]
        types: list[int] = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))  # type: ignore[call-overload]
        # Byte-level tokens never hold a raw space, so each merge splits into exactly two parts.
        merges = [tuple(m.split(" ")) for m in meta["tokenizer.ggml.merges"]]  # type: ignore[attr-defined]
        bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False, byte_fallback=False)
        tk = Tokenizer(bpe)
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tk.pre_tokenizer = (
            pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
            if _PRE_DIGITS[pre]
            else byte_level
        )
        tk.decoder = decoders.ByteLevel()
        # Control / user-defined tokens are matched whole in the text (as llama.cpp does with parse_special).
        typed = list(zip(tokens, types, strict=True))
        tk.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, ty in typed if ty == _CONTROL])
        tk.add_tokens([AddedToken(t, special=False, normalized=False) for t, ty in typed if ty == _USER_DEFINED])
        if tk.get_vocab_size(with_added_tokens=True) != len(tokens):
            raise ValueError("special tokens do not map onto the GGUF vocabulary")

        bos = meta.get("tokenizer.ggml.bos_token_id")

        template = str(meta.get("tokenizer.chat_template", ""))
        if "<|im_start|>" not in template:
            raise ValueError("unsupported chat template (expected ChatML)")
        m = _DEFAULT_SYSTEM.search(template)
        return cls(
            tk,
            eos_ids=end_of_generation_ids(dict(meta)),
            bos_id=int(bos) if isinstance(bos, int) else None,
            add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
            default_system=m.group(1).replace("\\n", "\n") if m else None,
        )

    def encode(self, text: str, add_special: bool = False) -> list[int]:
        ids: list[int] = self.tokenizer.encode(text, add_special_tokens=False).ids
        if add_special and self.add_bos and self.bos_id is not None:
            ids.insert(0, self.bos_id)
        return ids

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special)

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        parts: list[str] = []
        for i, msg in enumerate(messages):
            if i == 0 and self.default_system is not None and messages[0]["role"] != "system":
                parts.append(f"<|im_start|>system\n{self.default_system}<|im_end|>\n")
            parts.append(f"<|im_start|>{msg['role']}\n{msg['content']}<|im_end|>\n")
        if add_generation_prompt:
            parts.append("<|im_start|>assistant\n")
        return "".join(parts)
