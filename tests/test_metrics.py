"""GET /metrics, read back with prometheus_client's own exposition-format parser."""

from __future__ import annotations

from pathlib import Path

import httpx
import trio

from tests.support.config import MODEL, daemon_config
from tests.support.fakes import fake_command
from tests.support.helpers import wait_until
from tests.support.metrics import scrape, value
from trio_gpuworker.daemon.main import run_daemon


async def test_metrics_exposition(tmp_path: Path) -> None:
    # lane0 serves; lane1 crashes on its first request and is quarantined at once (strikes=1)
    cfg = daemon_config(tmp_path, fake_command(), fake_command("crash_mid_request", on_request=1), strikes=1)
    async with trio.open_nursery() as nursery:
        daemon = await nursery.start(run_daemon, cfg)
        sup, binds = daemon.sup, daemon.binds
        async with httpx.AsyncClient(base_url=binds[0], timeout=30) as http:
            sup.router.drain("lane0")  # route the first request to lane1, which crashes
            r = await http.post("/v1/embeddings", json={"model": MODEL, "input": "boom"})
            assert r.status_code == 503
            sup.router.resume("lane0")
            for _ in range(2):
                assert (await http.post("/v1/embeddings", json={"model": MODEL, "input": "x"})).status_code == 200
            assert (await http.post("/v1/embeddings", json={"model": "nope", "input": "x"})).status_code == 404
            assert (await http.post("/v1/embeddings", json={"model": MODEL})).status_code == 400
            await wait_until(lambda: sup.lanes["lane1"].state.value == "quarantined")
            crashes = "gpuworker_worker_crashes_total"
            await wait_until(lambda: crashes in scrape(daemon.metrics.render().decode()))  # counted from events
            r = await http.get("/metrics")
        nursery.cancel_scope.cancel()

    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain; version=")
    m = scrape(r.text)
    route = "/v1/embeddings"
    assert value(m, "gpuworker_http_requests_total", route=route, model=MODEL, outcome="ok") == 2
    assert value(m, "gpuworker_http_requests_total", route=route, model=MODEL, outcome="engine_crashed") == 1
    assert value(m, "gpuworker_http_requests_total", route=route, model="unknown", outcome="model_not_found") == 1
    assert value(m, "gpuworker_http_requests_total", route=route, model=MODEL, outcome="invalid_request") == 1
    assert value(m, "gpuworker_http_request_duration_seconds_count", route=route, model=MODEL) == 4
    assert value(m, "gpuworker_http_request_duration_seconds_bucket", route=route, model=MODEL, le="+Inf") == 4

    assert value(m, "gpuworker_lane_state", lane="lane0", state="ready") == 1
    assert value(m, "gpuworker_lane_state", lane="lane0", state="busy") == 0
    assert value(m, "gpuworker_lane_state", lane="lane1", state="quarantined") == 1
    assert value(m, "gpuworker_lane_quarantined", lane="lane1") == 1
    assert value(m, "gpuworker_lane_strikes", lane="lane1") == 1
    assert value(m, "gpuworker_lane_generation", lane="lane0") == 1
    assert value(m, "gpuworker_lane_restarts_total", lane="lane0") == 0
    assert value(m, "gpuworker_worker_crashes_total", lane="lane1", cause="crash") == 1
    assert value(m, "gpuworker_lane_quarantines_total", lane="lane1") == 1
    assert value(m, "gpuworker_lane_queue_depth", lane="lane0") == 0
    assert value(m, "gpuworker_model_queue_bytes", model=MODEL) == 0
    assert value(m, "gpuworker_model_queue_budget_bytes", model=MODEL) == 64 << 20
    assert value(m, "gpuworker_embed_batch_rows_count", model=MODEL) == 3  # batching is on by default
    assert value(m, "gpuworker_ring_bytes_total", direction="ingress") == 0
    assert value(m, "gpuworker_ring_bytes_total", direction="egress") == 0
    assert "gpuworker_worker_rss_bytes" not in m or all(v > 0 for v in m["gpuworker_worker_rss_bytes"].values())


async def test_model_load_gauges_and_token_counters(tmp_path: Path) -> None:
    """What a router reads: per model, worker requests waiting and running; tokens in and out."""
    from trio_gpuworker import BatchPolicy
    from trio_gpuworker.daemon.config import DEFAULT_LM
    from trio_gpuworker.supervisor import LaneState

    cfg = daemon_config(tmp_path, fake_command("slow", delay=1.0, on_request=1),
                        daemon={"batching": BatchPolicy(max_delay_s=0)}, lm=fake_command())
    async with trio.open_nursery() as nursery:
        daemon = await nursery.start(run_daemon, cfg)
        sup = daemon.sup
        async with httpx.AsyncClient(base_url=daemon.binds[0], timeout=30) as http:
            answers: list[httpx.Response] = []

            async def embed(text: str) -> None:
                answers.append(await http.post("/v1/embeddings", json={"model": MODEL, "input": text}))

            nursery.start_soon(embed, "slow one")
            await wait_until(lambda: sup.lanes["lane0"].state == LaneState.BUSY)
            nursery.start_soon(embed, "queued behind it")
            await wait_until(lambda: sup.lanes["lane0"].queued == 1)
            busy = scrape((await http.get("/metrics")).text)
            await wait_until(lambda: len(answers) == 2, within_s=10)
            r = await http.post("/v1/completions", json={"model": DEFAULT_LM, "prompt": "Hello", "max_tokens": 2})
            assert r.status_code == 200
            m = scrape((await http.get("/metrics")).text)
        nursery.cancel_scope.cancel()
    assert value(busy, "gpuworker_model_requests_running", model=MODEL) == 1
    assert value(busy, "gpuworker_model_requests_queued", model=MODEL) == 1
    assert value(busy, "gpuworker_model_requests_running", model=DEFAULT_LM) == 0
    assert value(m, "gpuworker_model_requests_running", model=MODEL) == 0
    assert value(m, "gpuworker_model_requests_queued", model=MODEL) == 0
    embedded = sum(a.json()["usage"]["prompt_tokens"] for a in answers)
    assert value(m, "gpuworker_prompt_tokens_total", model=MODEL) == embedded
    usage = r.json()["usage"]
    assert value(m, "gpuworker_prompt_tokens_total", model=DEFAULT_LM) == usage["prompt_tokens"]
    assert value(m, "gpuworker_generation_tokens_total", model=DEFAULT_LM) == usage["completion_tokens"] == 2
    assert (MODEL,) not in {tuple(v for _, v in k) for k in m.get("gpuworker_generation_tokens_total", {})}
