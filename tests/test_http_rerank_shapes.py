"""Rerank in Cohere/Jina's shape (/v1/rerank, /v2/rerank; the real `cohere` client against /v2/rerank) and TEI's
(/rerank), with usage, truncate and max_tokens_per_doc. Fake workers score a document by the sum of its token
ids (without [CLS]/[SEP]), computed here with the real MiniLM tokenizer."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import AsyncIterator
from pathlib import Path

import cohere
import httpx
import pytest
import trio
from tokenizers import Tokenizer

from tests.support.config import MODEL, daemon_config
from tests.support.fakes import fake_command
from tests.support.helpers import TOKENIZER, client_for

DOCS = ["a", "hello world", "b", "the quick brown fox"]
QUERY = "which one"
KEY = "test-key-0123456789abcdef"


@pytest.fixture(scope="module")
def plain() -> Tokenizer:
    tok = Tokenizer.from_file(str(TOKENIZER))
    tok.no_padding()
    tok.no_truncation()
    return tok


def ids(tok: Tokenizer, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False).ids


@pytest.fixture
async def daemon(tmp_path: Path) -> AsyncIterator[tuple[httpx.AsyncClient, str]]:
    cfg = daemon_config(tmp_path, fake_command())
    model = dataclasses.replace(cfg.supervisor.models[0], max_tokens=8)
    cfg = dataclasses.replace(cfg, supervisor=dataclasses.replace(cfg.supervisor, models=(model,)))
    async with trio.open_nursery() as nursery:
        client, d = await client_for(nursery, cfg)
        async with client:
            yield client, d.binds[0]
        nursery.cancel_scope.cancel()


async def test_cohere_and_jina_shape(daemon: tuple[httpx.AsyncClient, str], plain: Tokenizer) -> None:
    http, _ = daemon
    want = [sum(ids(plain, d)) for d in DOCS]
    n_tokens = len(ids(plain, QUERY)) + sum(len(ids(plain, d)) for d in DOCS)
    for route in ("/v1/rerank", "/v2/rerank"):
        r = await http.post(route, json={"model": MODEL, "query": QUERY, "documents": DOCS, "top_n": 3,
                                         "return_documents": True})
        assert r.status_code == 200, r.text
        body = r.json()
        order = sorted(range(4), key=lambda i: -want[i])[:3]
        assert [x["index"] for x in body["results"]] == order
        assert [x["relevance_score"] for x in body["results"]] == [want[i] for i in order]
        assert [x["document"]["text"] for x in body["results"]] == [DOCS[i] for i in order]
        assert body["usage"] == {"prompt_tokens": n_tokens, "total_tokens": n_tokens}
        # documents as {text} (Jina, Cohere v1); anything else in them is refused
        r = await http.post(route, json={"model": MODEL, "query": QUERY, "documents": [{"text": d} for d in DOCS]})
        assert [x["relevance_score"] for x in r.json()["results"]] == sorted(want, reverse=True)
        r = await http.post(route, json={"model": MODEL, "query": QUERY, "documents": [{"text": "a", "id": 1}]})
        assert r.status_code == 400
    # max_tokens_per_doc cuts each document; truncate=false refuses what does not fit with the query
    long = "one two three four five six seven"
    r = await http.post("/v2/rerank", json={"model": MODEL, "query": QUERY, "documents": [long],
                                            "max_tokens_per_doc": 2})
    assert r.json()["results"][0]["relevance_score"] == sum(ids(plain, long)[:2])
    r = await http.post("/v2/rerank", json={"model": MODEL, "query": QUERY, "documents": ["a", long],
                                            "truncate": False})
    assert r.status_code == 413 and "documents[1] is 9 tokens" in r.json()["error"]["message"]  # [CLS] x [SEP]
    r = await http.post("/v2/rerank", json={"model": MODEL, "query": QUERY, "documents": ["a", long],
                                            "truncate": False, "max_tokens_per_doc": 4})
    assert r.status_code == 200  # cut to 4 by the caller's own limit first: it fits
    for bad in ({"priority": 1}, {"rank_fields": ["text"]}, {"max_tokens_per_doc": 0}, {"top_n": 0}):
        r = await http.post("/v2/rerank", json={"model": MODEL, "query": QUERY, "documents": DOCS, **bad})
        assert r.status_code == 400, bad


async def test_voyage_shape(daemon: tuple[httpx.AsyncClient, str], plain: Tokenizer) -> None:
    """Voyage's body: `top_k` for top_n, `truncation` for truncate (false: what does not fit is refused)."""
    http, _ = daemon
    want = [sum(ids(plain, d)) for d in DOCS]
    r = await http.post("/v1/rerank", json={"model": MODEL, "query": QUERY, "documents": DOCS, "top_k": 2,
                                            "truncation": True})
    assert r.status_code == 200, r.text
    assert [x["index"] for x in r.json()["results"]] == sorted(range(4), key=lambda i: -want[i])[:2]
    long = "one two three four five six seven"
    r = await http.post("/v1/rerank", json={"model": MODEL, "query": QUERY, "documents": ["a", long],
                                            "truncation": False})
    assert r.status_code == 413 and "documents[1] is 9 tokens" in r.json()["error"]["message"]
    r = await http.post("/v1/rerank", json={"model": MODEL, "query": QUERY, "documents": ["a", long],
                                            "truncation": True})
    assert r.status_code == 200, r.text  # cut to the model's max_tokens, as truncate's default
    for bad in ({"truncation": False, "truncate": True}, {"truncation": "no"}):
        r = await http.post("/v1/rerank", json={"model": MODEL, "query": QUERY, "documents": DOCS, **bad})
        assert r.status_code == 400, bad
    r = await http.post("/rerank", json={"query": QUERY, "texts": DOCS, "truncation": False})
    assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported_field"  # TEI's body: not its name


async def test_tei_shape(daemon: tuple[httpx.AsyncClient, str], plain: Tokenizer) -> None:
    http, _ = daemon
    want = [sum(ids(plain, d)) for d in DOCS]
    order = sorted(range(4), key=lambda i: -want[i])
    # TEI names no model: the one that can rerank is used
    r = await http.post("/rerank", json={"query": QUERY, "texts": DOCS, "raw_scores": True, "return_text": True})
    assert r.status_code == 200, r.text
    assert r.json() == [{"index": i, "score": float(want[i]), "text": DOCS[i]} for i in order]
    n_tokens = len(ids(plain, QUERY)) + sum(len(ids(plain, d)) for d in DOCS)
    assert r.headers["x-compute-tokens"] == str(n_tokens)  # TEI carries usage in these headers
    assert r.headers["x-compute-characters"] == str(len(QUERY) + sum(map(len, DOCS)))
    # the fake worker reports no method, so the daemon takes its scores for a cross-encoder's logits: TEI's
    # default applies the sigmoid
    r = await http.post("/rerank", json={"model": MODEL, "query": QUERY, "texts": ["b", "a"]})
    logits = [sum(ids(plain, "b")), sum(ids(plain, "a"))]
    assert r.json() == [{"index": 0, "score": 1 / (1 + math.exp(-logits[0]))},
                        {"index": 1, "score": 1 / (1 + math.exp(-logits[1]))}]
    r = await http.post("/rerank", json={"query": QUERY, "texts": DOCS, "truncation_direction": "Right"})
    assert r.status_code == 200
    for bad in ({"truncation_direction": "left"}, {"top_n": 1}, {"raw_scores": 1}):
        r = await http.post("/rerank", json={"query": QUERY, "texts": DOCS, **bad})
        assert r.status_code == 400, bad


async def test_cohere_client_against_v2_rerank(tmp_path: Path, plain: Tokenizer) -> None:
    """The real client, with an API key: it sends `Authorization: Bearer`."""
    cfg = daemon_config(tmp_path, fake_command())
    cfg = dataclasses.replace(cfg, http=dataclasses.replace(cfg.http, api_keys=_digests(KEY)))
    async with trio.open_nursery() as nursery:
        _, d = await client_for(nursery, cfg)

        def calls() -> dict[str, object]:
            out: dict[str, object] = {}
            with cohere.ClientV2(api_key=KEY, base_url=d.binds[0], timeout=30) as co:
                out["all"] = co.rerank(model=MODEL, query=QUERY, documents=DOCS)
                out["top"] = co.rerank(model=MODEL, query=QUERY, documents=DOCS, top_n=2, max_tokens_per_doc=1)
                for name, kwargs in (("priority", {"priority": 3}), ("missing", {"model": "nope"})):
                    try:
                        co.rerank(**{"model": MODEL, "query": QUERY, "documents": DOCS, **kwargs})
                    except cohere.core.ApiError as exc:
                        out[name] = exc
            with cohere.ClientV2(api_key="wrong-key-0123456789abc", base_url=d.binds[0], timeout=30) as co:
                try:
                    co.rerank(model=MODEL, query=QUERY, documents=DOCS)
                except cohere.UnauthorizedError as exc:
                    out["unauthorized"] = exc
            return out

        out = await trio.to_thread.run_sync(calls)
        nursery.cancel_scope.cancel()
    want = [sum(ids(plain, doc)) for doc in DOCS]
    order = sorted(range(4), key=lambda i: -want[i])
    assert [(x.index, x.relevance_score) for x in out["all"].results] == [(i, want[i]) for i in order]
    first = [ids(plain, doc)[0] for doc in DOCS]
    assert [x.index for x in out["top"].results] == sorted(range(4), key=lambda i: -first[i])[:2]
    assert out["priority"].status_code == 400 and out["priority"].body["error"]["param"] == "priority"
    assert out["missing"].status_code == 404
    assert out["unauthorized"].status_code == 401


def _digests(*keys: str) -> frozenset[bytes]:
    from trio_gpuworker.daemon.http_auth import load_api_keys

    return load_api_keys("", Path.cwd(), {"GPUWORKER_API_KEYS": ",".join(keys)})
