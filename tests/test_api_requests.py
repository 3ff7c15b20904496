"""The typed API requests (_api_requests.py): one validation path from Python arguments or a JSON body, the HTTP
routes' field tables derived from their fields, and `to_wire()` giving the protocol messages the daemon has always
sent, byte for byte."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import cbor2
import numpy as np
import pytest

from tests.support.config import MODEL, REAL_WORKER, supervisor_config
from trio_gpuworker import ModelConfig, SupervisorConfig
from trio_gpuworker._api_requests import CompletionRequest, EmbeddingsRequest, RerankRequest
from trio_gpuworker._errors import InvalidRequest, ModelNotFound, RequestTooLarge, UnsupportedField
from trio_gpuworker._proto import EmbedBatch, Generate, Rerank, WireMessage
from trio_gpuworker.daemon import http_fields

LM = "lm"
IDS = np.array([1, 2, 3], dtype="<i4")
# Every route's fields as the hand-written tables listed them before they were derived from the requests, and
# those added since (Voyage's top_k and truncation; structured output's parallel_tool_calls)
GENERATION = {"model", "max_tokens", "grammar", "stream", "stream_options", "temperature", "top_p", "top_k", "seed",
              "stop", "logprobs", "user", "n", "frequency_penalty", "presence_penalty", "logit_bias"}
TABLES = {
    "EMBEDDINGS": {"model", "input", "encoding_format", "dimensions", "user", "truncate", "normalize", "pooling"},
    "RERANK": {"model", "query", "documents", "top_n", "top_k", "return_documents", "max_tokens_per_doc", "truncate",
               "truncation", "priority"},
    "RERANK_TEI": {"model", "query", "texts", "raw_scores", "return_text", "truncate", "truncation_direction"},
    "COMPLETIONS": GENERATION | {"prompt", "best_of", "echo", "suffix"},
    "CHAT": GENERATION | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
                          "response_format", "parallel_tool_calls"},
}
NEUTRAL = {"RERANK": {"priority"}, "RERANK_TEI": {"truncation_direction"},
           "COMPLETIONS": {"n", "frequency_penalty", "presence_penalty", "logit_bias", "best_of", "suffix"},
           "CHAT": {"n", "frequency_penalty", "presence_penalty", "logit_bias"}}


@pytest.fixture
def models(tmp_path: Path) -> SupervisorConfig:
    embed = ModelConfig(MODEL, tmp_path / "model.safetensors", matryoshka_dims=(2,), max_tokens=8)
    lm = ModelConfig(LM, tmp_path / "lm.gguf", kind="generate", format="gguf")
    return supervisor_config(tmp_path, models=(embed, lm), state_dir=tmp_path, **REAL_WORKER)


def wire(msg: WireMessage) -> tuple[str, bytes, bytes | memoryview | None]:
    """The control map and raw frame as the daemon writes them."""
    return msg.T, cbor2.dumps({**msg.to_fields(), "t": msg.T}), msg.payload()


def test_route_tables_are_the_requests_fields() -> None:
    for name, fields in TABLES.items():
        table = getattr(http_fields, name)
        assert set(table) == fields, name
        assert {k for k, check in table.items() if check is not None} == NEUTRAL.get(name, set()), name


def test_embeddings_from_python_and_from_json_are_one_request(models: SupervisorConfig) -> None:
    plain = EmbeddingsRequest(models=models, model=MODEL, input=["a"])
    assert (plain.pooling, plain.normalize, plain.truncate, plain.encoding_format) == ("mean", True, True, "float")
    assert EmbeddingsRequest.from_json({"model": MODEL, "input": "a", "pooling": None}, models, max_inputs=4) == plain
    ids = EmbeddingsRequest.from_json({"model": MODEL, "input": [101, 102]}, models, max_inputs=4)
    assert ids.is_ids and ids.input == [[101, 102]]
    rows = [np.array([101, 7, 102], np.int32), np.array([5], np.int32)]
    old = EmbedBatch(model_ref=MODEL, pooling="mean", normalize=True,
                     items=[{"id": 0, "n_tokens": 3}, {"id": 1, "n_tokens": 1}],
                     raw=np.concatenate(rows).astype("<i4").tobytes())
    assert wire(plain.to_wire(rows)) == wire(old)


@pytest.mark.parametrize(("args", "error", "match"), [
    ({"model": "nope"}, ModelNotFound, "nope"),
    ({"model": LM}, InvalidRequest, "serves generate, not embeddings"),
    ({"model": 3}, InvalidRequest, "'model' must be a string"),
    ({"input": "a"}, InvalidRequest, "list of strings"),
    ({"input": ["a", 1]}, InvalidRequest, r"input\[1\]"),
    ({"pooling": "weightedmean"}, InvalidRequest, "pooling"),
    ({"normalize": 1}, InvalidRequest, "normalize"),
    ({"truncate": "no"}, InvalidRequest, "truncate"),
    ({"dimensions": 3}, InvalidRequest, "dimensions must be one of 2"),
    ({"encoding_format": "int8"}, InvalidRequest, "encoding_format"),
    ({"user": 5}, InvalidRequest, "'user' must be a string"),
])
def test_embeddings_refusals(models: SupervisorConfig, args: dict[str, Any], error: type[Exception],
                             match: str) -> None:
    with pytest.raises(error, match=match):
        EmbeddingsRequest(models=models, **{"model": MODEL, "input": ["a"], **args})


def test_embeddings_json_rules(models: SupervisorConfig) -> None:
    with pytest.raises(ModelNotFound):  # the model first, before the body's other fields
        EmbeddingsRequest.from_json({"model": "nope", "input": 7}, models, max_inputs=4)
    with pytest.raises(InvalidRequest, match="max_inputs"):
        EmbeddingsRequest.from_json({"model": MODEL, "input": ["a"] * 5}, models, max_inputs=4)
    with pytest.raises(InvalidRequest, match="non-empty"):
        EmbeddingsRequest.from_json({"model": MODEL, "input": []}, models, max_inputs=4)


def test_rerank_shapes_are_one_request(models: SupervisorConfig) -> None:
    plain = RerankRequest(models=models, model=MODEL, query="q", documents=["a", "b"], return_documents=True)
    cohere = {"model": MODEL, "query": "q", "documents": [{"text": "a"}, "b"], "return_documents": True}
    with pytest.raises(InvalidRequest, match=r"documents\[0\] is dict"):  # all {text} or all strings
        RerankRequest.from_json(cohere, models, max_inputs=4)
    assert RerankRequest.from_json({**cohere, "documents": [{"text": "a"}, {"text": "b"}]}, models,
                                   max_inputs=4) == plain
    tei = RerankRequest.from_json({"query": "q", "texts": ["a", "b"], "return_text": True}, models, max_inputs=4,
                                  shape="tei")
    assert tei == plain  # TEI's body names no model: the one that can rerank
    q, docs = np.array([101, 5, 102], np.int32), [np.array([7, 102], np.int32), np.array([8, 9], np.int32)]
    old = Rerank(model_ref=MODEL, query_n_tokens=3, candidates=[{"n_tokens": 2}, {"n_tokens": 2}],
                 raw=np.concatenate([q, *docs]).astype("<i4").tobytes())
    assert wire(plain.to_wire(q, docs)) == wire(old)
    voyage = RerankRequest.from_json({"model": MODEL, "query": "q", "documents": ["a", "b"], "top_k": 1}, models,
                                     max_inputs=4)
    assert voyage.top_n == 1  # Voyage's name for Cohere's top_n
    for bad in ({"query": "", "documents": ["a"]}, {"query": "q", "documents": ["a"], "top_n": 0},
                {"query": "q", "documents": ["a"], "top_n": 1, "top_k": 2},
                {"query": "q", "documents": ["a"], "top_k": 0},
                {"query": "q", "documents": ["a"], "max_tokens_per_doc": True}):
        with pytest.raises(InvalidRequest):
            RerankRequest.from_json({"model": MODEL, **bad}, models, max_inputs=4)
    with pytest.raises(InvalidRequest, match="query must be a string"):
        RerankRequest(models=models, model=MODEL, query=None, documents=[])  # type: ignore[arg-type]


def test_completion_wire_is_the_reference_generate(models: SupervisorConfig) -> None:
    greedy = CompletionRequest(models=models, model=LM, prompt="hi", temperature=0, top_p=0.5, seed=3)
    assert greedy.sampling == {}  # greedy: nothing else changes the answer, nothing else is sent
    assert greedy.max_tokens is None  # none named: resolved against the prompt when it is tokenized
    assert wire(greedy.to_wire(IDS, 16, stream=False)) == wire(Generate(model_ref=LM, max_tokens=16,
                                                                        raw=IDS.tobytes()))
    sampled = CompletionRequest(models=models, model=LM, prompt="hi", max_tokens=5, temperature=0.7, top_p=1,
                                top_k=40, seed=3, stop="x", logprobs=2, grammar="")
    old = Generate(model_ref=LM, max_tokens=5, stream=True, temperature=0.7, top_k=40, seed=3, stop=["x"],
                   logprobs=2, raw=IDS.tobytes())
    assert wire(sampled.to_wire(IDS, 5, stream=True)) == wire(old)
    # echo with logprobs asks the worker for the prompt's logprobs too (the PROMPT_LOGPROBS extension)
    echo = CompletionRequest(models=models, model=LM, prompt=[5, 6], max_tokens=1, logprobs=1, echo=True)
    assert echo.prompt_ids == [5, 6] and echo.texts == []
    assert echo.to_wire(IDS, 1, stream=False).to_fields()["prompt_logprobs"] == 1
    plain_echo = CompletionRequest(models=models, model=LM, prompt="hi", echo=True)
    assert "prompt_logprobs" not in plain_echo.sampling


def test_chat_and_completion_bodies(models: SupervisorConfig) -> None:
    body = {"model": LM, "messages": [{"role": "user", "content": [{"type": "text", "text": "h"},
                                                                   {"type": "text", "text": "i"}]}],
            "max_completion_tokens": 4, "logprobs": True, "top_logprobs": 2, "stream": True,
            "stream_options": {"include_usage": True}}
    chat = CompletionRequest.from_json(body, models, shape="chat")
    assert chat == CompletionRequest(models=models, model=LM, messages=[{"role": "user", "content": "hi"}],
                                     max_tokens=4, logprobs=2, stream=True, include_usage=True)
    assert chat.template_bytes == 64
    [cmpl] = CompletionRequest.from_json_prompts({"model": LM, "prompt": ["hi"], "max_tokens": 3, "logprobs": 1},
                                                 models, max_inputs=4)
    assert (cmpl.prompt, cmpl.max_tokens, cmpl.logprobs, cmpl.stream) == ("hi", 3, 1, False)
    # vLLM's prompts: a string, token ids, or a list of either; one request each, in order
    for prompt, want in (("a", ["a"]), ([1, 2], [[1, 2]]), (["a", "b"], ["a", "b"]), ([[1], [2, 3]], [[1], [2, 3]]),
                         (["a", [4]], ["a", [4]])):
        got = CompletionRequest.from_json_prompts({"model": LM, "prompt": prompt}, models, max_inputs=4)
        assert [r.prompt for r in got] == want, prompt
        assert [r.prompt_ids for r in got] == [p if isinstance(p, list) else None for p in want]
    for prompt, match in (([], "non-empty list"), (["a"] * 5, "at most 4"), ([1.5], r"prompt\[0\] must be"),
                          ([[1, "x"]], "non-empty string or a non-empty list of token ids"),
                          ([[]], "non-empty string or a non-empty list of token ids"),
                          ([1] * 2048, "context is 2048")):
        with pytest.raises((InvalidRequest, RequestTooLarge), match=match):
            CompletionRequest.from_json_prompts({"model": LM, "prompt": prompt}, models, max_inputs=4)
    with pytest.raises(InvalidRequest, match="a stream takes one prompt"):
        CompletionRequest.from_json_prompts({"model": LM, "prompt": ["a", "b"], "stream": True}, models, max_inputs=4)
    # a participant's name reaches the chat template
    named = CompletionRequest.from_json({"model": LM, "messages": [{"role": "user", "content": "x", "name": "bob"}]},
                                        models, shape="chat")
    assert named.messages == [{"role": "user", "content": "x", "name": "bob"}]
    refusals: list[tuple[dict[str, Any], type[Exception], str]] = [
        ({"max_tokens": 3, "max_completion_tokens": 4}, InvalidRequest, "differ"),
        ({"logprobs": 2}, InvalidRequest, "'logprobs' must be a boolean"),
        ({"top_logprobs": 2}, InvalidRequest, "needs 'logprobs'"),
        ({"stream_options": {"include_usage": True}}, InvalidRequest, "only allowed with 'stream'"),
        ({"stream": True, "stream_options": {"x": 1}}, UnsupportedField, "stream_options.x"),
        ({"messages": [{"role": "user", "content": "x", "name": 3}]}, InvalidRequest, r"messages\[0\].name must be"),
        ({"messages": [{"role": "user", "content": "x", "x_unknown": "a"}]}, UnsupportedField,
         r"messages\[0\].x_unknown"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, InvalidRequest, "only text parts"),
        ({"messages": [{"role": "user"}]}, InvalidRequest, r"messages\[0\] must be"),
    ]
    for extra, error, match in refusals:
        with pytest.raises(error, match=match):
            CompletionRequest.from_json({**body, "stream": None, "stream_options": None, "logprobs": None,
                                         "top_logprobs": None, "max_completion_tokens": None, **extra}, models,
                                        shape="chat")


@pytest.mark.parametrize(("args", "error", "match"), [
    ({"model": MODEL}, InvalidRequest, "serves embedding, not generation"),
    ({"prompt": None}, InvalidRequest, "exactly one of prompt or messages"),
    ({"messages": [{"role": "user", "content": "x"}]}, InvalidRequest, "exactly one of prompt or messages"),
    ({"prompt": ""}, InvalidRequest, "non-empty string"),
    ({"max_tokens": 0}, InvalidRequest, "max_tokens"),
    ({"max_tokens": 2048}, InvalidRequest, r"1\.\.2047"),
    ({"grammar": 3}, InvalidRequest, "'grammar' must be a string"),
    ({"temperature": 2.5}, InvalidRequest, "temperature"),
    ({"top_p": 0}, InvalidRequest, "top_p must be in"),
    ({"seed": -1}, InvalidRequest, "seed"),
    ({"stop": ["a"] * 5}, InvalidRequest, "at most 4"),
    ({"stop": "x\ud800"}, InvalidRequest, "lone surrogate"),
    ({"logprobs": 6}, InvalidRequest, "logprobs"),
    ({"echo": 1}, InvalidRequest, "echo"),
    ({"echo": True, "stream": True}, UnsupportedField, "echo"),
    ({"prompt": None, "messages": [{"role": "user", "content": "x"}], "echo": True}, InvalidRequest,
     "echo takes a prompt"),
    ({"prompt": "x" * (2048 * 128 + 1)}, RequestTooLarge, "characters"),
    ({"prompt": "x\udfff"}, InvalidRequest, r"prompt\[0\] is not valid Unicode"),
])
def test_completion_refusals(models: SupervisorConfig, args: dict[str, Any], error: type[Exception],
                             match: str) -> None:
    with pytest.raises(error, match=match):
        CompletionRequest(models=models, **{"model": LM, "prompt": "hi", **args})


def test_requests_are_frozen(models: SupervisorConfig) -> None:
    request = EmbeddingsRequest(models=models, model=MODEL, input=["a"])
    with pytest.raises(dataclasses.FrozenInstanceError):
        request.truncate = False  # type: ignore[misc]
