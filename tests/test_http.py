"""The HTTP API over a real socket with a real HTTP client; fake workers, the real MiniLM tokenizer."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import trio

from tests.support.config import MODEL, daemon_config
from tests.support.fakes import fake_command
from tests.support.helpers import client_for, wait_until
from trio_gpuworker.supervisor import LaneState


@pytest.fixture
async def http(tmp_path: Path) -> AsyncIterator[httpx.AsyncClient]:
    async with trio.open_nursery() as nursery:
        client, _ = await client_for(nursery, daemon_config(tmp_path, fake_command()))
        async with client:
            yield client
        nursery.cancel_scope.cancel()


async def test_embeddings_openai_shape(http: httpx.AsyncClient) -> None:
    r = await http.post("/v1/embeddings", json={"model": MODEL, "input": ["hello world", "a"]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["model"] == MODEL
    assert [d["index"] for d in body["data"]] == [0, 1]
    # the fake worker's row is [sum(ids), n_tokens, item, req_id]: n_tokens shows daemon-side tokenization
    assert body["data"][0]["embedding"][1] == 4.0  # [CLS] hello world [SEP]
    assert body["data"][1]["embedding"][1] == 3.0
    assert body["usage"] == {"prompt_tokens": 7, "total_tokens": 7}
    r = await http.post("/v1/embeddings", json={"model": MODEL, "input": "just one"})
    assert len(r.json()["data"]) == 1


async def test_healthz_lanes_models(http: httpx.AsyncClient) -> None:
    r = await http.get("/healthz")
    assert r.status_code == 200
    lane = r.json()["lanes"][0]
    assert lane["lane_id"] == "lane0" and lane["state"] == "ready" and lane["generation"] == 1 and lane["pid"] > 0
    r = await http.get("/v1/lanes")
    assert r.json()["data"][0]["models"] == [MODEL]
    r = await http.get("/v1/models")
    assert r.json()["data"][0]["id"] == MODEL


@pytest.mark.parametrize(("kwargs", "status", "code"), [
    ({"content": b"{not json"}, 400, "invalid_json"),
    ({"json": [1, 2]}, 400, "invalid_request"),
    ({"json": {"model": MODEL}}, 400, "invalid_request"),
    ({"json": {"model": MODEL, "input": []}}, 400, "invalid_request"),
    ({"json": {"model": MODEL, "input": [1, "a"]}}, 400, "invalid_request"),  # neither texts nor token ids
    ({"json": {"model": MODEL, "input": [[1, 2], "a"]}}, 400, "invalid_request"),
    ({"json": {"model": MODEL, "input": [1, 30522]}}, 400, "invalid_request"),  # past MiniLM's vocabulary
    ({"json": {"model": MODEL, "input": [[]]}}, 400, "invalid_request"),
    ({"json": {"model": MODEL, "input": "x", "temperature": 0}}, 400, "unsupported_field"),
    ({"json": {"model": 7, "input": "x"}}, 400, "invalid_request"),
    ({"json": {"model": "nope", "input": "x"}}, 404, "model_not_found"),
    ({"json": {"model": MODEL, "input": "x", "encoding_format": "int8"}}, 400, "invalid_request"),
    ({"json": {"model": MODEL, "input": "x" * 5000}}, 413, "request_too_large"),
])
async def test_bad_input_is_typed_4xx(http: httpx.AsyncClient, kwargs: dict, status: int, code: str) -> None:
    r = await http.post("/v1/embeddings", **kwargs)
    assert r.status_code == status, r.text
    assert r.json()["error"]["code"] == code and r.json()["error"]["message"]
    assert (await http.get("/healthz")).status_code == 200  # the daemon survives all of it


async def test_unknown_route_and_method(http: httpx.AsyncClient) -> None:
    r = await http.get("/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = await http.get("/v1/embeddings")
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"


async def test_crash_is_503_then_quarantine_has_retry_after(tmp_path: Path) -> None:
    cfg = daemon_config(tmp_path, fake_command("crash_mid_request", on_request=0), cooldown_s=300)
    async with trio.open_nursery() as nursery:
        client, _ = await client_for(nursery, cfg)
        async with client:
            for _ in range(2):
                r = await client.post("/v1/embeddings", json={"model": MODEL, "input": "boom"})
                assert r.status_code == 503
                err = r.json()["error"]
                assert err["code"] == "engine_crashed" and err["detail"]["cause"] == "crash"
                assert err["detail"]["exit_code"] == 5 and err["detail"]["lane_id"] == "lane0"
            r = await client.post("/v1/embeddings", json={"model": MODEL, "input": "boom"})
            assert r.status_code == 503 and r.json()["error"]["detail"]["quarantined"] is True
            assert 1 <= int(r.headers["retry-after"]) <= 300
            h = await client.get("/healthz")
            assert h.status_code == 503 and h.json()["lanes"][0]["state"] == "quarantined"
        nursery.cancel_scope.cancel()


async def test_deadline_is_504(tmp_path: Path) -> None:
    cfg = daemon_config(tmp_path, fake_command("slow", delay=1.0, on_request=1), timeout_s=0.2)
    async with trio.open_nursery() as nursery:
        client, daemon = await client_for(nursery, cfg)
        sup = daemon.sup
        lane = sup.lanes["lane0"]
        async with client:
            r = await client.post("/v1/embeddings", json={"model": MODEL, "input": "slow"})
            assert r.status_code == 504 and r.json()["error"]["code"] == "deadline_exceeded"
            assert lane.state == LaneState.BUSY  # the lane, not the caller, still owns the reply
            await wait_until(lambda: lane.state == LaneState.READY)  # the abandoned reply drained
            r = await client.post("/v1/embeddings", json={"model": MODEL, "input": "next"})
            assert r.status_code == 200 and r.json()["data"][0]["embedding"][1] == 3.0
        nursery.cancel_scope.cancel()


async def test_sigterm_drains_and_stops_workers(tmp_path: Path) -> None:
    cfg = daemon_config(tmp_path, fake_command("slow", delay=0.5, on_request=1))
    async with trio.open_nursery() as nursery:
        client, daemon = await client_for(nursery, cfg)
        sup = daemon.sup
        pid = sup.lanes["lane0"].pid
        results: list[int] = []

        async def call() -> None:
            r = await client.post("/v1/embeddings", json={"model": MODEL, "input": "in flight"})
            results.append(r.status_code)

        async with client:
            nursery.start_soon(call)
            await wait_until(lambda: sup.lanes["lane0"].state == LaneState.BUSY)
            os.kill(os.getpid(), 15)  # run_daemon's signal receiver turns it into a drain
            await wait_until(lambda: sup.lanes["lane0"].state.value == "stopped", within_s=10)
    assert results == [200]
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
