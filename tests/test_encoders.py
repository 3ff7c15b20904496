"""Encoders from sentence-transformers folders (docs/models.md, "Encoders"): BERT and XLM-RoBERTa, every pooling,
normalised and not, on both encoders (fused and graph), against sentence-transformers on the same folder; the
configuration's keys over the folder's; cross-encoders of both architectures against sentence-transformers'
CrossEncoder; and folders the worker cannot serve as their authors meant, refused at LOAD.

Requests go the daemon's way without its processes: ModelConfig and LOAD as the supervisor builds them, the daemon's
tokenizer, then the worker's Engine."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio

pytestmark = pytest.mark.slow

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
st = pytest.importorskip("sentence_transformers")

from tests.support.tiny_encoders import ARCHS, MAX_TOKENS, POOLINGS, model_folder, st_folder  # noqa: E402
from trio_gpuworker import WorkerError  # noqa: E402
from trio_gpuworker import _api_checks as ck  # noqa: E402
from trio_gpuworker._config import ModelConfig  # noqa: E402
from trio_gpuworker._proto import EXT_POOLING, EmbedBatch, Rerank, required_extensions  # noqa: E402
from trio_gpuworker.supervisor._models import DigestCache, load_spec, tokenizer_file  # noqa: E402
from trio_gpuworker.tokenization import EmbeddingTokenizer  # noqa: E402
from trio_gpuworker.worker._engine import Engine, compose_pairs  # noqa: E402

ENCODERS = ("fused", "graph")
# 8 texts of at most 16 tokens each: one micro-batch shape on the graph encoder
TEXTS = ["hello world", "the quick brown fox", "la vie est belle", "ein kleiner Test", "naïve café",
         "el rápido zorro marrón", "search query about foxes", "das Wetter ist heute schön"]
QUERY = "a fox"
DOCS = ["the quick brown fox", "la vie est belle", "hello world", "das Wetter", "naïve café", "zorro", "foxes", "ok"]


def _quiet(*_: Any, **__: Any) -> None:
    """LOAD's and requests' progress: unused here."""


def _config(folder: Path, kind: str = "embedding", encoder: str = "fused", **keys: Any) -> ModelConfig:
    """The model in `folder`, as the daemon's configuration gives it (its id: the folder's name)."""
    return ModelConfig(id=folder.name, path=folder / "model.safetensors", kind=kind, max_tokens=MAX_TOKENS,
                       runtime_config={"encoder": encoder}, **keys)


def _load(engine: Engine, mc: ModelConfig, tmp: Path) -> None:
    """LOAD as the supervisor sends it (supervisor/_models.py load_spec: digest, [CLS]/[SEP] ids, runtime_config)."""
    spec = trio.run(load_spec, mc, DigestCache(tmp / "digests.json"))
    engine.handle(spec.request(), _quiet)


def _tokenizer(mc: ModelConfig) -> EmbeddingTokenizer:
    path = tokenizer_file(mc)
    assert path is not None
    return EmbeddingTokenizer.from_file(path, mc.max_tokens)


def _embed(engine: Engine, mc: ModelConfig, texts: list[str], pooling: str | None = None,
           normalize: bool | None = None) -> np.ndarray:
    """The daemon's defaults (ck.check_pooling / check_normalize) and tokenizer, then EMBED_BATCH."""
    rows = _tokenizer(mc).encode(texts)
    msg = EmbedBatch(model_ref=mc.id, pooling=ck.check_pooling(pooling, mc),
                     normalize=ck.check_normalize(normalize, mc),
                     items=[{"id": i, "n_tokens": len(r)} for i, r in enumerate(rows)],
                     raw=np.concatenate(rows).astype("<i4").tobytes())
    reply = engine.handle(msg, _quiet)
    return np.frombuffer(reply.raw, "<f4").reshape(reply.n, reply.dims)


def _rerank(engine: Engine, mc: ModelConfig, query: str, docs: list[str]) -> np.ndarray:
    """RERANK as the supervisor sends it: the query's and the documents' ids without specials."""
    q, *ids = _tokenizer(mc).encode_plain([query, *docs])
    msg = Rerank(model_ref=mc.id, query_n_tokens=len(q), candidates=[{"n_tokens": len(d)} for d in ids],
                 raw=np.concatenate([q, *ids]).astype("<i4").tobytes())
    reply = engine.handle(msg, _quiet)
    assert reply.method == "cross_encoder"
    return np.frombuffer(reply.raw, "<f4")


def _assert_close(got: np.ndarray, want: np.ndarray) -> None:
    """Each vector's cosine with the reference's at least 0.9999, and its length within 1e-3 of it."""
    assert got.shape == want.shape
    cos = (got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
    assert cos.min() >= 0.9999, cos
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), np.linalg.norm(want, axis=1), rtol=1e-3)


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str, bool], Path]:
    """(arch, pooling, normalize) -> a sentence-transformers folder; one set of weights per architecture. The
    mean and max folders are written in the hub's older form, the others in today's."""
    root = tmp_path_factory.mktemp("encoders")
    out = {}
    for arch in ARCHS:
        base = model_folder(root / f"{arch}-base", arch)
        for pooling in POOLINGS:
            for normalize in (True, False):
                dest = root / f"{arch}-{pooling}-{'unit' if normalize else 'raw'}"
                out[arch, pooling, normalize] = st_folder(base, dest, pooling, normalize,
                                                          legacy=pooling in ("mean", "max"))
    return out


@pytest.fixture(scope="module")
def references(folders: dict[tuple[str, str, bool], Path]) -> dict[tuple[str, str, bool], np.ndarray]:
    """sentence-transformers' embeddings of TEXTS from each folder."""
    return {k: st.SentenceTransformer(str(f), device="cpu").encode(TEXTS, convert_to_numpy=True)
            for k, f in folders.items()}


@pytest.fixture(scope="module")
def engines(folders: dict, tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], Engine]:
    """(arch, encoder) -> a worker Engine with that architecture's weights loaded (from its mean folder)."""
    tmp = tmp_path_factory.mktemp("load")
    out = {}
    for arch in ARCHS:
        for encoder in ENCODERS:
            out[arch, encoder] = engine = Engine()
            _load(engine, _config(folders[arch, "mean", True], encoder=encoder), tmp)
    return out


@pytest.mark.parametrize("pooling", POOLINGS)
@pytest.mark.parametrize("encoder", ENCODERS)
@pytest.mark.parametrize("arch", ARCHS)
def test_embeddings_match_sentence_transformers(arch: str, encoder: str, pooling: str, folders: dict,
                                                references: dict, engines: dict) -> None:
    """The folder's pooling and normalisation become the model's defaults, and its vectors are
    sentence-transformers' on the same folder."""
    engine = engines[arch, encoder]
    for normalize in (True, False):
        mc = _config(folders[arch, pooling, normalize], encoder=encoder)
        assert mc.defaults == (pooling, normalize)
        engine.models[mc.id] = engine.models[_config(folders[arch, "mean", True]).id]  # the same weights
        _assert_close(_embed(engine, mc, TEXTS), references[arch, pooling, normalize])


@pytest.mark.parametrize("arch", ARCHS)
def test_configuration_keys_override_the_folder(arch: str, folders: dict, references: dict, engines: dict) -> None:
    """`pooling` and `normalize` in the model's table win over the folder, each on its own; a request's own
    pooling and normalize win over both."""
    folder = folders[arch, "mean", True]
    engine = engines[arch, "fused"]
    for keys, want in (({"pooling": "lasttoken"}, ("lasttoken", True)), ({"normalize": False}, ("mean", False)),
                       ({"pooling": "cls", "normalize": False}, ("cls", False))):
        mc = _config(folder, **keys)
        assert mc.defaults == want
        _assert_close(_embed(engine, mc, TEXTS), references[(arch, *want)])
    mc = _config(folder, pooling="cls")
    _assert_close(_embed(engine, mc, TEXTS, pooling="max", normalize=False), references[arch, "max", False])


@pytest.mark.parametrize("encoder", ENCODERS)
@pytest.mark.parametrize("arch", ARCHS)
def test_cross_encoders_match_cross_encoder(arch: str, encoder: str, tmp_path: Path) -> None:
    """kind = "rerank": pairs composed by the worker ([CLS] q [SEP] d [SEP]; <s> q </s></s> d </s>) score as
    sentence-transformers' CrossEncoder scores them (its logits, without the sigmoid)."""
    folder = model_folder(tmp_path / f"ce-{arch}", arch, seed=1, num_labels=1)
    want = st.CrossEncoder(str(folder), device="cpu").predict([(QUERY, d) for d in DOCS],
                                                              activation_fn=torch.nn.Identity())
    engine, mc = Engine(), _config(folder, kind="rerank", encoder=encoder)
    _load(engine, mc, tmp_path)
    np.testing.assert_allclose(_rerank(engine, mc, QUERY, DOCS), want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("max_tokens", [6, 7, 12, 20, 64])
def test_xlm_roberta_pairs_match_its_tokenizer(max_tokens: int, folders: dict) -> None:
    """The worker's XLM-RoBERTa pairs, cut to max_tokens, are the tokenizer's own pair encoding (longest_first)."""
    path = folders["xlm-roberta", "mean", True] / "tokenizer.json"
    tok, plain = EmbeddingTokenizer.from_file(path, max_tokens), EmbeddingTokenizer.from_file(path, 10_000)
    rng = np.random.default_rng(max_tokens)
    words = " ".join(TEXTS).split()
    for _ in range(30):
        query, *docs = (" ".join(rng.choice(words, int(rng.integers(0, 12)))) for _ in range(4))
        want_ids, want_types = tok.encode_pair(query, docs)
        q, *ds = plain.encode_plain([query, *docs])
        ids, types = compose_pairs(q, ds, 0, 2, max_tokens, roberta=True)
        for got, want in zip(ids + types, want_ids + want_types, strict=True):
            np.testing.assert_array_equal(got, want)


def test_xlm_roberta_positions_skip_a_padding_id(folders: dict) -> None:
    """Ids with XLM-RoBERTa's padding id inside a row (token-id input can hold one) are numbered as transformers
    numbers them: that token at the padding id's position, the others counted without it."""
    import transformers

    folder = folders["xlm-roberta", "mean", False]
    ids = [np.array([0, 5, 1, 7, 9, 2], np.int32), np.array([0, 1, 1, 4, 2], np.int32)]
    model = transformers.XLMRobertaModel.from_pretrained(folder).eval()
    for encoder in ENCODERS:
        engine, mc = Engine(), _config(folder, encoder=encoder)
        _load(engine, mc, folder.parent)
        for row in ids:
            with torch.no_grad():
                h = model(input_ids=torch.from_numpy(row[None].astype(np.int64)),
                          attention_mask=torch.ones(1, len(row), dtype=torch.long)).last_hidden_state[0].numpy()
            got = engine.models[mc.id].impl.embed([row], "mean", False)
            np.testing.assert_allclose(got[0], h.mean(0), atol=1e-4, rtol=0)


def _refusals(root: Path) -> list[tuple[Path, str, str]]:
    """(folder, kind, what the refusal names)."""
    bert = model_folder(root / "bert", "bert")
    other = st_folder(bert, root / "distilbert", "mean", True, legacy=True)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps(config | {"model_type": "distilbert"}))
    rerank = model_folder(root / "rerank", "bert", num_labels=1)
    (rerank / "config.json").write_text(json.dumps(json.loads((rerank / "config.json").read_text())
                                                   | {"model_type": "electra"}))
    return [
        (other, "embedding", "'distilbert'"),
        (rerank, "rerank", "'electra'"),
        (st_folder(bert, root / "weighted", (), True, legacy=True, flags=("pooling_mode_weightedmean_tokens",)),
         "embedding", "'weightedmean'"),
        (st_folder(bert, root / "sqrt", "mean_sqrt_len_tokens", True, legacy=False), "embedding",
         "'mean_sqrt_len_tokens'"),
        (st_folder(bert, root / "both", ("cls", "mean"), False, legacy=True), "embedding", "cls + mean"),
        (st_folder(bert, root / "dense", "mean", True, legacy=True, extra=("sentence_transformers.models.Dense",)),
         "embedding", "'sentence_transformers.models.Dense'"),
    ]


def test_what_cannot_be_served_is_refused_at_load(tmp_path: Path) -> None:
    """An architecture, pooling or module the encoders do not serve: LOAD answers config_invalid naming it. The
    daemon's defaults do not fail on such a folder (LOAD is where it is refused)."""
    for folder, kind, named in _refusals(tmp_path):
        mc = _config(folder, kind=kind)
        assert mc.defaults == ("mean", True)
        with pytest.raises(WorkerError) as info:
            _load(Engine(), mc, tmp_path)
        assert info.value.code == "config_invalid" and named in str(info.value), str(info.value)


def test_poolings_past_mean_and_cls_are_a_negotiated_extension() -> None:
    """The reference's EMBED_BATCH carries mean or cls; max and lasttoken go only to a worker that advertised
    gpuworker.pooling (its HELLO's build_flags)."""
    assert required_extensions("EMBED_BATCH", {"pooling": "mean"}) == frozenset()
    assert required_extensions("EMBED_BATCH", {"pooling": "cls"}) == frozenset()
    assert required_extensions("EMBED_BATCH", {"pooling": "max"}) == {EXT_POOLING}
    assert required_extensions("EMBED_BATCH", {"pooling": "lasttoken"}) == {EXT_POOLING}


def test_a_folder_without_modules_json_keeps_mean_and_unit_length(tmp_path: Path) -> None:
    mc = _config(model_folder(tmp_path / "plain", "bert"))
    assert mc.defaults == ("mean", True)
    assert _config(tmp_path / "plain", pooling="cls").defaults == ("cls", True)
