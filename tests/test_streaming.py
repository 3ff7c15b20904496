"""Streamed generation over HTTP (server-sent events in OpenAI's shape) against a scripted worker that advertises
the protocol extensions and streams a token every few milliseconds: the chunks, the real `openai` client, a
disconnect that cancels the worker's generation (no strike), and a crash mid-stream."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import trio

from tests.support.config import MODEL, daemon_config
from tests.support.fakes import fake_command
from tests.support.helpers import client_for, hang_up_mid_stream
from trio_gpuworker.daemon.config import DEFAULT_LM
from trio_gpuworker.daemon.main import Daemon

TOKEN_S = 0.005
CHAT = {"model": DEFAULT_LM, "messages": [{"role": "user", "content": "hi"}], "stream": True}


@pytest.fixture
async def daemon(tmp_path: Path, request: pytest.FixtureRequest) -> AsyncIterator[tuple[httpx.AsyncClient, Daemon]]:
    behavior = getattr(request, "param", None)
    async with trio.open_nursery() as nursery:
        client, d = await client_for(nursery, daemon_config(tmp_path, fake_command(),
                                                           lm=fake_command(behavior, stream_token_s=TOKEN_S)))
        async with client:
            yield client, d
        nursery.cancel_scope.cancel()


async def events(r: httpx.Response) -> AsyncIterator[Any]:
    """The `data:` payloads of a server-sent event stream, `[DONE]` as the string."""
    assert r.headers["content-type"] == "text/event-stream"
    async for line in r.aiter_lines():
        if line.startswith("data: "):
            data = line.removeprefix("data: ")
            yield data if data == "[DONE]" else json.loads(data)
        else:
            assert line == "", line


async def test_chat_stream_chunks(daemon: tuple[httpx.AsyncClient, Daemon]) -> None:
    http, _ = daemon
    body = {**CHAT, "max_tokens": 3, "stream_options": {"include_usage": True}}
    async with http.stream("POST", "/v1/chat/completions", json=body) as r:
        got = [e async for e in events(r)]
    assert r.status_code == 200
    assert got[-1] == "[DONE]"
    chunks = got[:-1]
    assert all(c["object"] == "chat.completion.chunk" and c["model"] == DEFAULT_LM for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": "", "refusal": None}  # the role first
    deltas = [c["choices"][0]["delta"].get("content", "") for c in chunks[1:-1]]
    assert "".join(deltas) == "t1 t2 t3 " and deltas[:3] == ["t1 ", "t2 ", "t3 "]
    finishes = [c["choices"][0]["finish_reason"] for c in chunks[:-1]]
    assert finishes[:-1] == [None] * (len(finishes) - 1) and finishes[-1] == "length"  # on the last chunk
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3  # include_usage
    assert all(c["usage"] is None for c in chunks[:-1])


async def test_completion_stream(daemon: tuple[httpx.AsyncClient, Daemon]) -> None:
    http, _ = daemon
    body = {"model": DEFAULT_LM, "prompt": "hi", "max_tokens": 2, "stream": True}
    async with http.stream("POST", "/v1/completions", json=body) as r:
        got = [e async for e in events(r)]
    texts = [c["choices"][0]["text"] for c in got[:-1]]
    assert "".join(texts) == "t1 t2 " and got[-2]["choices"][0]["finish_reason"] == "length"
    assert all("usage" not in c for c in got[:-1]) and got[-1] == "[DONE]"


async def test_bad_stream_fields_are_plain_errors(daemon: tuple[httpx.AsyncClient, Daemon]) -> None:
    http, _ = daemon
    for body, code in (({**CHAT, "stream_options": {"include_usage": True, "x": 1}}, "unsupported_field"),
                       ({**CHAT, "stream": False, "stream_options": {"include_usage": True}}, "invalid_request"),
                       ({**CHAT, "stream": "yes"}, "invalid_request"),
                       ({**CHAT, "temperature": 3}, "invalid_request"),
                       ({**CHAT, "stop": ["a", "b", "c", "d", "e"]}, "invalid_request"),
                       ({**CHAT, "logprobs": True, "top_logprobs": 6}, "invalid_request"),
                       ({**CHAT, "top_logprobs": 2}, "invalid_request"),
                       ({**CHAT, "max_tokens": 5000}, "invalid_request")):
        r = await http.post("/v1/chat/completions", json=body)
        assert r.status_code == 400 and r.json()["error"]["code"] == code, (body, r.text)


async def test_openai_client_streams(daemon: tuple[httpx.AsyncClient, Daemon]) -> None:
    http, _ = daemon

    def run() -> tuple[list[Any], list[Any]]:
        client = openai.OpenAI(base_url=str(http.base_url) + "/v1", api_key="unused", max_retries=0, timeout=30)
        with client:
            chat = list(client.chat.completions.create(model=DEFAULT_LM, messages=[{"role": "user", "content": "x"}],
                                                       max_tokens=4, stream=True,
                                                       stream_options={"include_usage": True}))
            cmpl = list(client.completions.create(model=DEFAULT_LM, prompt="x", max_tokens=2, stream=True))
        return chat, cmpl

    chat, cmpl = await trio.to_thread.run_sync(run)
    assert "".join(c.choices[0].delta.content or "" for c in chat if c.choices) == "t1 t2 t3 t4 "
    assert chat[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chat if c.choices][-1] == "length"
    assert chat[-1].usage is not None and chat[-1].usage.completion_tokens == 4
    assert "".join(c.choices[0].text for c in cmpl) == "t1 t2 "


async def test_a_disconnect_cancels_generation_without_a_strike(daemon: tuple[httpx.AsyncClient, Daemon]) -> None:
    http, d = daemon
    lane = d.sup.lanes["gen0"]
    generation = lane.generation
    got = await hang_up_mid_stream(str(http.base_url), "/v1/chat/completions", {**CHAT, "max_tokens": 1000}, 4)
    assert b" 200 " in got.split(b"\r\n", 1)[0]
    for _ in range(1000):  # the worker's stderr reaches the lane's log ring in its own time
        if "cancelled after" in lane.log.tail(4096):
            break
        await trio.sleep(0.01)
    line = next(x for x in lane.log.tail(4096).splitlines() if "cancelled after" in x)
    assert int(line.split("cancelled after ")[1].split()[0]) < 1000  # stopped, not drained to max_tokens
    assert lane.report.status()["strikes"] == 0 and lane.generation == generation  # no strike, no restart
    async with http.stream("POST", "/v1/chat/completions", json={**CHAT, "max_tokens": 2}) as r:
        got = [e async for e in events(r)]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in got[1:-1]) == "t1 t2 "


@pytest.mark.parametrize("daemon", ["crash_mid_request"], indirect=True)
async def test_a_crash_mid_stream_ends_it_with_a_typed_error(daemon: tuple[httpx.AsyncClient, Daemon]) -> None:
    http, _ = daemon
    async with http.stream("POST", "/v1/chat/completions", json={**CHAT, "max_tokens": 50}) as r:
        got = [e async for e in events(r)]
    assert r.status_code == 200 and got[-1] == "[DONE]"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in got[1:-2])
    # the first delta was sent a token interval before the crash, so it reached us; the second, written just
    # before os._exit, may go down with the worker; then the typed error, and nothing past what was streamed
    assert text in ("t1 ", "t1 t2 "), text
    assert got[-2]["error"]["code"] == "engine_crashed", got[-2]  # EngineCrashed, typed as everywhere


async def test_latency_histograms_per_model(daemon: tuple[httpx.AsyncClient, Daemon]) -> None:
    http, _ = daemon
    async with http.stream("POST", "/v1/chat/completions", json={**CHAT, "max_tokens": 5}) as r:
        assert len([e async for e in events(r)]) == 8  # role, 5 deltas, the finish, [DONE]
    assert (await http.post("/v1/embeddings", json={"model": MODEL, "input": ["a", "b c"]})).status_code == 200
    text = (await http.get("/metrics")).text
    counts = {name: float(line.split()[-1]) for line in text.splitlines()
              if (name := line.split("{")[0]).endswith("_count") and f'model="{DEFAULT_LM}"' in line}
    assert f'gpuworker_queue_wait_seconds_count{{model="{MODEL}"}} 1.0' in text  # an embedding waits too
    assert counts["gpuworker_queue_wait_seconds_count"] == 1
    assert counts["gpuworker_time_to_first_token_seconds_count"] == 1
    assert counts["gpuworker_inter_token_seconds_count"] == 4  # between 5 tokens


async def test_the_openai_client_leaving_mid_stream_cancels(daemon: tuple[httpx.AsyncClient, Daemon]) -> None:
    http, d = daemon
    lane = d.sup.lanes["gen0"]

    def run() -> int:
        client = openai.OpenAI(base_url=str(http.base_url) + "/v1", api_key="unused", max_retries=0, timeout=30)
        with client:
            stream = client.chat.completions.create(model=DEFAULT_LM, messages=[{"role": "user", "content": "x"}],
                                                    max_tokens=1000, stream=True)
            seen = 0
            for _ in stream:
                seen += 1
                if seen == 3:
                    stream.close()  # the client's own way to stop reading: it closes the connection
                    break
            return seen

    assert await trio.to_thread.run_sync(run) == 3
    for _ in range(1000):
        if "cancelled after" in lane.log.tail(4096):
            break
        await trio.sleep(0.01)
    line = next(x for x in lane.log.tail(4096).splitlines() if "cancelled after" in x)
    assert int(line.split("cancelled after ")[1].split()[0]) < 1000
    assert lane.report.status()["strikes"] == 0
