"""HTTP API completion: lanes, models, rerank, admin routes on the Unix socket, limits, disconnects."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import httpx
import pytest
import trio

from tests.support.config import MODEL, daemon_config
from tests.support.fakes import fake_command
from tests.support.helpers import wait_until
from trio_gpuworker import BatchPolicy
from trio_gpuworker._kinds import DEFAULT_MAX_TOKENS
from trio_gpuworker.daemon.main import run_daemon
from trio_gpuworker.supervisor import LaneState


def unix_client(path: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url="http://gpuworkerd", transport=httpx.AsyncHTTPTransport(uds=path), timeout=30)


async def test_lanes_and_models_shape(tmp_path: Path) -> None:
    async with trio.open_nursery() as nursery:
        binds = (await nursery.start(run_daemon, daemon_config(tmp_path, fake_command(), fake_command()))).binds
        async with httpx.AsyncClient(base_url=binds[0], timeout=30) as http:
            lanes = (await http.get("/v1/lanes")).json()["data"]
            assert [ln["lane_id"] for ln in lanes] == ["lane0", "lane1"]
            assert sorted(ln["generation"] for ln in lanes) == [1, 2]  # numbered across the supervisor's lanes
            for ln in lanes:
                assert ln["state"] == "ready" and ln["pid"] > 0 and ln["strikes"] == 0
                assert ln["quarantined_until"] is None and ln["models"] == [MODEL] and ln["drained"] is False
                assert "rss_mb" in ln and ln["configured_models"] == [MODEL]
            one = (await http.get("/v1/lanes/lane1")).json()
            assert one["lane_id"] == "lane1"
            r = await http.get("/v1/lanes/nope")
            assert r.status_code == 404 and r.json()["error"]["code"] == "lane_not_found"
            models = (await http.get("/v1/models")).json()
            assert models["object"] == "list"
            assert models["data"][0] | {"lanes": None} == {"id": MODEL, "object": "model", "created": 0,
                                                          "owned_by": "trio-gpuworker", "kind": "embedding",
                                                          "max_model_len": DEFAULT_MAX_TOKENS,  # its max_tokens
                                                          "lanes": None, "ready_lanes": ["lane0", "lane1"]}
        nursery.cancel_scope.cancel()


async def test_rerank_sorted_with_index_and_method(tmp_path: Path) -> None:
    async with trio.open_nursery() as nursery:
        binds = (await nursery.start(run_daemon, daemon_config(tmp_path, fake_command()))).binds
        async with httpx.AsyncClient(base_url=binds[0], timeout=30) as http:
            docs = ["a", "hello world", "b", "the quick brown fox"]
            r = await http.post("/v1/rerank", json={"model": MODEL, "query": "q", "documents": docs})
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["model"] == MODEL and isinstance(body["method"], str)
            scores = [x["relevance_score"] for x in body["results"]]
            assert scores == sorted(scores, reverse=True) and len(scores) == 4  # the fake: sum of the ids
            assert sorted(x["index"] for x in body["results"]) == [0, 1, 2, 3]
            r = await http.post("/v1/rerank", json={"model": MODEL, "query": "q", "documents": docs, "top_n": 2,
                                                    "return_documents": True})
            top = r.json()["results"]
            assert len(top) == 2 and top[0]["document"]["text"] == docs[top[0]["index"]]
            for bad in ({"query": "q", "documents": []}, {"query": "", "documents": ["a"]},
                        {"query": "q", "documents": ["a"], "top_n": 0}):
                r = await http.post("/v1/rerank", json={"model": MODEL, **bad})
                assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request"
        nursery.cancel_scope.cancel()


async def test_admin_routes_only_on_the_unix_socket(tmp_path: Path) -> None:
    cfg = daemon_config(tmp_path, fake_command(), unix=True)
    async with trio.open_nursery() as nursery:
        daemon = await nursery.start(run_daemon, cfg)
        sup, binds = daemon.sup, daemon.binds
        sock = cfg.http.unix_socket
        assert binds == [binds[0], f"http://unix:{sock}"]
        assert stat.S_IMODE(os.stat(sock).st_mode) == 0o660
        async with httpx.AsyncClient(base_url=binds[0], timeout=30) as tcp, unix_client(sock) as admin:
            r = await tcp.post("/v1/lanes/lane0/reload")
            assert r.status_code == 403 and r.json()["error"]["code"] == "admin_only"
            assert (await admin.get("/healthz")).status_code == 200  # the Unix socket serves everything

            r = await admin.post("/v1/lanes/lane0/drain", json={"wait": True})
            assert r.status_code == 200 and r.json()["drained"] is True and r.json()["idle"] is True
            r = await tcp.post("/v1/embeddings", json={"model": MODEL, "input": "x"})
            assert r.status_code == 503 and r.json()["error"]["code"] == "no_lane_available"
            r = await admin.post("/v1/lanes/lane0/resume")
            assert r.json()["drained"] is False
            assert (await tcp.post("/v1/embeddings", json={"model": MODEL, "input": "x"})).status_code == 200

            r = await admin.post("/v1/lanes/lane0/reload")
            assert r.status_code == 200 and r.json()["generation"] == 2
            assert sup.lanes["lane0"].generation == 2

            r = await admin.post("/v1/lanes/lane0/unload", json={"model": MODEL})
            assert r.status_code == 200 and r.json()["models"] == []
            assert MODEL not in sup.lanes["lane0"].loads
            r = await tcp.post("/v1/embeddings", json={"model": MODEL, "input": "x"})
            assert r.status_code == 503 and r.json()["error"]["code"] == "no_lane_available"
            r = await admin.post("/v1/lanes/lane0/load", json={"model": MODEL})
            assert r.status_code == 200, r.text
            assert r.json()["model_ref"] == MODEL and r.json()["dims"] == 4
            assert MODEL in sup.lanes["lane0"].loads and MODEL in sup.lanes["lane0"].models_loaded
            assert (await tcp.post("/v1/embeddings", json={"model": MODEL, "input": "x"})).status_code == 200

            r = await admin.post("/v1/lanes/nope/reload")
            assert r.status_code == 404 and r.json()["error"]["code"] == "lane_not_found"
            r = await admin.post("/v1/lanes/lane0/load", json={"model": "nope"})
            assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        nursery.cancel_scope.cancel()


async def test_streamed_load_reports_progress(tmp_path: Path) -> None:
    cfg = daemon_config(tmp_path, fake_command(), unix=True)
    async with trio.open_nursery() as nursery:
        await nursery.start(run_daemon, cfg)
        async with unix_client(cfg.http.unix_socket) as admin:
            events = []
            async with admin.stream("POST", "/v1/lanes/lane0/load", json={"model": MODEL, "stream": True}) as r:
                assert r.headers["content-type"] == "application/x-ndjson"
                async for line in r.aiter_lines():
                    if line:
                        events.append(json.loads(line))
            kinds = [e["event"] for e in events]
            assert "progress" in kinds and kinds[-1] == "done"
            progress = next(e for e in events if e["event"] == "progress")
            assert progress["phase"] == "setup" and progress["completed"] == 1  # the fake's LOAD PROGRESS
            assert events[-1]["result"]["model_ref"] == MODEL
        nursery.cancel_scope.cancel()


async def test_an_existing_live_socket_is_not_stolen(tmp_path: Path) -> None:
    cfg = daemon_config(tmp_path, fake_command(), unix=True)
    async with trio.open_nursery() as nursery:
        await nursery.start(run_daemon, cfg)
        (tmp_path / "second").mkdir()
        with pytest.raises(BaseExceptionGroup) as info:  # the ConfigError, from run_daemon's nursery
            async with trio.open_nursery() as inner:
                await inner.start(run_daemon, daemon_config(tmp_path / "second", fake_command(),
                                                            http={"unix_socket": cfg.http.unix_socket}))
        assert "another daemon is listening" in repr(info.value)
        nursery.cancel_scope.cancel()


async def test_limits_and_json_errors(tmp_path: Path) -> None:
    cfg = daemon_config(tmp_path, fake_command(), http={"max_inputs": 3})
    async with trio.open_nursery() as nursery:
        binds = (await nursery.start(run_daemon, cfg)).binds
        async with httpx.AsyncClient(base_url=binds[0], timeout=30) as http:
            r = await http.post("/v1/embeddings", json={"model": MODEL, "input": ["a"] * 4})
            assert r.status_code == 400 and "max_inputs" in r.json()["error"]["message"]
            r = await http.post("/v1/embeddings", content=b"x" * 5000)
            assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
            r = await http.delete("/v1/lanes")
            assert r.status_code == 405 and r.headers["content-type"] == "application/json"
            r = await http.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
            assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request"  # not a generate model
        nursery.cancel_scope.cancel()


async def test_queued_request_of_a_client_that_left_never_reaches_the_worker(tmp_path: Path) -> None:
    """Batching off: the lane's queue drops it. The fake's 4th column is the req_id the worker saw."""
    cfg = daemon_config(tmp_path, fake_command("slow", delay=0.6, on_request=1),
                        daemon={"batching": BatchPolicy(max_delay_s=0)})
    async with trio.open_nursery() as nursery:
        daemon = await nursery.start(run_daemon, cfg)
        sup, binds = daemon.sup, daemon.binds
        async with httpx.AsyncClient(base_url=binds[0], timeout=30) as http:
            first: list[float] = []

            async def slow() -> None:
                r = await http.post("/v1/embeddings", json={"model": MODEL, "input": "slow"})
                first.append(r.json()["data"][0]["embedding"][3])

            nursery.start_soon(slow)
            await wait_until(lambda: sup.lanes["lane0"].state == LaneState.BUSY)
            async with httpx.AsyncClient(base_url=binds[0], timeout=0.2) as impatient:
                with pytest.raises(httpx.ReadTimeout):
                    await impatient.post("/v1/embeddings", json={"model": MODEL, "input": "left"})
            await wait_until(lambda: bool(first))
            r = await http.post("/v1/embeddings", json={"model": MODEL, "input": "next"})
            assert first and r.json()["data"][0]["embedding"][3] == first[0] + 1  # "left" never got a req_id
        nursery.cancel_scope.cancel()
