"""The real `openai` client against the daemon: embeddings, completions, chat completions (fake workers; the
generate model's GGUF is real because the daemon tokenizes with it)."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
import trio

from tests.support.config import MODEL, daemon_config
from tests.support.fakes import fake_command
from tests.support.reference_llama import gguf_path
from trio_gpuworker.daemon.config import DEFAULT_LM
from trio_gpuworker.daemon.main import run_daemon
from trio_gpuworker.llm_tokenizer import ChatTokenizer


@pytest.fixture(scope="module")
def chat_tokenizer() -> ChatTokenizer:
    return ChatTokenizer.from_gguf(gguf_path())


async def test_openai_client_end_to_end(tmp_path: Path, chat_tokenizer: ChatTokenizer) -> None:
    async with trio.open_nursery() as nursery:
        binds = (await nursery.start(run_daemon, daemon_config(tmp_path, fake_command(), lm=fake_command()))).binds
        client = openai.OpenAI(base_url=binds[0] + "/v1", api_key="unused", max_retries=0, timeout=30)

        def calls() -> dict[str, object]:
            out: dict[str, object] = {}
            # the client asks for base64 by default and decodes it
            out["emb"] = client.embeddings.create(model=MODEL, input=["hello world", "a"])
            out["emb_float"] = client.embeddings.create(model=MODEL, input="a", encoding_format="float")
            out["cmpl"] = client.completions.create(model=DEFAULT_LM, prompt="The capital of France is",
                                                    max_tokens=2)
            # no max_tokens: a plain v3 worker (no long generation) makes what it can, it is not refused
            out["no_max"] = client.completions.create(model=DEFAULT_LM, prompt="The capital of France is")
            out["chat"] = client.chat.completions.create(
                model=DEFAULT_LM, max_tokens=8, messages=[{"role": "user", "content": "Say hi"}])
            out["models"] = client.models.list()
            # greedy no-ops are accepted at the value that changes nothing
            out["greedy"] = client.chat.completions.create(
                model=DEFAULT_LM, max_tokens=8, temperature=0, top_p=1, n=1, stream=False, presence_penalty=0,
                messages=[{"role": "user", "content": "Say hi"}])
            out["ids"] = client.embeddings.create(model=MODEL, input=[[101, 7592, 102], [101, 102]])
            for name, kwargs in (("stream", {"stream": True}), ("too_long", {"max_tokens": 65}),
                                 ("grammar", {"extra_body": {"grammar": 'root ::= "x"'}}), ("temperature",
                                 {"temperature": 0.8}), ("seed", {"seed": 1}), ("stop", {"stop": ["\n"]}),
                                 ("top_p", {"top_p": 0.9}), ("n", {"n": 2}), ("logprobs", {"logprobs": 1}),
                                 ("top_k", {"extra_body": {"top_k": 5}})):
                try:
                    client.completions.create(model=DEFAULT_LM, prompt="x", **kwargs)
                except openai.BadRequestError as exc:
                    out[name] = exc
            for name, kwargs in (("chat_stream", {"stream": True}), ("chat_temperature", {"temperature": 1.0}),
                                 ("chat_tools", {"tools": [{"type": "function", "function": {"name": "f"}}]})):
                try:
                    client.chat.completions.create(model=DEFAULT_LM, messages=[{"role": "user", "content": "x"}],
                                                   **kwargs)
                except openai.BadRequestError as exc:
                    out[name] = exc
            try:
                client.embeddings.create(model=MODEL, input="x", dimensions=2)
            except openai.BadRequestError as exc:
                out["dimensions"] = exc
            try:
                client.embeddings.create(model="nope", input="x")
            except openai.NotFoundError as exc:
                out["missing"] = exc
            return out

        out = await trio.to_thread.run_sync(calls)
        client.close()
        nursery.cancel_scope.cancel()

    emb = out["emb"]
    assert [d.index for d in emb.data] == [0, 1] and emb.model == MODEL
    assert emb.data[0].embedding[1] == 4.0 and emb.data[1].embedding[1] == 3.0  # n_tokens: daemon-side tokenization
    assert emb.usage.prompt_tokens == 7
    assert out["emb_float"].data[0].embedding[1] == 3.0

    cmpl = out["cmpl"]
    ids = chat_tokenizer.encode("The capital of France is")
    assert cmpl.choices[0].text == f"fake {sum(ids)}"  # the fake's TEXT is the sum of the ids it was sent
    assert cmpl.choices[0].finish_reason == "length" and cmpl.object == "text_completion"
    assert cmpl.usage.prompt_tokens == len(ids) and cmpl.usage.completion_tokens == 2
    assert out["no_max"].choices[0].finish_reason == "stop" and out["no_max"].usage.completion_tokens == 3

    chat = out["chat"]
    prompt = chat_tokenizer.apply_chat_template([{"role": "user", "content": "Say hi"}], add_generation_prompt=True)
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content == f"fake {sum(chat_tokenizer.encode(prompt))}"
    assert chat.choices[0].finish_reason == "stop" and chat.usage.completion_tokens == 3

    assert {m.id for m in out["models"].data} == {MODEL, DEFAULT_LM}
    assert out["greedy"].choices[0].message.content == chat.choices[0].message.content
    # token ids are embedded as given: the fake's columns are sum(ids) and n_tokens
    assert [d.embedding[:2] for d in out["ids"].data] == [[101 + 7592 + 102, 3.0], [203.0, 2.0]]
    assert out["ids"].usage.prompt_tokens == 5
    assert out["too_long"].status_code == 400 and out["too_long"].body["code"] == "invalid_request"
    for name in ("n",):
        err = out[name]
        assert err.status_code == 400 and err.body["code"] == "unsupported_field", name
        assert err.body["param"] == name.removeprefix("chat_"), name  # the field is named
    # the fake is a plain v3 worker: what needs an extension it did not advertise is refused, typed, never downgraded
    for name in ("stream", "temperature", "stop", "logprobs", "chat_stream", "chat_temperature", "grammar",
                 "chat_tools"):
        err = out[name]
        assert err.status_code == 400 and err.body["code"] == "invalid_request", name
        assert "this worker does not support" in err.body["message"], name
    for name in ("seed", "top_p", "top_k"):  # at temperature 0 (greedy) they change nothing: accepted
        assert name not in out, name
    assert out["dimensions"].body["code"] == "invalid_request" and "matryoshka" in out["dimensions"].body["message"]
    assert out["missing"].body["code"] == "model_not_found"
