"""Embedding options over HTTP (truncate, token-id inputs, Matryoshka dimensions, normalize, pooling) and
/tokenize, /detokenize, against fake workers with the real MiniLM tokenizer and the real SmolLM2 GGUF tokenizer.

The fake worker's vector for row i is [sum(ids), n_tokens, i, req_id], so the ids the daemon sent show."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import trio
from tokenizers import Tokenizer

from tests.support.config import MODEL, daemon_config
from tests.support.fakes import fake_command
from tests.support.helpers import TOKENIZER, client_for
from tests.support.reference_llama import gguf_path
from trio_gpuworker.daemon.config import DEFAULT_LM
from trio_gpuworker.llm_tokenizer import ChatTokenizer

MAX_TOKENS = 8
SHORT = "hello world"  # [CLS] hello world [SEP]: 4 tokens
LONG = "one two three four five six seven eight nine ten"  # 12 tokens with [CLS]/[SEP]


@pytest.fixture
async def http(tmp_path: Path) -> AsyncIterator[httpx.AsyncClient]:
    cfg = daemon_config(tmp_path, fake_command(), http={"max_body_bytes": 1 << 20}, lm=fake_command())
    sup = cfg.supervisor
    embed = dataclasses.replace(sup.models[0], max_tokens=MAX_TOKENS, matryoshka_dims=(2,))
    sup = dataclasses.replace(sup, models=(embed, *sup.models[1:]))
    async with trio.open_nursery() as nursery:
        client, _ = await client_for(nursery, dataclasses.replace(cfg, supervisor=sup))
        async with client:
            yield client
        nursery.cancel_scope.cancel()


@pytest.fixture(scope="module")
def bert() -> Tokenizer:
    tok = Tokenizer.from_file(str(TOKENIZER))
    tok.no_padding()  # the shipped tokenizer.json pads and truncates to 128
    tok.no_truncation()
    return tok


def rows(r: httpx.Response) -> list[list[float]]:
    assert r.status_code == 200, r.text
    return [d["embedding"] for d in r.json()["data"]]


async def embed(http: httpx.AsyncClient, **body: object) -> httpx.Response:
    return await http.post("/v1/embeddings", json={"model": MODEL, **body})


async def test_truncate(http: httpx.AsyncClient) -> None:
    got = rows(await embed(http, input=[SHORT, LONG]))  # default: cut at max_tokens, as before
    assert [v[1] for v in got] == [4, MAX_TOKENS]
    assert rows(await embed(http, input=[SHORT, LONG], truncate=True)) == [[*v[:3], v[3] + 1] for v in got]
    r = await embed(http, input=[SHORT, LONG], truncate=False)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert "input[1] is 12 tokens" in r.json()["error"]["message"]  # names the input and its length
    assert rows(await embed(http, input=[SHORT, "a b c d e f"], truncate=False))[1][1] == MAX_TOKENS  # just fits
    r = await embed(http, input=["x" * (MAX_TOKENS * 128 + 1)], truncate=False)
    assert r.status_code == 413 and "input[0] has 1025 characters" in r.json()["error"]["message"]
    r = await embed(http, input=SHORT, truncate="no")
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request"


async def test_token_id_inputs(http: httpx.AsyncClient, bert: Tokenizer) -> None:
    ids = bert.encode(SHORT).ids  # with [CLS]/[SEP]
    text = rows(await embed(http, input=SHORT))[0]
    # as given, one input or a list of them; the same vector as the text
    one = rows(await embed(http, input=ids))
    both = rows(await embed(http, input=[ids, [7592]]))
    assert [v[:2] for v in one] == [text[:2]] and [v[:2] for v in both] == [text[:2], [7592.0, 1.0]]
    r = await embed(http, input=[ids, [7592]])
    assert r.json()["usage"] == {"prompt_tokens": len(ids) + 1, "total_tokens": len(ids) + 1}
    long = list(range(1000, 1012))
    assert rows(await embed(http, input=long))[0][:2] == [float(sum(long[:MAX_TOKENS])), MAX_TOKENS]  # cut
    r = await embed(http, input=[[1, 2], long], truncate=False)
    assert r.status_code == 413 and "input[1] is 12 tokens" in r.json()["error"]["message"]
    for bad, where in (([[1, 2], [3, -1]], "input[1] holds -1 at position 1"),
                       ([[1, 2.5]], "input[0] holds 2.5"), ([[True]], "input[0] holds true"),
                       ([1, 2, 30522], "input[0] holds 30522 at position 2"), ([[]], "input[0] is an empty list")):
        r = await embed(http, input=bad)
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request", bad
        assert where.replace("true", "True") in r.json()["error"]["message"], r.json()


async def test_matryoshka_dimensions(http: httpx.AsyncClient) -> None:
    full = np.array(rows(await embed(http, input=[SHORT, LONG])))
    cut = np.array(rows(await embed(http, input=[SHORT, LONG], dimensions=2)))
    want = full[:, :2] / np.linalg.norm(full[:, :2], axis=1, keepdims=True)  # renormalized after the cut
    assert cut.shape == (2, 2) and np.allclose(cut, want, rtol=1e-6)
    for dims in (3, 4, 0, "2"):
        r = await embed(http, input=SHORT, dimensions=dims)
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request", dims


async def test_normalize_and_pooling_are_checked(http: httpx.AsyncClient) -> None:
    assert rows(await embed(http, input=SHORT, normalize=False, pooling="cls"))[0][1] == 4
    for field, value in (("normalize", "yes"), ("pooling", "max")):
        r = await embed(http, input=SHORT, **{field: value})
        assert r.status_code == 400 and field in r.json()["error"]["message"]


async def test_tokenize_and_detokenize(http: httpx.AsyncClient, bert: Tokenizer) -> None:
    r = await http.post("/tokenize", json={"model": MODEL, "prompt": LONG})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == bert.encode(LONG).ids and body["count"] == 12  # untruncated
    assert body["max_model_len"] == MAX_TOKENS and body["model"] == MODEL
    plain = (await http.post("/tokenize", json={"model": MODEL, "prompt": SHORT, "add_special_tokens": False})).json()
    assert plain["tokens"] == bert.encode(SHORT, add_special_tokens=False).ids
    # what /tokenize gives, /v1/embeddings takes back unchanged
    ids = (await http.post("/tokenize", json={"model": MODEL, "prompt": SHORT})).json()["tokens"]
    assert rows(await embed(http, input=ids))[0][:2] == rows(await embed(http, input=SHORT))[0][:2]
    r = await http.post("/detokenize", json={"model": MODEL, "tokens": ids})
    assert r.status_code == 200 and r.json() == {"model": MODEL, "prompt": bert.decode(ids, skip_special_tokens=False)}
    for bad in ({"model": MODEL, "tokens": [1, -2]}, {"model": MODEL, "tokens": "x"},
                {"model": MODEL, "prompt": 3}, {"model": MODEL}, {"model": MODEL, "prompt": "a", "messages": []},
                {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}):
        r = await http.post("/detokenize" if "tokens" in bad else "/tokenize", json=bad)
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request", bad
    r = await http.post("/tokenize", json={"model": "nope", "prompt": "x"})
    assert r.status_code == 404


async def test_tokenize_a_generate_model(http: httpx.AsyncClient) -> None:
    chat = ChatTokenizer.from_gguf(gguf_path())
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    r = await http.post("/tokenize", json={"model": DEFAULT_LM, "messages": messages})
    assert r.status_code == 200, r.text
    want = chat.encode(chat.apply_chat_template(messages, add_generation_prompt=True))
    assert r.json()["tokens"] == want and r.json()["max_model_len"] == 2048
    r = await http.post("/tokenize", json={"model": DEFAULT_LM, "messages": messages, "add_generation_prompt": False})
    assert r.json()["tokens"] == chat.encode(chat.apply_chat_template(messages, add_generation_prompt=False))
    prompt = (await http.post("/tokenize", json={"model": DEFAULT_LM, "prompt": "Hello world"})).json()["tokens"]
    assert prompt == chat.encode("Hello world")
    r = await http.post("/detokenize", json={"model": DEFAULT_LM, "tokens": want})
    assert r.json()["prompt"] == chat.apply_chat_template(messages, add_generation_prompt=True)
    r = await http.post("/detokenize", json={"model": DEFAULT_LM, "tokens": [49152]})
    assert r.status_code == 400 and "0..49151" in r.json()["error"]["message"]
