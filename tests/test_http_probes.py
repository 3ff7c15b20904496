"""/livez, /readyz (all models and ?model=ID) and the SIGTERM order: readiness fails first, the listener stays
open for the requests in flight, then closes."""

from __future__ import annotations

import dataclasses
import os
import signal
from pathlib import Path

import httpx
import pytest
import trio

from tests.support.config import MODEL, daemon_config
from tests.support.fakes import fake_command
from tests.support.helpers import client_for, wait_until
from trio_gpuworker import LaneConfig
from trio_gpuworker.supervisor import LaneState

OTHER = "fake-other"


def two_models(tmp_path: Path, first: tuple[str, ...], **kw: object):
    """MODEL on lane0 (`first`), OTHER on lane1 (a plain fake)."""
    cfg = daemon_config(tmp_path, first, **kw)
    sup = cfg.supervisor
    other = dataclasses.replace(sup.models[0], id=OTHER)
    lanes = (*sup.lanes, LaneConfig("lane1", (OTHER,), worker_command=fake_command()))
    return dataclasses.replace(cfg, supervisor=dataclasses.replace(sup, models=(*sup.models, other), lanes=lanes))


async def test_readyz_follows_the_lanes_and_livez_does_not(tmp_path: Path) -> None:
    cfg = two_models(tmp_path, fake_command("crash_mid_request", on_request=0), cooldown_s=300)
    async with trio.open_nursery() as nursery:
        http, daemon = await client_for(nursery, cfg)
        sup = daemon.sup
        async with http:
            r = await http.get("/readyz")
            assert r.status_code == 200, r.text
            assert r.json() == {"status": "ready", "models": {MODEL: {"ready": True, "lanes": ["lane0"]},
                                                              OTHER: {"ready": True, "lanes": ["lane1"]}}}
            assert (await http.get("/livez")).json() == {"status": "ok"}
            r = await http.get("/health")  # TEI's and vLLM's: /readyz's verdict, in their shape
            assert r.status_code == 200 and r.content == b""
            # two crashes quarantine lane0: MODEL is not ready, OTHER still is, the daemon is alive
            for _ in range(2):
                assert (await http.post("/v1/embeddings", json={"model": MODEL, "input": "x"})).status_code == 503
            await wait_until(lambda: sup.lanes["lane0"].state == LaneState.QUARANTINED)
            r = await http.get("/readyz")
            assert r.status_code == 503 and r.json()["status"] == "not_ready"
            assert r.json()["models"][MODEL] == {"ready": False, "lanes": []}
            assert (await http.get("/readyz", params={"model": MODEL})).status_code == 503
            r = await http.get("/health")
            assert r.status_code == 503 and r.json() == {"error": "unhealthy", "error_type": "unhealthy"}
            r = await http.get("/readyz", params={"model": OTHER})
            assert r.status_code == 200 and r.json()["models"] == {OTHER: {"ready": True, "lanes": ["lane1"]}}
            assert (await http.get("/livez")).status_code == 200  # workers down never fail liveness
            assert (await http.get("/healthz")).status_code == 200  # as before: some lane serves
            # a drained lane is not ready either
            sup.router.drain("lane1")
            assert (await http.get("/readyz", params={"model": OTHER})).status_code == 503
            sup.router.resume("lane1")
            # a reload lifts the quarantine
            await sup.reload_lane("lane0")
            await wait_until(lambda: sup.router.ready_lanes(MODEL) == ["lane0"])
            assert (await http.get("/readyz")).status_code == 200
            r = await http.get("/readyz", params={"model": "nope"})
            assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
            r = await http.get("/readyz?verbose=1")
            assert r.status_code == 400 and r.json()["error"] == {
                "code": "unsupported_field", "param": "verbose", "type": "invalid_request_error",
                "message": "'verbose' is not a query parameter of /readyz"}
            assert (await http.get("/livez?x=1")).status_code == 400
            assert (await http.head("/readyz")).status_code == 200
        nursery.cancel_scope.cancel()


async def test_livez_fails_when_a_lane_task_dies(tmp_path: Path) -> None:
    async with trio.open_nursery() as nursery:
        http, daemon = await client_for(nursery, daemon_config(tmp_path, fake_command()))
        async with http:
            daemon.sup.lanes["lane0"].close()  # the lane task ends: a supervisor fault, not a worker's
            await wait_until(lambda: daemon.sup.lanes["lane0"].state == LaneState.STOPPED)
            r = await http.get("/livez")
            assert r.status_code == 503 and "lane task ended: lane0" in r.json()["reason"]
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("delay_s", [0.0, 0.6])
async def test_sigterm_fails_readiness_first_then_closes_the_listener(tmp_path: Path, delay_s: float) -> None:
    cfg = daemon_config(tmp_path, fake_command("slow", delay=1.5, on_request=1),
                        daemon={"drain_s": 10.0, "shutdown_delay_s": delay_s})
    seen: list[tuple[str, int]] = []
    async with trio.open_nursery() as nursery:
        http, daemon = await client_for(nursery, cfg)
        sup, url = daemon.sup, daemon.binds[0]

        async def in_flight() -> None:
            r = await http.post("/v1/embeddings", json={"model": MODEL, "input": "in flight"})
            seen.append(("in flight", r.status_code))

        nursery.start_soon(in_flight)
        await wait_until(lambda: sup.lanes["lane0"].state == LaneState.BUSY)
        os.kill(os.getpid(), signal.SIGTERM)
        await wait_until(lambda: daemon.api.draining)
        async with httpx.AsyncClient(base_url=url, timeout=5) as fresh:  # a new connection: the listener is open
            r = await fresh.get("/readyz")
            assert r.status_code == 503 and r.json()["status"] == "draining"
            assert (await fresh.get("/health")).status_code == 503  # TEI's and vLLM's health fails with it
            assert (await fresh.get("/livez")).status_code == 200  # stopping is not dying
            if delay_s:  # during the delay requests are still admitted, so a lagging load balancer loses none
                r = await fresh.post("/v1/embeddings", json={"model": MODEL, "input": "late"})
                seen.append(("during delay", r.status_code))
            await wait_until(lambda: not daemon.api.admitting, within_s=5)
            r = await fresh.post("/v1/embeddings", json={"model": MODEL, "input": "too late"})
            assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"
            assert "retry-after" in r.headers
        await wait_until(lambda: ("in flight", 200) in seen, within_s=10)  # answered during the drain
        await wait_until(lambda: sup.lanes["lane0"].state == LaneState.STOPPED, within_s=10)
        with pytest.raises(httpx.ConnectError):  # the listener closed once the drain was done
            async with httpx.AsyncClient(base_url=url, timeout=5) as after:
                await after.get("/livez")
        await http.aclose()
    assert seen == [("in flight", 200)] + ([("during delay", 200)] if delay_s else [])
