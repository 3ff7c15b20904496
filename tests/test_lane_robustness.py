"""A lane keeps serving whatever one request does: local protocol errors fail that request alone, a stopped
worker cannot block the request write, quarantine neither leaks queue slots nor leaves a lane unrouted."""

from __future__ import annotations

import contextlib
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
from tests.support.helpers import client_for, wait_until
from tests.support.supervision import expected_fake_rows, rows
from trio_gpuworker import EngineCrashed, InvalidRequest, LaneState, RestartPolicy, Supervisor
from trio_gpuworker._errors import RequestTooLarge
from trio_gpuworker._proto import EmbedBatch


def batch_fields(n: int, pooling: str = "mean", n_tokens: int = 1) -> dict[str, object]:
    return {"model_ref": MODEL, "pooling": pooling, "normalize": True,
            "items": [{"id": i, "n_tokens": n_tokens} for i in range(n)]}


async def test_request_failing_the_schema_fails_alone(tmp_path: Path) -> None:
    async with Supervisor(supervisor_config(tmp_path, fake_command())) as sup:
        lane = sup.lanes["lane0"]
        with pytest.raises(InvalidRequest, match="pooling"):
            await lane.call(EmbedBatch(**batch_fields(1, pooling="weightedmean"), raw=np.ones(1, "<i4").tobytes()))
        rs = rows(3, 2)
        out = await sup.embed_ids(rs, model=MODEL, pooling="mean", normalize=True)
        np.testing.assert_array_equal(out[:, :3], expected_fake_rows(rs))
        assert lane.generation == 1 and lane.policy.strikes == 0 and lane.queued == 0


async def test_request_larger_than_max_frame_fails_alone(tmp_path: Path) -> None:
    cfg = dataclasses.replace(supervisor_config(tmp_path, fake_command()), max_frame=64 * 1024, max_batch_items=16)
    async with Supervisor(cfg) as sup:
        lane = sup.lanes["lane0"]
        n = 20_000  # 80 KB of token ids: one raw frame over the 64 KiB limit
        with pytest.raises(RequestTooLarge) as info:
            await lane.call(EmbedBatch(**batch_fields(n), raw=np.ones(n, "<i4").tobytes()))
        assert info.value.code == "request_too_large" and isinstance(info.value, InvalidRequest)
        rs = rows(4)
        out = await sup.embed_ids(rs, model=MODEL, pooling="mean", normalize=True)
        np.testing.assert_array_equal(out[:, :3], expected_fake_rows(rs))
        assert lane.generation == 1 and lane.policy.strikes == 0 and lane.state == LaneState.READY


async def test_stopped_worker_cannot_block_the_request_write(tmp_path: Path) -> None:
    """The watchdog is armed before the write: a worker that stops reading while a payload larger than the
    socket buffer is written is a hang (strike, kill, restart), not a lane blocked forever."""
    cfg = supervisor_config(tmp_path, fake_command("stop_after_reply", on_request=1))
    async with Supervisor(cfg) as sup:
        lane = sup.lanes["lane0"]
        await sup.embed_ids(rows(2), model=MODEL, pooling="mean", normalize=True)  # then the worker stops
        n = 4 * 1024 * 1024  # 16 MiB of ids, far beyond the socket buffer
        with trio.fail_after(cfg.windows.inference_s + 10), pytest.raises(EngineCrashed) as info:
            await lane.call(EmbedBatch(**batch_fields(1, n_tokens=n), raw=np.ones(n, "<i4").tobytes()))
        assert info.value.cause == "hang" and info.value.generation == 1
        assert lane.policy.strikes == 1
        with trio.fail_after(10):
            await lane.wait_state(LaneState.READY)
        assert lane.generation == 2


async def test_quarantine_leaves_no_queued_count_behind(tmp_path: Path) -> None:
    cfg = dataclasses.replace(supervisor_config(tmp_path, fake_command("crash_mid_request", on_request=1,
                                                                once_file=tmp_path / "once"), strikes=1,
                                          cooldown_s=0.5), health_interval_s=0.05)
    async with Supervisor(cfg) as sup:
        lane = sup.lanes["lane0"]
        with pytest.raises(EngineCrashed):
            await sup.embed_ids(rows(1), model=MODEL, pooling="mean", normalize=True)
        assert lane.state == LaneState.QUARANTINED
        with trio.fail_after(10):
            await lane.wait_state(LaneState.READY)
        rs = rows(2, 2)
        out = await sup.embed_ids(rs, model=MODEL, pooling="mean", normalize=True)
        np.testing.assert_array_equal(out[:, :3], expected_fake_rows(rs))
        assert lane.queued == 0 and lane.status()["queued"] == 0
        await wait_until(lambda: lane.rss_mb is not None, within_s=10)  # the PING refresher runs again


async def test_expired_quarantine_comes_back_without_traffic(tmp_path: Path) -> None:
    """lane0 is quarantined while lane1 serves; the router sends lane0 nothing, yet after the cool-down it is
    READY again on its own, with a fresh generation and zero strikes."""
    crash = fake_command("crash_mid_request", on_request=0)
    async with Supervisor(supervisor_config(tmp_path, crash, fake_command(), strikes=2, cooldown_s=0.5)) as sup:
        lane0, lane1 = sup.lanes["lane0"], sup.lanes["lane1"]
        for _ in range(2):
            with pytest.raises(EngineCrashed):
                await lane0.call(EmbedBatch(**batch_fields(1), raw=np.ones(1, "<i4").tobytes()))
        assert lane0.cooldown_remaining() is not None
        assert lane1.state == LaneState.READY
        quarantined = lane0.generation
        with trio.fail_after(10):
            await lane0.wait_state(LaneState.READY)
        # generations are numbered across the supervisor's lanes (lane1 has one too), so only "newer" is fixed
        assert lane0.generation > quarantined and lane0.policy.strikes == 0 and lane0.queued == 0


async def test_drain_bound_aborts_the_request_in_flight(tmp_path: Path) -> None:
    """Past daemon.drain_s the daemon sends SHUTDOWN abort_in_flight out of band to a busy worker: an ordered
    stop (no strike), and the worker hears it without waiting for a req_id of its own."""
    cfg = daemon_config(tmp_path, fake_command("slow", delay=1.0, on_request=1), daemon={"drain_s": 0.2})
    async with trio.open_nursery() as nursery:
        http, daemon = await client_for(nursery, cfg)
        lane = daemon.sup.lanes["lane0"]
        events = daemon.sup.subscribe()

        async def in_flight() -> None:
            with contextlib.suppress(httpx.HTTPError):
                async with http:  # the listener now stays open through the drain: the connection is ours to close
                    await http.post("/v1/embeddings", json={"model": MODEL, "input": ["x"]})

        nursery.start_soon(in_flight)
        await wait_until(lambda: lane.state == LaneState.BUSY)
        daemon.stop_requested.set()
    assert lane.state == LaneState.STOPPED and lane.policy.strikes == 0
    seen = []
    while True:
        try:
            seen.append(events.receive_nowait())
        except (trio.WouldBlock, trio.EndOfChannel):
            break
    assert {"t": "WORKER_STOPPED", "reason": "abort_in_flight", "lane_id": "lane0", "generation": 1} in seen


async def test_backoff_starts_over_after_a_generation_that_served(tmp_path: Path) -> None:
    """A worker killed after it served is restarted after the initial backoff every time: the backoff grows
    only across generations that served nothing (a crash loop)."""
    cfg = dataclasses.replace(supervisor_config(tmp_path, fake_command(), strikes=5),
                              restart=RestartPolicy(0.05, 30.0, 10.0))
    async with Supervisor(cfg) as sup:
        lane = sup.lanes["lane0"]
        for kill in range(4):
            await sup.embed_ids(rows(2), model=MODEL, pooling="mean", normalize=True)
            assert lane.pid is not None
            os.kill(lane.pid, signal.SIGKILL)
            with trio.fail_after(3):  # 0.05 s each time; a growing backoff would reach 50 s by the fourth
                await wait_until(lambda k=kill: lane.generation == k + 2 and lane.state == LaneState.READY,
                                 within_s=3)
