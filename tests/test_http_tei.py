"""text-embeddings-inference's and text-generation-inference's routes (`POST /embed`, `POST /`, `POST /generate`,
`GET /info`, `GET /health`) driven by the real `huggingface_hub.InferenceClient(base_url)`, and /rerank's Cohere
body driven by the real litellm (`hosted_vllm/`, `infinity/`), against a daemon with fake workers. The fakes'
answers are functions of the token ids they were sent (tests/support/fakes.py), computed here with the real
tokenizers."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import huggingface_hub.constants
import numpy as np
import pytest
import trio
from huggingface_hub import InferenceClient
from tokenizers import Tokenizer

from tests.support.config import MODEL, daemon_config
from tests.support.fakes import fake_command
from tests.support.helpers import TOKENIZER, client_for
from tests.support.reference_llama import gguf_path
from trio_gpuworker._api_requests import CompletionRequest, EmbeddingsRequest
from trio_gpuworker.daemon.config import DEFAULT_LM
from trio_gpuworker.llm_tokenizer import ChatTokenizer

DOCS = ["a", "hello world", "b", "the quick brown fox"]
QUERY = "which one"
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    t = Tokenizer.from_file(str(TOKENIZER))
    t.no_padding()
    t.no_truncation()
    return t


@pytest.fixture(scope="module")
def lm_tok() -> ChatTokenizer:
    return ChatTokenizer.from_gguf(gguf_path())


def ids(tok: Tokenizer, text: str, special: bool = True) -> list[int]:
    return tok.encode(text, add_special_tokens=special).ids


@pytest.fixture
async def daemon(tmp_path: Path) -> AsyncIterator[tuple[httpx.AsyncClient, Any]]:
    """An embedding model (MODEL) and a generate model (DEFAULT_LM) on fake workers."""
    async with trio.open_nursery() as nursery:
        client, d = await client_for(nursery, daemon_config(tmp_path, fake_command(), lm=fake_command()))
        async with client:
            yield client, d
        nursery.cancel_scope.cancel()


def unsupported(r: httpx.Response, param: str) -> bool:
    err = r.json().get("error", {}) if r.status_code == 400 else {}
    return err.get("code") == "unsupported_field" and err.get("param") == param


async def test_huggingface_hub_inference_client(daemon: tuple[httpx.AsyncClient, Any], tok: Tokenizer,
                                                lm_tok: ChatTokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    """feature_extraction and sentence_similarity go to TEI's `POST /`, text_generation to TGI's, get_endpoint_info
    to /info and health_check to /health: each in its origin's shape."""
    _, d = daemon
    # the suite keeps huggingface_hub offline (conftest.py), which blocks every URL; this one is the daemon's
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    # hf-inference: the provider of TEI and TGI endpoints, which /info and /health need named
    client = InferenceClient(base_url=d.binds[0], provider="hf-inference", timeout=30)

    def calls() -> dict[str, Any]:
        return {"one": client.feature_extraction("hello world"),
                "two": client.feature_extraction(["a", "the quick brown fox"], normalize=False, truncate=True),
                "similar": client.sentence_similarity("which one", DOCS),
                "gen": client.text_generation(PROMPT, max_new_tokens=2),
                "info": client.get_endpoint_info(),
                "health": client.health_check()}

    out = await trio.to_thread.run_sync(calls)
    # the fake's vector: [sum(ids), n_tokens, item id, req_id], ids with [CLS]/[SEP] as the daemon tokenizes
    assert out["one"].shape == (1, 4) and out["one"].dtype == np.float32
    assert out["one"][0, :3].tolist() == [sum(ids(tok, "hello world")), len(ids(tok, "hello world")), 0]
    assert out["two"][:, :3].tolist() == [[sum(ids(tok, t)), len(ids(tok, t)), i]
                                          for i, t in enumerate(["a", "the quick brown fox"])]
    # the cosine of the source's vector with each sentence's, all of one batch (one req_id, an integer: found
    # from the answers, then every answer checked against it)
    rows = [[sum(ids(tok, t)), len(ids(tok, t)), i] for i, t in enumerate(["which one", *DOCS])]

    def cosines(req: int) -> np.ndarray:
        v = np.array([[*r, req] for r in rows], np.float64)
        return (v[1:] @ v[0]) / (np.linalg.norm(v[1:], axis=1) * np.linalg.norm(v[0]))

    got = np.array(out["similar"])
    req = min(range(1, 2000), key=lambda r: float(np.abs(cosines(r) - got).max()))
    assert len(got) == len(DOCS) and np.abs(cosines(req) - got).max() < 1e-6, (got, cosines(req))
    # TGI's `POST /` answers the prompt and its continuation (return_full_text's default for a text-generation
    # model); the fake's text is "fake <sum(prompt ids)>"
    assert out["gen"] == PROMPT + f"fake {sum(lm_tok.encode(PROMPT))}"
    info = out["info"]
    assert info["model_id"] == MODEL and info["model_type"] == {"embedding": {"pooling": "mean"}}
    assert info["max_input_length"] == d.sup.config.model(MODEL).max_tokens and info["auto_truncate"] is True
    assert out["health"] is True


async def test_tei_and_tgi_bodies(daemon: tuple[httpx.AsyncClient, Any], tok: Tokenizer,
                                  lm_tok: ChatTokenizer) -> None:
    http, _ = daemon
    # /embed: a list of vectors, one input as a list of one; token ids as given; usage in TEI's headers
    for path in ("/embed", "/"):
        r = await http.post(path, json={"inputs": "hello world"})
        assert r.status_code == 200, r.text
        assert [v[:2] for v in r.json()] == [[sum(ids(tok, "hello world")), len(ids(tok, "hello world"))]]
        assert r.headers["x-compute-tokens"] == str(len(ids(tok, "hello world")))
        assert r.headers["x-compute-characters"] == str(len("hello world"))
    r = await http.post("/embed", json={"inputs": [[101, 7592, 102], [101, 102]], "truncation_direction": "right"})
    assert [v[:2] for v in r.json()] == [[101 + 7592 + 102, 3], [203, 2]]
    r = await http.post("/embed", json={"inputs": "x", "model": "nope"})
    assert r.status_code == 404
    # TGI: /generate answers {generated_text}, `POST /` a list of it, led by the prompt unless told not to
    want = f"fake {sum(lm_tok.encode(PROMPT))}"
    r = await http.post("/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 2}})
    assert r.status_code == 200 and r.json() == {"generated_text": want}, r.text
    r = await http.post("/", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 2, "return_full_text": False,
                                                                    "details": False, "do_sample": False}})
    assert r.json() == [{"generated_text": want}], r.text
    # a TEI body's query is TEI's rerank there
    r = await http.post("/", json={"query": QUERY, "texts": DOCS, "raw_scores": True})
    want_scores = [sum(ids(tok, doc, special=False)) for doc in DOCS]
    assert [x["score"] for x in r.json()] == sorted(want_scores, reverse=True)
    # what TEI and TGI take and this daemon does not implement: 400, naming it
    refused = [("/embed", {"inputs": "x", "prompt_name": "query"}, "prompt_name"),
               ("/embed", {"inputs": "x", "truncation_direction": "left"}, "truncation_direction"),
               ("/embed", {"inputs": "x", "encoding_format": "float"}, "encoding_format"),  # OpenAI's, not TEI's
               ("/", {"inputs": {"source_sentence": "a", "sentences": ["b"]}, "parameters": {"prompt_name": "q"}},
                "parameters.prompt_name"),
               ("/", {"inputs": "x", "parameters": {"details": True}}, "parameters.details"),
               ("/", {"inputs": "x", "parameters": {"bogus": 1}}, "parameters.bogus"),
               ("/", {"inputs": "x", "parameters": {"model": DEFAULT_LM}}, "parameters.model"),
               ("/", {"inputs": "x", "stream": True}, "stream"),
               ("/generate", {"inputs": "x", "parameters": {"repetition_penalty": 1.2}},
                "parameters.repetition_penalty"),
               ("/generate", {"inputs": "x", "max_new_tokens": 2}, "max_new_tokens")]  # not at the top level
    for path, body, param in refused:
        r = await http.post(path, json=body)
        assert unsupported(r, param), (path, body, r.text)
    for path, body in (("/", {"inputs": {"source_sentence": "a"}}), ("/generate", {"inputs": ""}),
                       ("/", {"inputs": "x", "parameters": []}), ("/embed", {"inputs": []})):
        r = await http.post(path, json=body)
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request", (path, body, r.text)
    # GET / and /health: 200, empty, while every model can be served
    for path in ("/", "/health"):
        r = await http.get(path)
        assert r.status_code == 200 and r.content == b"", path


def test_tei_defaults_and_tgi_sampling(tmp_path: Path) -> None:
    """TEI normalizes unless told not to; TGI's do_sample samples at temperature 1 unless one is given."""
    cfg = daemon_config(tmp_path, fake_command(), lm=fake_command()).supervisor
    assert EmbeddingsRequest.from_json({"inputs": "x"}, cfg, max_inputs=4, shape="tei").normalize is True
    assert EmbeddingsRequest.from_json({"inputs": "x", "normalize": False}, cfg, max_inputs=4,
                                       shape="tei").normalize is False
    tgi = {"inputs": "x", "parameters": {"do_sample": True, "seed": 3}}
    assert CompletionRequest.from_json(tgi, cfg, shape="tgi").sampling == {"temperature": 1.0, "seed": 3}
    tgi["parameters"] |= {"temperature": 0.5, "max_new_tokens": 7}
    request = CompletionRequest.from_json(tgi, cfg, shape="tgi")
    assert request.sampling == {"temperature": 0.5, "seed": 3} and request.max_tokens == 7
    assert CompletionRequest.from_json({"inputs": "x"}, cfg, shape="tgi").sampling == {}  # greedy


async def test_rerank_takes_cohere_and_tei_bodies_and_litellm(daemon: tuple[httpx.AsyncClient, Any],
                                                              tok: Tokenizer) -> None:
    """/rerank answers Cohere's and Jina's body (`documents`) in their shape and TEI's (`texts`) in TEI's; litellm's
    hosted_vllm/ and infinity/ providers send the former there (their api_base is the root)."""
    http, d = daemon
    want = [sum(ids(tok, doc, special=False)) for doc in DOCS]
    order = sorted(range(len(DOCS)), key=lambda i: -want[i])
    r = await http.post("/rerank", json={"query": QUERY, "documents": DOCS, "top_n": 2, "return_documents": True})
    assert r.status_code == 200, r.text
    assert [(x["index"], x["relevance_score"], x["document"]) for x in r.json()["results"]] == \
        [(i, want[i], {"text": DOCS[i]}) for i in order[:2]]
    r = await http.post("/rerank", json={"query": QUERY, "texts": DOCS, "raw_scores": True})
    assert r.json() == [{"index": i, "score": want[i]} for i in order]
    # each body takes its own fields only
    assert unsupported(await http.post("/rerank", json={"query": QUERY, "documents": DOCS, "raw_scores": True}),
                       "raw_scores")
    assert unsupported(await http.post("/rerank", json={"query": QUERY, "texts": DOCS, "top_n": 1}), "top_n")

    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # litellm would fetch its price list
    import litellm

    def calls() -> dict[str, Any]:
        return {"vllm": litellm.rerank(model=f"hosted_vllm/{MODEL}", query=QUERY, documents=DOCS, top_n=3,
                                       api_base=d.binds[0], return_documents=True),
                # infinity answers a document as a bare string where Cohere, Jina and vLLM answer {text}, and the
                # bodies are the same: /rerank answers theirs, so infinity's client takes it without documents
                "infinity": litellm.rerank(model=f"infinity/{MODEL}", query=QUERY, documents=DOCS,
                                           api_base=d.binds[0], api_key="unused", return_documents=False)}

    out = await trio.to_thread.run_sync(calls)
    assert [(x["index"], x["relevance_score"], x["document"]["text"]) for x in out["vllm"].results] == \
        [(i, want[i], DOCS[i]) for i in order[:3]]
    assert [(x["index"], x["relevance_score"]) for x in out["infinity"].results] == [(i, want[i]) for i in order]
    n_tokens = len(ids(tok, QUERY, special=False)) + sum(len(ids(tok, doc, special=False)) for doc in DOCS)
    assert out["infinity"].meta["tokens"]["input_tokens"] == n_tokens
