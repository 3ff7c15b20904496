"""Smaller lifecycle defects, one test each: typed notify, the lease of a ring whose installer gave up, the
window chosen by request kind, current (not peak) RSS, the synthetic RING_FAULT's ids and order."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import numpy as np
import pytest
import trio

from tests.support.config import dataplane_config, supervisor_config
from tests.support.fakes import fake_command
from tests.support.helpers import wait_until
from tests.support.supervision import SPEC
from trio_gpuworker import BrokenWorkerError, DeadlineExceeded, Supervisor, Windows
from trio_gpuworker._proto import Ping, RingWritable
from trio_gpuworker.supervisor._exchange import silence_window


async def test_notify_to_a_generation_that_is_gone_is_typed(tmp_path):
    async with Supervisor(supervisor_config(tmp_path, fake_command())) as sup:
        lane = sup.lanes["lane0"]
        await sup.wait_ready(10)
        with pytest.raises(BrokenWorkerError):
            await lane.notify(lane.generation + 1, RingWritable(ring_id=1))


def test_the_window_comes_from_the_request_kind_not_the_reported_phase():
    w = Windows(inference_s=120, setup_s=600, control_s=30, load_s=600)
    assert [silence_window(w, t) for t in ("EMBED_BATCH", "RERANK", "GENERATE", "EXECUTE_STEP")] == [120] * 4
    assert silence_window(w, "LOAD") == 600 and silence_window(w, "PING") == 30


async def test_a_ring_whose_installer_gave_up_leaves_no_lease(tmp_path):
    async with Supervisor(dataplane_config(tmp_path)) as sup:
        dp = sup.dataplane
        for _ in range(3):
            with pytest.raises(DeadlineExceeded):
                await dp.install_ring("dp", direction="egress", capacity=4096, object_spec=SPEC, port_id="o",
                                      timeout=0)
        await wait_until(lambda: not sup.arena.live() and not dp.ends, within_s=10.0)
        ring = await dp.install_ring("dp", direction="ingress", capacity=4096, object_spec=SPEC, port_id="in")
        assert [le.ring_id for le in sup.arena.live()] == [ring.ring_id]  # the lane still works


async def test_pong_reports_the_current_rss_not_the_peak(tmp_path):
    async with Supervisor(dataplane_config(tmp_path)) as sup:
        lane = sup.lanes["dp"]
        reply = await lane.call(Ping())
        proc = Path(f"/proc/{lane.pid}")
        now = int((proc / "statm").read_text().split()[1]) * 4096 / (1 << 20)
        peak = next(int(ln.split()[1]) / 1024 for ln in (proc / "status").read_text().splitlines()
                    if ln.startswith("VmHWM"))
        assert abs(reply.rss_mb - now) < 16 and reply.rss_mb <= peak + 1


async def test_a_crash_publishes_worker_crashed_then_ring_faults_with_their_ids(tmp_path):
    async with Supervisor(dataplane_config(tmp_path)) as sup:
        dp, lane = sup.dataplane, sup.lanes["dp"]
        egress = await dp.install_ring("dp", direction="egress", capacity=4096, object_spec=SPEC, port_id="out")
        events = sup.subscribe()
        os.kill(lane.pid, signal.SIGKILL)
        seen = []
        with trio.fail_after(10):
            while len(seen) < 2:
                ev = await events.receive()
                if ev["t"] in ("WORKER_CRASHED", "RING_FAULT"):
                    seen.append(ev)
        assert [e["t"] for e in seen] == ["WORKER_CRASHED", "RING_FAULT"]
        fault = seen[1]
        assert fault["ring_id"] == egress.ring_id and fault["port_id"] == "out" and "edge_id" in fault
        assert fault["reason"] == "worker_process_exited"
        np.testing.assert_equal(egress.fault is not None, True)
