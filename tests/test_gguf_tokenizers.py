"""Tokenizers and chat templates built from a GGUF's own metadata (ChatTokenizer) against independent references.

SentencePiece: the `sentencepiece` library running the very model the GGUF's vocabulary was written from, applied to
each stretch of text between special tokens (llama.cpp's SentencePiece tokenizer: each stretch gets its own space
prefix), and transformers' GGUF tokenizer wherever no stretch starts with whitespace (there transformers' Metaspace
omits the prefix, which sentencepiece and llama.cpp add). Byte-level BPE, for each pre-tokenizer type: transformers'
GGUF tokenizer, on whole texts. Chat templates: transformers' apply_chat_template on the same file.
"""

from __future__ import annotations

import pickle
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

transformers = pytest.importorskip("transformers")
spm = pytest.importorskip("sentencepiece")
jinja2 = pytest.importorskip("jinja2")
pytest.importorskip("gguf")

from tests.support.tiny_vocab import (  # noqa: E402
    CHATML,
    LLAMA2,
    Vocab,
    byte_level_vocab,
    corpus,
    sentencepiece_model,
    sentencepiece_vocab,
)
from trio_gpuworker import InvalidRequest  # noqa: E402
from trio_gpuworker.chat_template import ChatTemplate  # noqa: E402
from trio_gpuworker.gguf_file import read_metadata  # noqa: E402
from trio_gpuworker.llm_tokenizer import PRE_TOKENIZERS, ChatTokenizer  # noqa: E402

TEXTS = [
    "Hello world!",
    "The quick brown fox jumps over the lazy dog.",
    "naïve café — 日本語 😀 Привет, мир! العربية",
    "☃ Ω ﷺ ⅻ: characters the corpus never had",
    "I'm sure you're right; it's what they'd've said. DON'T",
    "def f(x):\n    return x ** 2  # square\n\n\n\tindented\r\n",
    "many     spaces\t\t\ttabs\n\n\n\nnewlines",
    "price: $1,234.56 on 2024-01-31, 3.14159e-10, x=42",
    "a  123 b\t45\n6 7 12345678",
    "   leading and trailing   \n\n  ",
    " ",
    "",
    "worker<think>tokens</think> and <|user|>prompt",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<s>[INST] hello [/INST] reply </s><s>[INST] again",
    "<|im_start and <s are not special; <|endoftext|> is",
]

CONVERSATIONS: list[list[dict[str, str]]] = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi  2 you"}],
    [{"role": "user", "content": "first"}, {"role": "assistant", "content": " reply "},
     {"role": "user", "content": "second\n\nwith 3 lines — naïve"}],
]

# A template with what transformers gives templates beyond plain Jinja: loop controls, namespaces, tojson (non-ASCII
# and HTML characters kept), the generation block, tools and documents (None), and the GGUF's special tokens.
FEATURES = (
    "{% set ns = namespace(n=0) %}{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}"
    "{% set ns.n = ns.n + 1 %}{% generation %}{{ m | tojson }}{% endgeneration %}\n{% endfor %}"
    "{{ ns.n }} {{ tools is none }} {{ documents is none }} [{{ bos_token }}|{{ eos_token }}|{{ unk_token }}]"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

BPE_PRE = ("qwen2", "llama-bpe", "gpt-2")  # pre-tokenizer types transformers splits as llama.cpp does


def _fragments(text: str, specials: list[str]) -> list[str]:
    """`text` cut around each whole special token (longest first), empty stretches dropped."""
    pattern = "(" + "|".join(map(re.escape, sorted(specials, key=len, reverse=True))) + ")"
    return [p for p in re.split(pattern, text) if p]


def _per_fragment(encode: Callable[[str], list[int]], vocab: Vocab, text: str) -> list[int]:
    """Special tokens by id, every other stretch through `encode` on its own."""
    specials = {t: i for i, (t, ty) in enumerate(zip(vocab.tokens, vocab.types, strict=True)) if ty in (2, 3, 4)}
    out: list[int] = []
    for part in _fragments(text, list(specials)):
        out += [specials[part]] if part in specials else encode(part)
    return out


def _reference(d: Path, vocab: Vocab, arch: str = "llama") -> tuple[Path, ChatTokenizer, Any]:
    path = vocab.write_gguf(d / "v.gguf", arch)
    return path, ChatTokenizer.from_gguf(path), transformers.AutoTokenizer.from_pretrained(str(d), gguf_file=path.name)


@pytest.fixture(scope="module")
def sp_model() -> bytes:
    return sentencepiece_model()


@pytest.fixture(scope="module")
def sp_vocab(sp_model: bytes) -> Vocab:
    return sentencepiece_vocab(sp_model)


@pytest.fixture(scope="module")
def spm_tok(tmp_path_factory: pytest.TempPathFactory, sp_vocab: Vocab) -> tuple[Path, ChatTokenizer, Any]:
    return _reference(tmp_path_factory.mktemp("spm"), sp_vocab)


Bpe = tuple[Vocab, ChatTokenizer, Any, Path]


@pytest.fixture(scope="module", params=list(BPE_PRE))
def bpe(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Bpe:
    pre = request.param
    vocab = byte_level_vocab(pre, PRE_TOKENIZERS[pre][1])
    path, tok, ref = _reference(tmp_path_factory.mktemp(pre), vocab, "qwen2")
    return vocab, tok, ref, path


# --- SentencePiece ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text", TEXTS + corpus(40, seed=7))
def test_sentencepiece_matches_sentencepiece(spm_tok: tuple[Path, ChatTokenizer, Any], sp_model: bytes,
                                             sp_vocab: Vocab, text: str) -> None:
    sp = spm.SentencePieceProcessor(model_proto=sp_model)
    ids = spm_tok[1].encode(text)
    assert ids == _per_fragment(sp.encode, sp_vocab, text)
    if not _fragments(text, ["<s>", "</s>", "<unk>", "<|user|>"])[1:]:  # one stretch: sentencepiece's own decode
        assert spm_tok[1].decode(ids) == sp.decode(ids)


def test_sentencepiece_matches_transformers(spm_tok: tuple[Path, ChatTokenizer, Any], sp_vocab: Vocab) -> None:
    _, tok, ref = spm_tok
    texts = [t for t in TEXTS + corpus(40, seed=7)
             if not any(p[0].isspace() for p in _fragments(t, ["<s>", "</s>", "<unk>", "<|user|>"]))]
    assert len(texts) >= 40
    for text in texts:
        ids = tok.encode(text)
        assert ids == _per_fragment(lambda p: ref.encode(p, add_special_tokens=False), sp_vocab, text), text
        assert tok.decode(ids) == ref.decode(ids)
        assert tok.decode(ids, skip_special=True) == ref.decode(ids, skip_special_tokens=True)


def test_sentencepiece_bytes_fall_back_and_bos_is_added(spm_tok: tuple[Path, ChatTokenizer, Any]) -> None:
    _, tok, ref = spm_tok
    ids = tok.encode("☃")  # not in the corpus: its three UTF-8 bytes' tokens
    assert [tok.tokenizer.id_to_token(i) for i in ids[-3:]] == ["<0xE2>", "<0x98>", "<0x83>"]
    assert tok.add_bos and tok.encode("hi", add_special=True) == ref.encode("hi") == [tok.bos_id, *tok.encode("hi")]
    assert tok.eos_ids == {ref.eos_token_id}


# --- byte-level BPE ----------------------------------------------------------------------------------------------


def test_byte_level_matches_transformers(bpe: Bpe) -> None:
    _, tok, ref, _ = bpe
    for text in TEXTS + corpus(40, seed=7):
        ids = tok.encode(text)
        assert ids == ref.encode(text, add_special_tokens=False), text
        assert tok.decode(ids) == text == ref.decode(ids)
        assert tok.decode(ids, skip_special=True) == ref.decode(ids, skip_special_tokens=True)


def test_byte_level_specials(bpe: Bpe) -> None:
    vocab, tok, ref, _ = bpe
    ids = tok.encode("a<|im_start|>b<think>c")
    assert vocab.tokens.index("<|im_start|>") in ids and vocab.tokens.index("<think>") in ids
    assert not tok.add_bos and tok.encode("hi", add_special=True) == tok.encode("hi") == ref.encode("hi")
    assert tok.eos_ids == {vocab.tokens.index("<|im_end|>"), vocab.tokens.index("<|endoftext|>")}


def test_end_of_turn_and_message_tokens_end_generation(bpe: Bpe) -> None:
    """llama.cpp's end-of-generation set: EOS, the declared EOT and EOM, and the control tokens that end a turn."""
    vocab, *_, path = bpe
    meta = read_metadata(path)
    meta["tokenizer.ggml.eot_token_id"], meta["tokenizer.ggml.eom_token_id"] = 5, 6
    ends = {vocab.tokens.index("<|im_end|>"), vocab.tokens.index("<|endoftext|>"), 5, 6}
    assert ChatTokenizer.from_metadata(meta).eos_ids == ends


# --- chat templates ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("gen", [True, False], ids=["gen", "nogen"])
@pytest.mark.parametrize("messages", CONVERSATIONS, ids=["user", "system", "turns"])
def test_chat_templates_render_as_transformers_does(spm_tok: tuple[Path, ChatTokenizer, Any],
                                                    bpe: Bpe,
                                                    messages: list[dict[str, str]], gen: bool) -> None:
    for tok, ref, vocab in ((spm_tok[1], spm_tok[2], None), (bpe[1], bpe[2], bpe[0])):
        want = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
        assert tok.apply_chat_template(messages, add_generation_prompt=gen) == want
        if vocab is not None:  # tokenized as transformers tokenizes it
            assert tok.encode(want) == ref.apply_chat_template(messages, add_generation_prompt=gen,
                                                               return_dict=False)
    assert spm_tok[1].template is not None and spm_tok[1].template.source == LLAMA2
    assert bpe[1].template is not None and bpe[1].template.source == CHATML


def test_template_helpers_render_as_transformers_does(spm_tok: tuple[Path, ChatTokenizer, Any]) -> None:
    path, _, ref = spm_tok
    messages = [{"role": "user", "content": 'naïve <b>&"x"'}] * 3
    tok = ChatTokenizer.from_gguf(path)
    assert tok.template is not None
    tok.template = ChatTemplate(FEATURES, tok.template.specials)
    for gen in (True, False):
        want = ref.apply_chat_template(messages, chat_template=FEATURES, tokenize=False, add_generation_prompt=gen)
        assert tok.apply_chat_template(messages, add_generation_prompt=gen) == want
    assert "[<s>|</s>|<unk>]" in want


def test_template_refusals_are_invalid_requests(tmp_path: Path, spm_tok: tuple[Path, ChatTokenizer, Any]) -> None:
    path, tok, ref = spm_tok
    twice = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(jinja2.TemplateError, match="roles must alternate"):
        ref.apply_chat_template(twice, tokenize=False)
    with pytest.raises(InvalidRequest, match="roles must alternate"):
        tok.apply_chat_template(twice)
    escape = ChatTokenizer.from_gguf(path)
    escape.template = ChatTemplate("{{ ''.__class__.__mro__ }}", {})
    with pytest.raises(jinja2.exceptions.SecurityError):
        ref.apply_chat_template(twice, chat_template=escape.template.source, tokenize=False)
    with pytest.raises(InvalidRequest, match="unsafe"):
        escape.apply_chat_template(twice)
    bare = Vocab("gpt2", ["a", "b"], [1, 1], bos=None, eos=1, template="", merges=[], pre="gpt-2")
    with pytest.raises(InvalidRequest, match="no chat template"):
        ChatTokenizer.from_gguf(bare.write_gguf(tmp_path / "bare.gguf")).apply_chat_template(twice)


def test_pickled_tokenizer_renders_the_same(spm_tok: tuple[Path, ChatTokenizer, Any]) -> None:
    """The worker's JIT cache stores its detokenizer with the model."""
    _, tok, ref = spm_tok
    back = pickle.loads(pickle.dumps(tok))
    messages = CONVERSATIONS[2]
    assert back.apply_chat_template(messages) == ref.apply_chat_template(messages, tokenize=False,
                                                                         add_generation_prompt=True)
    assert back.encode(TEXTS[2]) == tok.encode(TEXTS[2])


# --- refusals ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("key", "value", "message"), [
    ("tokenizer.ggml.model", "t5", "unsupported tokenizer model 't5'"),
    ("tokenizer.ggml.pre", "falcon", "unsupported pre-tokenizer 'falcon'"),
    ("tokenizer.chat_template", "{% for %}", "chat template"),
])
def test_what_is_not_served_is_refused_naming_it(bpe: Bpe, key: str, value: str, message: str) -> None:
    meta = read_metadata(bpe[3])
    meta[key] = value
    with pytest.raises(ValueError, match=re.escape(message)):
        ChatTokenizer.from_metadata(meta)
