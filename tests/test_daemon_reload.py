"""SIGHUP and POST /v1/config/reload: the configuration file is re-read and lanes and models reload in order,
without dropping requests in flight."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import httpx
import trio

from tests.support.config import lane, write_config
from tests.support.fake_systemd import FakeSystemd
from tests.support.fakes import fake_command
from tests.support.helpers import wait_until
from trio_gpuworker.daemon.config import load_config
from trio_gpuworker.daemon.main import Daemon, run_daemon
from trio_gpuworker.supervisor import LaneState


def failed_reloads(daemon: Daemon) -> float:
    [metric] = daemon.metrics.reloads.collect()
    return sum(s.value for s in metric.samples if s.name.endswith("_total") and s.labels["outcome"] == "error")


def unix(tmp_path: Path) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url="http://gpuworkerd", timeout=30,
                             transport=httpx.AsyncHTTPTransport(uds=str(tmp_path / "api.sock")))


async def test_sighup_reloads_a_changed_lane_without_dropping_requests_in_flight(tmp_path: Path) -> None:
    slow = fake_command("slow", delay=0.6, on_request=1)
    path = write_config(tmp_path, lanes=[lane("lane0", ["m1"], slow)])
    sd = FakeSystemd(str(tmp_path / "notify"))
    async with trio.open_nursery() as nursery:
        await nursery.start(sd.run)
        daemon = await nursery.start(lambda task_status: run_daemon(
            load_config(path, {}), config_path=path, env={"NOTIFY_SOCKET": sd.address}, task_status=task_status))
        sup, binds = daemon.sup, daemon.binds
        async with httpx.AsyncClient(base_url=binds[0], timeout=30) as http:
            results: list[int] = []

            async def in_flight() -> None:
                r = await http.post("/v1/embeddings", json={"model": "m1", "input": "in flight"})
                results.append(r.status_code)

            nursery.start_soon(in_flight)
            await wait_until(lambda: sup.lanes["lane0"].state == LaneState.BUSY)
            write_config(tmp_path, lanes=[lane("lane0", ["m1", "m2"], slow, COLOUR="blue")])
            os.kill(os.getpid(), signal.SIGHUP)
            await wait_until(lambda: sup.lanes["lane0"].generation == 2 and sup.lanes["lane0"].state.value == "ready")
            assert results == [200]  # served by generation 1 before it was replaced
            assert sup.lanes["lane0"].cfg.env == {"COLOUR": "blue"} and list(sup.lanes["lane0"].loads) == ["m1", "m2"]
            r = await http.post("/v1/embeddings", json={"model": "m2", "input": "new model"})
            assert r.status_code == 200, r.text
            await sd.wait_for(lambda: "RELOADING=1" in sd.lines() and sd.lines().count("READY=1") == 2)
        nursery.cancel_scope.cancel()


async def test_ordered_reload_keeps_serving_from_the_other_lane(tmp_path: Path) -> None:
    path = write_config(tmp_path, lanes=[lane("lane0", ["m1"]), lane("lane1", ["m1"])])
    async with trio.open_nursery() as nursery:
        daemon = await nursery.start(lambda task_status: run_daemon(
            load_config(path, {}), config_path=path, task_status=task_status))
        sup, binds = daemon.sup, daemon.binds
        async with httpx.AsyncClient(base_url=binds[0], timeout=30) as http, unix(tmp_path) as admin:
            statuses: list[int] = []
            stop = trio.Event()

            async def load() -> None:
                while not stop.is_set():
                    statuses.append((await http.post("/v1/embeddings", json={"model": "m1", "input": "x"})).status_code)

            async with trio.open_nursery() as loader:
                loader.start_soon(load)
                write_config(tmp_path, lanes=[lane("lane0", ["m1"], BEAM="1"), lane("lane1", ["m1"], BEAM="1")])
                r = await admin.post("/v1/config/reload")
                stop.set()
            assert r.status_code == 200, r.text
            assert r.json()["reloaded"] == ["lane0", "lane1"]
            # each lane's worker is a fresh one: generations are numbered across lanes, lane0 and lane1 had 1 and 2
            assert sorted(sup.lanes[x].generation for x in ("lane0", "lane1")) == [3, 4]
            assert statuses and set(statuses) == {200}
            assert sup.router.drained == frozenset()  # each was drained only while it reloaded
        nursery.cancel_scope.cancel()


async def test_reload_report_bad_file_removed_lane_and_restart_only_keys(tmp_path: Path) -> None:
    path = write_config(tmp_path, lanes=[lane("lane0", ["m1"]), lane("lane1", ["m1"])])
    async with trio.open_nursery() as nursery:
        daemon = await nursery.start(lambda task_status: run_daemon(
            load_config(path, {}), config_path=path, task_status=task_status))
        sup, binds = daemon.sup, daemon.binds
        async with httpx.AsyncClient(base_url=binds[0], timeout=30) as http, unix(tmp_path) as admin:
            r = await admin.post("/v1/config/reload")
            assert r.json()["reloaded"] == [] and r.json()["restart_required"] == []  # nothing changed

            path.write_text(path.read_text().replace("inference_s = 5.0", "inference_s = 'soon'"))
            r = await admin.post("/v1/config/reload")
            assert r.status_code == 400 and r.json()["error"]["code"] == "config_invalid"
            assert "windows.inference_s" in r.json()["error"]["message"]
            os.kill(os.getpid(), signal.SIGHUP)  # logged, and the daemon carries on
            await wait_until(lambda: failed_reloads(daemon) == 2)
            assert (await http.post("/v1/embeddings", json={"model": "m1", "input": "x"})).status_code == 200

            write_config(tmp_path, lanes=[lane("lane0", ["m1"]), lane("lane2", ["m1"])],
                         extra="[admission]\nqueue_bytes = 4096\n")
            path.write_text(path.read_text().replace("inference_s = 5.0", "inference_s = 7.0"))
            r = await admin.post("/v1/config/reload")
            report = r.json()
            assert r.status_code == 200 and report["removed"] == ["lane1"] and report["reloaded"] == []
            assert "supervisor.windows" in report["restart_required"]
            assert "lane2" in report["added"] or "lanes: new lane 'lane2'" in report["restart_required"]
            assert "admission" in report["applied"] and sup.scheduler.policy.queue_bytes == 4096
            assert "lane1" not in sup.lanes
            assert sup.lanes["lane0"].windows.inference_s == 5.0  # kept until a restart
            lanes = (await http.get("/v1/lanes")).json()["data"]
            assert "lane1" not in [ln["lane_id"] for ln in lanes]
            assert (await http.post("/v1/embeddings", json={"model": "m1", "input": "x"})).status_code == 200
        nursery.cancel_scope.cancel()
