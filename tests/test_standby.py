"""Warm standby workers (`standby = true`) against scripted fake workers: promotion on a fault, strikes for a
standby that fails idle, quarantine still winning, load/unload reaching both workers, nothing left behind."""

from __future__ import annotations

import dataclasses
import os
import signal
from pathlib import Path

import httpx
import numpy as np
import pytest
import trio

from tests.support.config import MODEL, daemon_config, supervisor_config
from tests.support.fakes import fake_command
from tests.support.helpers import wait_until
from tests.support.metrics import scrape, value
from tests.support.supervision import expected_fake_rows, rows
from trio_gpuworker import EngineCrashed, LaneState, Supervisor, SupervisorConfig
from trio_gpuworker._errors import ConfigError
from trio_gpuworker.daemon.config import parse_config
from trio_gpuworker.daemon.ctl import LANE_COLUMNS, status_rows, table
from trio_gpuworker.daemon.main import run_daemon
from trio_gpuworker.supervisor import LoadSpec


def with_standby(cfg: SupervisorConfig) -> SupervisorConfig:
    return dataclasses.replace(cfg, lanes=tuple(dataclasses.replace(ln, standby=True) for ln in cfg.lanes))


def alive(pid: int | None) -> bool:
    if pid is None:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def embed(sup: Supervisor, rs: list[np.ndarray]) -> np.ndarray:
    return await sup.embed_ids(rs, model=MODEL, pooling="mean", normalize=True)


async def standby_ready(sup: Supervisor) -> None:
    keeper = sup.lanes["lane0"].standby
    assert keeper is not None
    await wait_until(lambda: keeper.ready, within_s=10)


async def test_active_crash_promotes_the_standby(tmp_path: Path) -> None:
    once = tmp_path / "once"
    cfg = with_standby(supervisor_config(tmp_path, fake_command("crash_mid_request", once_file=once)))
    async with Supervisor(cfg) as sup:
        lane = sup.lanes["lane0"]
        await standby_ready(sup)
        keeper = lane.standby
        assert keeper is not None and keeper.gen is not None
        standby_gen, standby_pid, first_pid = keeper.gen.number, keeper.gen.wp.pid, lane.pid
        assert standby_gen == 2 and lane.generation == 1 and standby_pid != first_pid
        events = sup.subscribe()
        with pytest.raises(EngineCrashed) as info:  # the request in flight is never retried elsewhere
            await embed(sup, rows(3))
        assert info.value.generation == 1 and info.value.cause == "crash"
        rs = rows(2, 4)
        with trio.fail_after(2):
            out = await embed(sup, rs)  # served by the promoted worker, without a cold start
        np.testing.assert_array_equal(out[:, :3], expected_fake_rows(rs))
        assert lane.generation == standby_gen and lane.pid == standby_pid and lane.policy.strikes == 0
        assert keeper.promotions == 1
        crashed = events.receive_nowait()
        assert crashed["t"] == "WORKER_CRASHED" and crashed["generation"] == 1 and crashed["standby"] is False
        await standby_ready(sup)  # a new standby starts in the background
        assert keeper.gen is not None and keeper.gen.number == 3
        assert lane.status()["standby"]["state"] == "ready"


async def test_standby_crash_while_idle_counts_a_strike_and_respawns(tmp_path: Path) -> None:
    async with Supervisor(with_standby(supervisor_config(tmp_path, fake_command()))) as sup:
        lane = sup.lanes["lane0"]
        await standby_ready(sup)
        keeper = lane.standby
        assert keeper is not None and keeper.gen is not None
        dead = keeper.gen
        events = sup.subscribe()
        os.kill(dead.wp.pid, signal.SIGKILL)
        await wait_until(lambda: keeper.faults == 1)
        assert lane.policy.strikes == 1 and lane.generation == 1 and lane.state == LaneState.READY
        crashed = events.receive_nowait()
        assert crashed["generation"] == dead.number and crashed["standby"] is True
        await standby_ready(sup)
        assert keeper.gen is not None and keeper.gen.number == dead.number + 1
        out = await embed(sup, rows(2))  # the active worker served throughout; a drained reply clears strikes
        assert out.shape == (1, 4) and lane.policy.strikes == 0


async def test_two_strikes_quarantine_even_with_a_standby(tmp_path: Path) -> None:
    cfg = with_standby(supervisor_config(tmp_path, fake_command("crash_mid_request", on_request=0), cooldown_s=60))
    async with Supervisor(cfg) as sup:
        lane = sup.lanes["lane0"]
        keeper = lane.standby
        assert keeper is not None
        for _ in range(2):
            await standby_ready(sup)
            with pytest.raises(EngineCrashed):
                await embed(sup, rows(1))
        await lane.wait_state(LaneState.QUARANTINED)
        assert keeper.gen is None and not keeper.ready  # the standby is stopped for the cool-down
        with pytest.raises(EngineCrashed) as info:
            await embed(sup, rows(1))
        assert info.value.quarantined
        pids = [p for p in (lane.pid, lane.last_reaped[0]) if p is not None]
        assert not any(alive(p) for p in pids)


async def test_load_and_unload_reach_both_workers(tmp_path: Path) -> None:
    async with Supervisor(with_standby(supervisor_config(tmp_path, fake_command()))) as sup:
        lane = sup.lanes["lane0"]
        await standby_ready(sup)
        keeper = lane.standby
        assert keeper is not None and keeper.gen is not None
        artifact = tmp_path / "second.bin"
        artifact.write_bytes(b"second")
        spec = LoadSpec("second", artifact, "0" * 64, "safetensors", {})

        async def standby_models() -> list[str]:
            pong = await lane.standby_call("PING")
            assert pong is not None and pong.T == "PONG"
            return list(pong.models_loaded)

        await lane.load_model(spec)
        assert lane.models_loaded == [MODEL, "second"]
        assert await standby_models() == [MODEL, "second"] and keeper.gen.models == [MODEL, "second"]
        await lane.unload_model("second")
        assert lane.models_loaded == [MODEL] and await standby_models() == [MODEL]


async def test_nothing_is_left_after_shutdown(tmp_path: Path) -> None:
    async with Supervisor(with_standby(supervisor_config(tmp_path, fake_command()))) as sup:
        lane = sup.lanes["lane0"]
        await standby_ready(sup)
        assert lane.standby is not None and lane.standby.gen is not None
        pids = [lane.pid, lane.standby.gen.wp.pid]
        fds = len(os.listdir("/proc/self/fd"))
    assert lane.state == LaneState.STOPPED and not any(alive(p) for p in pids)
    assert list((tmp_path / "run" / "gpuworker" / "workers").iterdir()) == []
    assert len(os.listdir("/proc/self/fd")) < fds  # both control sockets and the log pipes are closed


def test_standby_is_a_lane_option() -> None:
    base = '[models."m"]\npath = "/etc/hostname"\n[[lanes]]\nid = "a"\nmodels = ["m"]\n'
    assert parse_config(base + "standby = true\n", Path.cwd(), {}).supervisor.lanes[0].standby is True
    assert parse_config(base, Path.cwd(), {}).supervisor.lanes[0].standby is False
    with pytest.raises(ConfigError, match=r"lanes\[0\]\.standby"):
        parse_config(base + 'standby = "yes"\n', Path.cwd(), {})


async def test_standby_shows_in_lanes_metrics_and_ctl(tmp_path: Path) -> None:
    cfg = daemon_config(tmp_path, fake_command())
    cfg = dataclasses.replace(cfg, supervisor=with_standby(cfg.supervisor))
    async with trio.open_nursery() as nursery:
        daemon = await nursery.start(run_daemon, cfg)
        sup, binds = daemon.sup, daemon.binds
        await standby_ready(sup)
        async with httpx.AsyncClient(base_url=binds[0], timeout=30) as http:
            lane = (await http.get("/v1/lanes/lane0")).json()
            metrics = scrape((await http.get("/metrics")).text)
        nursery.cancel_scope.cancel()
    assert lane["standby"]["state"] == "ready" and lane["standby"]["generation"] == 2
    assert lane["standby"]["pid"] != lane["pid"] and lane["standby"]["models"] == [MODEL]
    assert value(metrics, "gpuworker_lane_standby_ready", lane="lane0") == 1.0
    text = table(status_rows([lane]), LANE_COLUMNS)
    assert "STANDBY" in text.splitlines()[0] and f"ready g2 pid {lane['standby']['pid']}" in text
