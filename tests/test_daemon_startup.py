"""The daemon listens before its lanes are ready: /healthz shows each lane's first start, a request for a model none
of whose lanes serves yet gets 503 model_loading with Retry-After, READY=1 waits for the lanes, and the log says
what is happening from the first second (docs/operations.md, 'Starting up'). Fake workers whose first LOAD is slow."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
from pathlib import Path

import httpx
import pytest
import trio

from tests.support.config import FAST, MODEL, daemon_config
from tests.support.fake_systemd import FakeSystemd
from tests.support.fakes import fake_command
from tests.support.helpers import wait_until
from trio_gpuworker.daemon.main import run_daemon
from trio_gpuworker.supervisor import MODEL_LOADING_RETRY_AFTER_S


def _client(tmp_path: Path) -> httpx.AsyncClient:
    """The Unix-socket listener: its path is known before the daemon is ready (the TCP port is picked at bind)."""
    return httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=str(tmp_path / "api.sock")),
                             base_url="http://daemon", timeout=10)


async def test_serves_probes_and_refuses_requests_while_the_first_load_runs(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="trio_gpuworker.daemon")
    sd = FakeSystemd(str(tmp_path / "notify"))
    cfg = daemon_config(tmp_path, fake_command(first_load_delay=3.0), unix=True)
    async with trio.open_nursery() as nursery:
        await nursery.start(sd.run)
        nursery.start_soon(lambda: run_daemon(cfg, env={"NOTIFY_SOCKET": sd.address, "WATCHDOG_USEC": "200000"}))
        await wait_until(lambda: (tmp_path / "api.sock").exists(), within_s=10)
        async with _client(tmp_path) as http:
            async def lane_entry() -> dict[str, object]:
                r = await http.get("/healthz")
                assert r.status_code == 503, r.text
                assert r.json()["status"] == "starting"
                [lane] = r.json()["lanes"]
                return lane

            lane = await lane_entry()
            assert lane["lane_id"] == "lane0" and lane["state"] in ("starting", "loading")
            with trio.fail_after(5):
                while (lane := await lane_entry())["state"] != "loading":  # noqa: ASYNC110 (polled over HTTP)
                    await trio.sleep(0.05)
            progress = lane["starting"]
            assert isinstance(progress, dict)
            assert progress["phase"] == "load" and progress["model"] == MODEL and progress["steps"] >= 1

            r = await http.post("/v1/embeddings", json={"model": MODEL, "input": ["hello"]})
            assert r.status_code == 503, r.text
            assert r.headers["retry-after"] == str(int(MODEL_LOADING_RETRY_AFTER_S))
            err = r.json()["error"]
            assert err["code"] == "model_loading" and MODEL in err["message"] and "lane0 loading" in err["message"]
            assert err["detail"]["lanes"]["lane0"]["phase"] == "load"
            r = await http.post("/v1/rerank", json={"model": MODEL, "query": "q", "documents": ["a", "b"]})
            assert r.status_code == 503 and r.json()["error"]["code"] == "model_loading", r.text
            r = await http.get("/readyz")
            assert r.status_code == 503 and r.json()["models"][MODEL]["ready"] is False
            assert (await http.get("/livez")).status_code == 200  # a loading lane is not a dead daemon

            assert "READY=1" not in sd.lines()
            await sd.wait_for(lambda: any(x.startswith("STATUS=starting: 0/1 lanes ready; lane0 loading fake-embed")
                                          for x in sd.lines()))

            await wait_until(lambda: "READY=1" in sd.lines(), within_s=10)
            r = await http.post("/v1/embeddings", json={"model": MODEL, "input": ["hello"]})
            assert r.status_code == 200, r.text
            r = await http.get("/healthz")
            assert r.status_code == 200 and r.json()["status"] == "ok"
            assert r.json()["lanes"][0]["starting"] is None
            assert (await http.get("/readyz")).status_code == 200
            lanes = (await http.get("/v1/lanes")).json()["data"]
            assert lanes[0]["ready_after_s"] >= 3.0  # the slow first LOAD

        messages = [r.getMessage() for r in caplog.records if r.name == "trio_gpuworker.daemon"]
        assert any(m.startswith("listening on ") and "while 1 lane(s) start (lane0)" in m for m in messages), messages
        assert any(m.startswith("lane lane0 ready after ") and m.endswith(f": {MODEL}") for m in messages), messages
        assert any(m.startswith("1 of 1 lane(s) ready after ") for m in messages), messages
        assert messages.index(next(m for m in messages if m.startswith("listening on "))) < \
            messages.index(next(m for m in messages if m.startswith("lane lane0 ready")))
        times = json.loads((cfg.supervisor.state_dir / "startup.json").read_text())
        assert set(times) == {"lane0"} and times["lane0"] >= 3.0  # the next start's estimate
        os.kill(os.getpid(), signal.SIGTERM)
        await sd.wait_for(lambda: "STATUS=stopped" in sd.lines())
        nursery.cancel_scope.cancel()


async def test_the_next_start_says_how_long_the_last_one_took(tmp_path: Path,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="trio_gpuworker.daemon")
    cfg = daemon_config(tmp_path, fake_command())
    cfg.supervisor.state_dir.mkdir(parents=True)
    (cfg.supervisor.state_dir / "startup.json").write_text(json.dumps({"lane0": 4.25}))
    async with trio.open_nursery() as nursery:
        await nursery.start(run_daemon, cfg)
        os.kill(os.getpid(), signal.SIGTERM)
    [line] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("listening on ")]
    assert "the last start took 4.2 s" in line


async def test_a_stop_during_the_first_start_ends_the_daemon(tmp_path: Path) -> None:
    """SIGTERM while a lane is still in a long first LOAD: no READY=1, the worker is stopped, the daemon returns."""
    sd = FakeSystemd(str(tmp_path / "notify"))
    cfg = daemon_config(tmp_path, fake_command(first_load_delay=30.0), unix=True,
                        windows=dataclasses.replace(FAST, load_s=60.0))
    async with trio.open_nursery() as nursery:
        await nursery.start(sd.run)
        done = trio.Event()

        async def daemon() -> None:
            await run_daemon(cfg, env={"NOTIFY_SOCKET": sd.address, "WATCHDOG_USEC": "200000"})
            done.set()

        nursery.start_soon(daemon)
        await wait_until(lambda: any(x.startswith("STATUS=starting: 0/1 lanes ready; lane0 loading")
                                     for x in sd.lines()), within_s=10)
        os.kill(os.getpid(), signal.SIGTERM)
        with trio.fail_after(15):  # well before the 30 s LOAD would have finished
            await done.wait()
        assert "READY=1" not in sd.lines() and "STOPPING=1" in sd.lines()
        assert not (tmp_path / "api.sock").exists()
        nursery.cancel_scope.cancel()
