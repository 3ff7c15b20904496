"""Every field a route does not implement gets 400 `unsupported_field` naming it; the no-op fields are accepted at
the one value that leaves the answer unchanged, and that answer is the same as without them."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from tests.support.config import MODEL, daemon_config
from tests.support.fakes import fake_command
from tests.support.helpers import client_for
from trio_gpuworker._api_requests import CompletionRequest
from trio_gpuworker.daemon import http_fields
from trio_gpuworker.daemon.config import DEFAULT_LM

CHAT = {"model": DEFAULT_LM, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
COMPLETION = {"model": DEFAULT_LM, "prompt": "hi", "max_tokens": 3}
VALID: dict[str, dict[str, Any]] = {
    "/v1/embeddings": {"model": MODEL, "input": "hi"},
    "/v1/rerank": {"model": MODEL, "query": "q", "documents": ["a", "b"]},
    "/v2/rerank": {"model": MODEL, "query": "q", "documents": ["a", "b"]},
    "/rerank": {"query": "q", "texts": ["a", "b"]},
    "/tokenize": {"model": MODEL, "prompt": "hi"},
    "/detokenize": {"model": MODEL, "tokens": [101, 102]},
    "/v1/completions": COMPLETION,
    "/v1/chat/completions": CHAT,
    "/embed": {"inputs": "hi"},
    "/": {"inputs": "hi"},  # TEI's embed
    "/generate": {"inputs": "hi", "parameters": {"max_new_tokens": 3}},
}
# the neutral value of each no-op field, and one that would change the answer
NOOPS: dict[str, list[tuple[str, Any, Any]]] = {
    "/v1/completions": [("n", 1, 2), ("frequency_penalty", 0, 0.1), ("presence_penalty", 0.0, 1),
                        ("logit_bias", {}, {"1": 5}), ("best_of", 1, 3)],
    "/v1/chat/completions": [("n", 1, 3)],
    "/v2/rerank": [("priority", 0, 1)],
    "/rerank": [("truncation_direction", "right", "left")],
}
NEVER = {"/v1/completions": ["suffix"]}


@pytest.fixture
async def http(tmp_path: Path) -> AsyncIterator[httpx.AsyncClient]:
    async with trio.open_nursery() as nursery:
        client, _ = await client_for(nursery, daemon_config(tmp_path, fake_command(), lm=fake_command()))
        async with client:
            yield client
        nursery.cancel_scope.cancel()


def unsupported(r: httpx.Response, param: str) -> bool:
    err = r.json().get("error", {}) if r.status_code == 400 else {}
    return err.get("code") == "unsupported_field" and err.get("param") == param and param in err.get("message", "")


def answer(r: httpx.Response) -> Any:
    assert r.status_code == 200, r.text
    body = r.json()
    if isinstance(body, dict):
        body.pop("id", None)
        body.pop("created", None)
    return body


async def test_every_route_refuses_a_field_it_does_not_know(http: httpx.AsyncClient) -> None:
    for route, body in VALID.items():
        assert (await http.post(route, json=body)).status_code == 200, route
        for field in ("bogus", "temperature" if "rerank" in route or "token" in route else "mirostat", "a" * 100):
            r = await http.post(route, json={**body, field: 1})
            shown = field if len(field) <= 64 else field[:64] + "..."
            assert unsupported(r, shown), (route, field, r.text)
        # null stands for a known field left out; an unknown one is refused whatever its value
        assert unsupported(await http.post(route, json={**body, "bogus": None}), "bogus"), route


async def test_noops_only_at_their_neutral_value(http: httpx.AsyncClient) -> None:
    for route, fields in NOOPS.items():
        plain = answer(await http.post(route, json=VALID[route]))
        for field, neutral, other in fields:
            assert answer(await http.post(route, json={**VALID[route], field: neutral})) == plain, (route, field)
            assert answer(await http.post(route, json={**VALID[route], field: None})) == plain, (route, field)
            assert unsupported(await http.post(route, json={**VALID[route], field: other}), field), (route, field)
            if isinstance(neutral, int | float):  # a bool is not the number
                assert unsupported(await http.post(route, json={**VALID[route], field: True}), field), field
    for route, fields in NEVER.items():
        for field in fields:
            assert unsupported(await http.post(route, json={**VALID[route], field: 1}), field), (route, field)


async def test_message_fields(http: httpx.AsyncClient) -> None:
    msg = {"role": "user", "content": "hi"}
    for messages, param in (([msg, {**msg, "tool_call_id": "x"}], "messages[1].tool_call_id"),
                            ([{"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": {}}]}],
                             "messages[0].content[0].cache_control")):
        assert unsupported(await http.post("/v1/chat/completions", json={**CHAT, "messages": messages}), param)
    parts = [{"role": "user", "content": [{"type": "text", "text": "h"}, {"type": "text", "text": "i"}]}]
    same = answer(await http.post("/v1/chat/completions", json={**CHAT, "messages": parts}))
    assert same["choices"] == answer(await http.post("/v1/chat/completions", json=CHAT))["choices"]
    # a participant's name is taken (the chat template sees it), as OpenAI and vLLM take it
    named = await http.post("/v1/chat/completions", json={**CHAT, "messages": [{**msg, "name": "bob"}]})
    assert named.status_code == 200, named.text
    r = await http.post("/v1/chat/completions", json={**CHAT, "max_completion_tokens": 4})
    assert r.status_code == 400 and "max_tokens and max_completion_tokens differ" in r.text
    assert (await http.post("/v1/chat/completions", json={**CHAT, "max_completion_tokens": 3})).status_code == 200


def test_spec_checks_answer_any_value() -> None:
    """A spec's checks run on values the handler never sees: each must answer for any JSON value."""
    samples: list[Any] = [None, 0, 1, -1, 0.5, True, False, "", "x", [], [1], {}, {"a": 1}]
    tgi_parameters = CompletionRequest.nested_fields("tgi", ("inputs", "stream"))[1]
    for spec in (http_fields.COMPLETIONS, http_fields.CHAT, http_fields.RERANK, http_fields.RERANK_TEI,
                 http_fields.TEI_EMBED, http_fields.TGI, tgi_parameters):
        for check in spec.values():
            for v in samples:
                if check is not None:
                    assert check(v) is None or isinstance(check(v), str)
