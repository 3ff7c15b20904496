"""Tiny sentence-transformers folders, written here for tests: random BERT and XLM-RoBERTa weights saved by
transformers, a tokenizer trained on a few lines by `tokenizers` (WordPiece for BERT, Unigram with XLM-RoBERTa's
special tokens and pair template for XLM-RoBERTa), and the modules.json and 1_Pooling/config.json that
sentence-transformers reads, in its older form (the one the hub's folders have) or the one it writes today."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
import transformers
from tokenizers import (
    BertWordPieceTokenizer,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

ARCHS = ("bert", "xlm-roberta")
POOLINGS = ("mean", "cls", "max", "lasttoken")
HIDDEN, MAX_TOKENS = 32, 64  # a hidden size the fused encoder takes (whole 32-float panels)
CORPUS = [
    "the quick brown fox jumps over the lazy dog", "a small test of the model", "hello world",
    "bonjour le monde, comment allez-vous", "ein kleiner Test für das Modell", "el rápido zorro marrón",
    "naïve café au lait", "das Wetter ist heute schön", "la vie est belle", "search query about foxes",
] * 20
_LEGACY = {"cls": "pooling_mode_cls_token", "mean": "pooling_mode_mean_tokens", "max": "pooling_mode_max_tokens",
           "lasttoken": "pooling_mode_lasttoken"}
_TYPES = {  # module class -> (older type name, today's)
    "Transformer": ("sentence_transformers.models.Transformer",
                    "sentence_transformers.base.modules.transformer.Transformer"),
    "Pooling": ("sentence_transformers.models.Pooling",
                "sentence_transformers.sentence_transformer.modules.pooling.Pooling"),
    "Normalize": ("sentence_transformers.models.Normalize", "sentence_transformers.base.modules.normalize.Normalize"),
}


def _bert_tokenizer() -> transformers.PreTrainedTokenizerBase:
    tok = BertWordPieceTokenizer(lowercase=True)
    tok.train_from_iterator(CORPUS, vocab_size=150, special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"])
    return transformers.BertTokenizerFast(tokenizer_object=tok._tokenizer, unk_token="[UNK]", sep_token="[SEP]",
                                          pad_token="[PAD]", cls_token="[CLS]", mask_token="[MASK]")


def _xlmr_tokenizer() -> transformers.PreTrainedTokenizerBase:
    tok = Tokenizer(models.Unigram())
    tok.normalizer = normalizers.NFKC()
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator(CORPUS, trainers.UnigramTrainer(
        vocab_size=150, special_tokens=["<s>", "<pad>", "</s>", "<unk>"], unk_token="<unk>"))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>",
                                                       special_tokens=[("<s>", 0), ("</s>", 2)])
    return transformers.XLMRobertaTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                                sep_token="</s>", cls_token="<s>", unk_token="<unk>",
                                                pad_token="<pad>", mask_token="<unk>")


def _config(arch: str, vocab: int, **extra: object) -> transformers.PretrainedConfig:
    dims = dict(vocab_size=vocab, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4,
                intermediate_size=64, hidden_act="gelu", layer_norm_eps=1e-5, **extra)
    if arch == "bert":
        return transformers.BertConfig(**dims, max_position_embeddings=MAX_TOKENS, type_vocab_size=2)
    # XLM-RoBERTa's positions start past its padding id (1): MAX_TOKENS of them
    return transformers.XLMRobertaConfig(**dims, max_position_embeddings=MAX_TOKENS + 2, type_vocab_size=1,
                                         pad_token_id=1, bos_token_id=0, eos_token_id=2)


def _randomise(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Default init (std 0.02, LayerNorm = identity) would leave most paths untested: every weight matters."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    return model.eval()


def model_folder(root: Path, arch: str, seed: int = 0, num_labels: int | None = None) -> Path:
    """A transformers folder: an encoder (num_labels None) or a ...ForSequenceClassification with `num_labels`
    logits, its config.json, and tokenizer.json."""
    tok = _bert_tokenizer() if arch == "bert" else _xlmr_tokenizer()
    cfg = _config(arch, len(tok), **({} if num_labels is None else {"num_labels": num_labels}))
    if num_labels is None:
        cls = transformers.BertModel if arch == "bert" else transformers.XLMRobertaModel
    else:
        cls = (transformers.BertForSequenceClassification if arch == "bert"
               else transformers.XLMRobertaForSequenceClassification)
    root.mkdir(parents=True, exist_ok=True)
    _randomise(cls(cfg), seed).save_pretrained(root, safe_serialization=True)
    tok.model_max_length = MAX_TOKENS
    tok.save_pretrained(root)
    return root


def modules(pooling: str | tuple[str, ...], normalize: bool, legacy: bool, extra: tuple[str, ...] = ()) -> list:
    """modules.json: Transformer, Pooling, Normalize if `normalize`, then `extra` (full type names)."""
    kinds = ["Transformer", "Pooling", *(["Normalize"] if normalize else [])]
    paths = {"Transformer": "", "Pooling": "1_Pooling", "Normalize": "2_Normalize"}
    out = [{"idx": i, "name": str(i), "path": paths[k], "type": _TYPES[k][0 if legacy else 1]}
           for i, k in enumerate(kinds)]
    return out + [{"idx": len(out) + i, "name": str(len(out) + i), "path": f"{len(out) + i}_{t.rsplit('.', 1)[-1]}",
                   "type": t} for i, t in enumerate(extra)]


def pooling_config(pooling: str | tuple[str, ...], legacy: bool, flags: tuple[str, ...] = ()) -> dict:
    """1_Pooling/config.json: sentence-transformers' older flags (plus any `flags` set) or today's pooling_mode."""
    modes = (pooling,) if isinstance(pooling, str) else pooling
    if not legacy:
        return {"embedding_dimension": HIDDEN, "pooling_mode": modes[0] if len(modes) == 1 else list(modes),
                "include_prompt": True}
    out: dict = {"word_embedding_dimension": HIDDEN, **{flag: False for flag in _LEGACY.values()},
                 "pooling_mode_mean_sqrt_len_tokens": False, "pooling_mode_weightedmean_tokens": False}
    return out | {_LEGACY[m]: True for m in modes} | {flag: True for flag in flags}


def st_folder(base: Path, dest: Path, pooling: str | tuple[str, ...], normalize: bool, legacy: bool,
              flags: tuple[str, ...] = (), extra: tuple[str, ...] = ()) -> Path:
    """A copy of transformers folder `base` made a sentence-transformers folder: `pooling`, `normalize`."""
    shutil.copytree(base, dest)
    (dest / "modules.json").write_text(json.dumps(modules(pooling, normalize, legacy, extra), indent=2))
    (dest / "1_Pooling").mkdir()
    (dest / "1_Pooling" / "config.json").write_text(json.dumps(pooling_config(pooling, legacy, flags), indent=2))
    (dest / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": MAX_TOKENS, "do_lower_case": False}))
    return dest
