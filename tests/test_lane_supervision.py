"""Lanes driving real fake-worker processes: handshake rejections, crashes, hangs, deadlines, quarantine."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import numpy as np
import pytest
import trio

from tests.support.config import MODEL, supervisor_config
from tests.support.fakes import fake_command
from tests.support.helpers import wait_until
from tests.support.supervision import expected_fake_rows, pid_alive, rows
from trio_gpuworker import DeadlineExceeded, EngineCrashed, LaneState, Supervisor, Windows
from trio_gpuworker._proto import Fault
from trio_gpuworker.supervisor._spawn import kill_and_reap, spawn


async def embed(sup: Supervisor, rs: list[np.ndarray], timeout: float | None = None) -> np.ndarray:
    return await sup.embed_ids(rs, model=MODEL, pooling="mean", normalize=True, timeout=timeout)


async def test_serves_and_shuts_down_cleanly(tmp_path: Path) -> None:
    async with Supervisor(supervisor_config(tmp_path, fake_command())) as sup:
        lane = sup.lanes["lane0"]
        assert lane.state == LaneState.READY and lane.generation == 1 and lane.models_loaded == [MODEL]
        pid = lane.pid
        rs = rows(3, 5, 1)
        out = await embed(sup, rs)
        np.testing.assert_array_equal(out[:, :3], expected_fake_rows(rs))
        sock_dir = tmp_path / "run" / "gpuworker" / "workers"
        assert oct(sock_dir.stat().st_mode & 0o777) == "0o700"
        assert list(sock_dir.iterdir()) == []  # the listener is gone once the spawned worker connected
    assert lane.state == LaneState.STOPPED and lane.last_exit == "exit code 0"
    assert not pid_alive(pid)


@pytest.mark.parametrize(("behavior", "fragment"), [
    ("wrong_nonce", "nonce"),
    ("v2_hello", "v2"),
    ("frame_before_hello", "before the handshake"),
    ("frame_behind_hello", "behind HELLO"),
    ("oversize_hello", "max_frame"),
    ("garbage_hello", "CBOR"),
    ("crash_before_hello", "exit code 3"),
])
async def test_handshake_breakers_are_killed_and_quarantined(tmp_path: Path, behavior: str, fragment: str) -> None:
    async with Supervisor(supervisor_config(tmp_path, fake_command(behavior), cooldown_s=60)) as sup:
        lane = sup.lanes["lane0"]
        with trio.fail_after(10):
            await lane.wait_state(LaneState.QUARANTINED)
        assert lane.generation == 2 and lane.pid is None
        assert fragment in lane.last_error
        with pytest.raises(EngineCrashed) as info:
            await embed(sup, rows(2))
        err = info.value
        assert err.quarantined and err.lane_id == "lane0" and 0 < err.cooldown_remaining_s <= 60
        assert sup.status()[0]["state"] == "quarantined"


async def test_handshake_breaker_that_recovers_serves_the_queued_request(tmp_path: Path) -> None:
    once = tmp_path / "once"
    async with Supervisor(supervisor_config(tmp_path, fake_command("wrong_nonce", once_file=once))) as sup:
        out = await embed(sup, rows(4))
        assert out[0, 1] == 4
        lane = sup.lanes["lane0"]
        assert lane.generation == 2 and lane.policy.strikes == 0  # the served reply cleared the strike


@pytest.mark.parametrize(("behavior", "cause", "code"), [
    ("crash_mid_request", "crash", 5),
    ("crash_between_header_and_raw", "crash", 6),
    ("garbage", "protocol", None),
    ("oversize_length", "protocol", None),
    ("regressing_progress", "protocol", None),
    ("wrong_req_id", "protocol", None),
])
async def test_fault_mid_request_is_engine_crashed_then_restart(tmp_path: Path, behavior: str, cause: str,
                                                                code: int | None) -> None:
    once = tmp_path / "once"
    async with Supervisor(supervisor_config(tmp_path, fake_command(behavior, once_file=once))) as sup:
        events = sup.subscribe()
        lane = sup.lanes["lane0"]
        with pytest.raises(EngineCrashed) as info:
            await embed(sup, rows(3))
        err = info.value
        assert (err.lane_id, err.generation, err.cause) == ("lane0", 1, cause)
        if code is not None:
            assert err.exit_code == code
        assert "[lane0 g1 stderr] fake worker" in err.log_tail  # the dead worker's own output, tagged
        ev = events.receive_nowait()
        assert ev["t"] == "WORKER_CRASHED" and ev["lane_id"] == "lane0" and ev["generation"] == 1
        assert lane.policy.strikes == 1
        # the lane restarts with a new generation and serves; success resets the strike
        rs = rows(2, 6)
        out = await embed(sup, rs)
        np.testing.assert_array_equal(out[:, :3], expected_fake_rows(rs))
        assert lane.generation == 2 and lane.policy.strikes == 0


async def test_crash_carries_log_tail(tmp_path: Path) -> None:
    async with Supervisor(supervisor_config(tmp_path, fake_command("flood_stderr", on_request=1))) as sup:
        lane = sup.lanes["lane0"]
        await embed(sup, rows(1))  # floods ~1 MiB to stdout and stderr then answers
        tail = lane.log.tail(1 << 20)
        assert len(tail) <= sup.config.log_ring_bytes  # capped, however much the worker wrote
        lines = tail.splitlines()[1:]  # the first may be cut by the cap
        assert lines and all(line.startswith("[lane0 g1 stdout] fake worker flood") for line in lines)
        assert lane.log.dropped > 1 << 20  # both megabytes went through the ring, the oldest dropped
        os.kill(lane.pid, 9)
        with trio.fail_after(5):
            await lane.wait_state(LaneState.RESTARTING, LaneState.STARTING)
            await lane.wait_state(LaneState.READY)
        assert "killed by SIGKILL" in lane.last_error
        assert lane.policy.strikes == 1


async def test_silent_hang_is_killed_by_the_watchdog(tmp_path: Path) -> None:
    windows = Windows(inference_s=0.5, setup_s=5, control_s=5, load_s=5, kill_grace_s=0.5, shutdown_s=2)
    once = tmp_path / "once"
    async with Supervisor(supervisor_config(tmp_path, fake_command("hang_silent", once_file=once),
                                      windows=windows)) as sup:
        t0 = trio.current_time()
        with pytest.raises(EngineCrashed) as info:
            await embed(sup, rows(2))
        assert info.value.cause == "hang" and info.value.generation == 1
        assert 0.5 <= trio.current_time() - t0 < 4
        out = await embed(sup, rows(2))
        assert out.shape == (1, 4)


async def test_sigstopped_worker_is_killed(tmp_path: Path) -> None:
    windows = Windows(inference_s=0.5, setup_s=5, control_s=5, load_s=5, kill_grace_s=0.3, shutdown_s=2)
    async with Supervisor(supervisor_config(tmp_path, fake_command("hang_sigstop", once_file=tmp_path / "o"),
                                      windows=windows)) as sup:
        pid = sup.lanes["lane0"].pid
        with pytest.raises(EngineCrashed) as info:
            await embed(sup, rows(2))
        assert info.value.cause == "hang"
        assert not pid_alive(pid)


async def test_progress_renews_the_watchdog(tmp_path: Path) -> None:
    windows = Windows(inference_s=0.6, setup_s=5, control_s=5, load_s=5, kill_grace_s=0.5, shutdown_s=2)
    cmd = fake_command("slow", delay=1.5, progress_every=0.1)
    async with Supervisor(supervisor_config(tmp_path, cmd, windows=windows)) as sup:
        out = await embed(sup, rows(3))  # 1.5 s of work, never 0.6 s of silence
        assert out[0, 1] == 3 and sup.lanes["lane0"].generation == 1


async def test_deadline_drains_the_abandoned_reply(tmp_path: Path) -> None:
    """The caller gives up; the worker is neither killed nor struck; the next caller gets its own reply."""
    async with Supervisor(supervisor_config(tmp_path, fake_command("slow", delay=0.8, on_request=1))) as sup:
        lane = sup.lanes["lane0"]
        first = rows(7, base=100)
        with pytest.raises(DeadlineExceeded):
            await embed(sup, first, timeout=0.2)
        second = rows(2, 3, base=1)
        out = await embed(sup, second)
        np.testing.assert_array_equal(out[:, :3], expected_fake_rows(second))
        assert lane.generation == 1 and lane.policy.strikes == 0


async def test_cancelled_queued_request_never_reaches_the_worker(tmp_path: Path) -> None:
    async with Supervisor(supervisor_config(tmp_path, fake_command("slow", delay=0.5, on_request=1))) as sup:
        lane = sup.lanes["lane0"]
        first: list[np.ndarray] = []

        async def slow() -> None:
            first.append(await embed(sup, rows(1)))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(slow)
            await wait_until(lambda: lane.state == LaneState.BUSY)
            async with trio.open_nursery() as caller:
                caller.start_soon(embed, sup, rows(9))
                await wait_until(lambda: lane.queued == 1)  # queued behind the slow one
                caller.cancel_scope.cancel()  # then abandoned
        out = await embed(sup, rows(2))
        assert out[0, 3] == first[0][0, 3] + 1  # the fake's req_id column: the abandoned one was never sent


async def test_two_strikes_quarantine_then_cooldown_starts_fresh_worker(tmp_path: Path) -> None:
    cfg = supervisor_config(tmp_path, fake_command("crash_mid_request", on_request=0), cooldown_s=1.0)
    async with Supervisor(cfg) as sup:
        lane = sup.lanes["lane0"]
        for _ in range(2):
            with pytest.raises(EngineCrashed) as info:
                await embed(sup, rows(1))
            assert not info.value.quarantined
        assert lane.state == LaneState.QUARANTINED or lane.cooldown_remaining() is not None
        with pytest.raises(EngineCrashed) as info:
            await embed(sup, rows(1))
        assert info.value.quarantined and info.value.cooldown_remaining_s <= 1.0
        assert sup.status()[0]["strikes"] == 2
        await wait_until(lambda: lane.cooldown_remaining() is None)
        with pytest.raises(EngineCrashed) as info:  # fresh worker (generation 3) with zero strikes, crashes again
            await embed(sup, rows(1))
        assert not info.value.quarantined and info.value.generation == 3
        assert lane.policy.strikes == 1


async def test_clear_quarantine_lifts_it_at_once(tmp_path: Path) -> None:
    async with Supervisor(supervisor_config(tmp_path, fake_command("wrong_nonce"), cooldown_s=600)) as sup:
        lane = sup.lanes["lane0"]
        with trio.fail_after(10):
            await lane.wait_state(LaneState.QUARANTINED)
        lane.lift_quarantine()
        assert lane.cooldown_remaining() is None and lane.policy.strikes == 0


async def test_stopped_worker_is_woken_to_see_sigterm(tmp_path: Path) -> None:
    async with Supervisor(supervisor_config(tmp_path, fake_command("ignore_sigterm"))) as sup:
        lane = sup.lanes["lane0"]
        await embed(sup, rows(1))
        os.kill(lane.pid, signal.SIGSTOP)  # SHUTDOWN goes unanswered until the kill path sends SIGCONT
    assert lane.last_exit == "exit code 0"


async def test_kill_path_escalates_to_sigkill_and_reaps() -> None:
    code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(60)"
    proc = await spawn([sys.executable, "-c", code], dict(os.environ))
    assert (await proc.stdout.receive_some(16)).startswith(b"up")  # it is running with SIGTERM ignored
    t0 = trio.current_time()
    assert await kill_and_reap(proc, 0.3) == -signal.SIGKILL
    assert 0.3 <= trio.current_time() - t0 < 3
    assert not pid_alive(proc.pid)
    await proc.stdout.aclose()
    await proc.stderr.aclose()


async def test_exit_while_idle_restarts_with_new_generation(tmp_path: Path) -> None:
    async with Supervisor(supervisor_config(tmp_path, fake_command("exit_after_reply", on_request=1))) as sup:
        lane = sup.lanes["lane0"]
        events = sup.subscribe()
        await embed(sup, rows(1))
        ev = await events.receive()
        assert ev["t"] == "WORKER_CRASHED" and ev["generation"] == 1 and ev["status"] == "exit code 0"
        out = await embed(sup, rows(5))
        assert out[0, 1] == 5 and lane.generation == 2


async def test_reload_is_ordered_and_lifts_quarantine(tmp_path: Path) -> None:
    once = tmp_path / "once"
    cfg = supervisor_config(tmp_path, fake_command("crash_mid_request", on_request=0, once_file=once), cooldown_s=600)
    async with Supervisor(cfg) as sup:
        lane = sup.lanes["lane0"]
        events = sup.subscribe()
        with pytest.raises(EngineCrashed):
            await embed(sup, rows(1))
        await sup.wait_ready(5)
        gen = lane.generation
        await sup.reload_lane("lane0")  # ordered: no new fault, and outside a quarantine it forgives no strike
        assert lane.generation == gen + 1 and lane.policy.strikes == 1 and lane.state == LaneState.READY
        assert [e["t"] for e in _drain(events)] == ["WORKER_CRASHED"]
        for _ in range(2):
            lane.policy.strike(Fault.CRASH, trio.current_time())  # now quarantined
        assert lane.cooldown_remaining() is not None
        await sup.reload_lane("lane0")
        assert lane.cooldown_remaining() is None and lane.policy.strikes == 0
        out = await embed(sup, rows(3))
        assert out[0, 1] == 3


async def test_health_refresher_pings_idle_workers(tmp_path: Path) -> None:
    import dataclasses

    cfg = dataclasses.replace(supervisor_config(tmp_path, fake_command()), health_interval_s=0.05)
    async with Supervisor(cfg) as sup:
        lane = sup.lanes["lane0"]
        await wait_until(lambda: lane.rss_mb is not None)
        assert lane.rss_mb > 0 and lane.models_loaded == [MODEL]
        assert lane.policy.strikes == 0


def _drain(ch: trio.MemoryReceiveChannel) -> list[dict]:
    out = []
    while True:
        try:
            out.append(ch.receive_nowait())
        except trio.WouldBlock:
            return out
