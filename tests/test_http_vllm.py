"""vLLM's and OpenAI's completion shapes against a real daemon and worker serving a tiny random GGUF: prompts as
lists of strings and of token ids, `echo` with the prompt's logprobs (against an independent numpy forward pass),
a left-out `max_tokens` generating until the end of generation or the context, `/v1/models/{id}`,
`/tokenizer_info` and `/tokenize` without a model, and OpenAI's error and answer objects field for field, through
the real `openai` client and as raw JSON."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import trio

pytest.importorskip("gguf")

from tests.support.reference_llama import NumpyLlama, scored_prompt
from tests.support.serving import serving
from tests.support.tiny_gguf import EOS, Dims, write_llama
from trio_gpuworker import ModelConfig
from trio_gpuworker.llm_tokenizer import ChatTokenizer

pytestmark = pytest.mark.slow
MODEL = "tiny"
CONTEXT = Dims().context  # the GGUF's context_length; the model's max_context is left at its default (2048)
LOGPROB_TOLERANCE = 2e-3  # the worker's float32 kernels against numpy's float32, in nats


@pytest.fixture(scope="module")
def gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_llama(tmp_path_factory.mktemp("tiny") / "tiny.gguf", {})  # every tensor F32


async def test_vllm_shapes_echo_logprobs_and_defaults(tmp_path: Path, gguf: Path) -> None:
    tok, ref = ChatTokenizer.from_gguf(gguf), NumpyLlama(gguf)
    prompts = ["the tiny model", "a second prompt"]
    ids = [tok.encode(p, add_special=True) for p in prompts]
    async with serving(tmp_path, ModelConfig(MODEL, gguf, kind="generate", format="gguf")) as base:
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60)

        def sdk() -> dict[str, Any]:
            out: dict[str, Any] = {}
            out["list"] = client.completions.create(model=MODEL, prompt=prompts, max_tokens=3)
            out["ids"] = client.completions.create(model=MODEL, prompt=ids, max_tokens=3)
            out["one_ids"] = client.completions.create(model=MODEL, prompt=ids[0], max_tokens=3)
            out["echo"] = client.completions.create(model=MODEL, prompt=ids, max_tokens=1, logprobs=2, echo=True)
            out["echo_text"] = client.completions.create(model=MODEL, prompt=prompts[0], max_tokens=2, echo=True)
            out["model"] = client.models.retrieve(MODEL)
            out["chat"] = client.chat.completions.create(
                model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "hi", "name": "ann"}])
            for name, call in (("missing", lambda: client.models.retrieve("nope")),
                               ("bad_ids", lambda: client.completions.create(model=MODEL, prompt=[[1, 9999]])),
                               ("suffix", lambda: client.completions.create(model=MODEL, prompt="x", suffix="y"))):
                try:
                    call()
                except openai.APIStatusError as exc:
                    out[name] = exc
            return out

        out = await trio.to_thread.run_sync(sdk)
        client.close()
        async with httpx.AsyncClient(base_url=base, timeout=60) as http:
            raw = {
                "cmpl": (await http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2})),
                "chat": (await http.post("/v1/chat/completions", json={
                    "model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})),
                # no max_tokens: until the end of generation or the GGUF's 256-token context
                "long": (await http.post("/v1/completions", json={"model": MODEL, "prompt": prompts[0]})),
                "info": await http.get("/tokenizer_info"),
                "tokenize": await http.post("/tokenize", json={"prompt": prompts[0]}),
                "detokenize": await http.post("/detokenize", json={"tokens": ids[0]}),
                "models": await http.get("/v1/models"),
                "missing": await http.get("/v1/models/nope"),
            }

    # a list of prompts is one choice each, in order, their usage summed; token ids are the same prompts
    for name in ("list", "ids"):
        r = out[name]
        assert [c.index for c in r.choices] == [0, 1], name
        assert r.usage.prompt_tokens == sum(map(len, ids)) and r.usage.completion_tokens == 6, name
    assert [c.text for c in out["ids"].choices] == [c.text for c in out["list"].choices]
    assert out["one_ids"].choices[0].text == out["list"].choices[0].text

    # echo with logprobs: the prompt's tokens, the first null, each scored as the independent forward pass does
    for choice, p in zip(out["echo"].choices, ids, strict=True):
        lp = choice.logprobs
        assert lp.tokens[: len(p)] == [tok.decode([i]) for i in p] and len(lp.tokens) == len(p) + 1
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert np.allclose(lp.token_logprobs[1: len(p)], scored_prompt(ref, p), atol=LOGPROB_TOLERANCE)
        # the 2 most likely (one key where both decode to the same text: a byte of a multi-byte character)
        assert all(len(t) in (1, 2) and max(t.values()) >= v - 1e-6 for t, v in
                   zip(lp.top_logprobs[1:], lp.token_logprobs[1:], strict=True))
        assert choice.text.startswith(tok.decode(p))
    # echo without logprobs: the prompt's text, then the completion
    plain = out["echo_text"].choices[0]
    assert plain.text.startswith(prompts[0]) and plain.logprobs is None

    # the model object, with vLLM's max_model_len: the GGUF's context caps the configured 2048
    assert (out["model"].id, out["model"].object, out["model"].max_model_len) == (MODEL, "model", CONTEXT)
    assert out["chat"].choices[0].message.refusal is None

    # errors: OpenAI's four fields, so the client's type, code and param are set
    missing = out["missing"]
    assert isinstance(missing, openai.NotFoundError)
    assert (missing.type, missing.code, missing.param) == ("invalid_request_error", "model_not_found", None)
    assert out["bad_ids"].status_code == 400 and "token ids are integers in 0..259" in out["bad_ids"].message
    assert (out["suffix"].type, out["suffix"].code, out["suffix"].param) == ("invalid_request_error",
                                                                           "unsupported_field", "suffix")

    # the raw JSON, field for field
    cmpl = raw["cmpl"].json()
    assert set(cmpl) == {"id", "object", "created", "model", "system_fingerprint", "choices", "usage"}
    assert cmpl["system_fingerprint"] is None and cmpl["object"] == "text_completion"
    assert set(cmpl["choices"][0]) == {"index", "text", "logprobs", "finish_reason"}
    assert cmpl["choices"][0]["logprobs"] is None
    chat = raw["chat"].json()
    assert set(chat) == {"id", "object", "created", "model", "system_fingerprint", "choices", "usage"}
    [choice] = chat["choices"]
    assert set(choice) == {"index", "message", "logprobs", "finish_reason"} and choice["logprobs"] is None
    assert choice["message"] == {"role": "assistant", "content": choice["message"]["content"], "refusal": None}
    err = raw["missing"].json()["error"]
    assert raw["missing"].status_code == 404 and {"type", "message", "param", "code"} <= set(err)

    # no max_tokens: greedy until EOS or the context, as the reference decodes it
    long = raw["long"].json()
    room = CONTEXT - len(ids[0])
    greedy, _ = ref.generate(ids[0], room)
    want = greedy.index(EOS) if EOS in greedy else room
    assert long["usage"]["completion_tokens"] == want > 16, long["usage"]
    assert long["choices"][0]["finish_reason"] == ("stop" if want < room else "length")

    # vLLM's tokenizer routes without a model: the one generate model's
    info = raw["info"].json()
    assert info["eos_token"] == "<|im_end|>" and info["bos_token"] is None
    assert info["model_max_length"] == CONTEXT and "im_start" in info["chat_template"]
    assert raw["tokenize"].json()["tokens"] == ids[0] and raw["tokenize"].json()["max_model_len"] == CONTEXT
    assert raw["detokenize"].json()["prompt"] == prompts[0]
    assert [m["max_model_len"] for m in raw["models"].json()["data"]] == [CONTEXT]


async def test_default_max_tokens_caps_a_request_that_names_none(tmp_path: Path, gguf: Path) -> None:
    capped = ModelConfig("capped", gguf, kind="generate", format="gguf", default_max_tokens=3)
    free = ModelConfig(MODEL, gguf, kind="generate", format="gguf", runtime_config={"max_context": 64})
    async with serving(tmp_path, capped, free) as base, httpx.AsyncClient(base_url=base, timeout=60) as http:
        body = {"prompt": "the tiny model"}
        r = await http.post("/v1/completions", json={**body, "model": "capped"})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 3, r.text
        assert r.json()["choices"][0]["finish_reason"] == "length" or r.json()["usage"]["completion_tokens"] < 3
        # a max_tokens named is the caller's, past the default
        r = await http.post("/v1/completions", json={**body, "model": "capped", "max_tokens": 5, "stop": "\x00"})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] in range(1, 6)
        # max_context, when lower than the GGUF's, is the context the default fills
        r = await http.get("/v1/models/tiny")
        assert r.json()["max_model_len"] == 64
        # two generate models: the tokenizer routes need a model
        r = await http.post("/tokenize", json={"prompt": "x"})
        assert r.status_code == 400 and "'model' is required" in r.json()["error"]["message"]
        r = await http.get("/tokenizer_info")
        assert r.status_code == 400 and "'model' is required" in r.json()["error"]["message"]
        r = await http.get("/tokenizer_info", params={"model": "tiny"})
        assert r.status_code == 200 and r.json()["model_max_length"] == 64
        r = await http.get("/tokenizer_info", params={"model": "nope"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        r = await http.post("/tokenize", json={"prompt": "x", "model": "capped"})
        assert r.status_code == 200 and r.json()["max_model_len"] == CONTEXT
