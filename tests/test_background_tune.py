"""Serve first, tune in the background (docs/operations.md, 'Tuning in the background'): the pacing policy under
injected time, the record of what
is tuned, and the daemon end to end on a tiny real BERT with a real BEAM search: lanes serve on untuned kernels
at once, the tuner searches in its own low-priority worker, the lane rolls over to the tuned kernels with no
request failing, and the next start loads them at once."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import numpy as np
import pytest
import trio

from tests.support.config import MODEL, daemon_config
from tests.support.fakes import fake_command
from tests.support.supervision import expected_fake_rows, rows
from tests.support.tiny_bert import IDS, tiny_daemon_config
from trio_gpuworker._kinds import EncoderRuntime
from trio_gpuworker.daemon.config import load_config
from trio_gpuworker.daemon.main import run_daemon
from trio_gpuworker.daemon.pacing import Pacer
from trio_gpuworker.daemon.tuned import TunedRecord
from trio_gpuworker.daemon.tuner import to_tune


def test_the_pacer_pauses_while_busy_but_never_starves_the_search() -> None:
    p = Pacer(max_pause_s=1.0, min_run_s=0.5)
    assert not p.paused(False, 0.0)
    assert p.paused(True, 0.1)  # a request runs: pause
    assert p.paused(True, 0.9)
    assert not p.paused(True, 1.1)  # paused long enough: run although still busy
    assert not p.paused(True, 1.5)  # and at least min_run_s
    assert p.paused(True, 1.7)
    assert not p.paused(False, 1.8)  # idle again: run at once
    assert not p.paused(False, 5.0)
    assert p.paused_s == pytest.approx(1.0 + 0.1)
    # under a steady load the search still gets a third of the time
    q, running = Pacer(max_pause_s=1.0, min_run_s=0.5), 0
    for k in range(3000):
        running += not q.paused(True, k / 100)
    assert 900 <= running <= 1100


def test_the_record_and_what_starts_untuned(tmp_path: Path) -> None:
    conf = tiny_daemon_config(tmp_path, 1)
    cfg = load_config(conf)
    record = TunedRecord(cfg.supervisor.state_dir)
    assert to_tune(cfg, record) == ["tiny"]
    mc = cfg.supervisor.model("tiny")
    record.add(mc, "CPU")
    assert to_tune(cfg, TunedRecord(cfg.supervisor.state_dir)) == []  # persisted
    wider = dataclasses.replace(mc, beam=2)
    assert not record.has(wider, "CPU") and not record.has(mc, "CUDA")  # another width, another device
    mc.path.write_bytes(mc.path.read_bytes())  # the artifact replaced (a new mtime)
    assert not TunedRecord(cfg.supervisor.state_dir).has(mc, "CPU")
    # nothing to tune: no beam, or the fused C encoder (the CPU default)
    fused = dataclasses.replace(mc, runtime_config=EncoderRuntime(encoder="fused"))
    assert not fused.tunes_on("CPU") and not dataclasses.replace(mc, beam=0).tunes_on("CPU")
    assert mc.tunes_on("CPU") and dataclasses.replace(mc, runtime_config=EncoderRuntime()).tunes_on("CUDA")


@pytest.mark.slow
async def test_the_daemon_serves_at_once_tunes_in_the_background_and_rolls_over(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="trio_gpuworker.daemon")
    cfg = load_config(tiny_daemon_config(tmp_path, 1))
    served: list[tuple[int, np.ndarray]] = []
    failed: list[BaseException] = []
    async with trio.open_nursery() as nursery:
        daemon = await nursery.start(run_daemon, cfg)
        sup, lane = daemon.sup, daemon.sup.lanes["t"]
        assert daemon.tuner is not None and sup.untuned == {"tiny"}
        await sup.wait_started()
        assert sup.lane_status(lane)["kernels"] == {"tiny": "untuned"}  # serving before any search

        async def client() -> None:
            while True:
                try:
                    served.append((lane.generation, await sup.embed_ids(IDS, model="tiny", pooling="mean",
                                                                        normalize=True)))
                except Exception as exc:  # every failure is the finding
                    failed.append(exc)
                await trio.sleep(0.2)  # a steady trickle: the search is paused while each one runs

        nursery.start_soon(client)
        with trio.fail_after(300):
            await daemon.tuner.finished.wait()
        await trio.sleep(0.5)
        status, progress = sup.lane_status(lane), dict(daemon.tuner.progress["tiny"])
        nursery.cancel_scope.cancel()
    assert progress["phase"] == "tuned", progress
    assert failed == [] and status["rollovers"] == 1 and status["kernels"] == {"tiny": "tuned"}
    gens = sorted({g for g, _ in served})
    assert len(gens) == 2, gens  # served by the untuned worker, then by the tuned one
    before = [v for g, v in served if g == gens[0]]
    after = [v for g, v in served if g == gens[1]]
    assert before and after
    np.testing.assert_allclose(after[-1], before[0], rtol=0, atol=1e-5)  # tuned kernels compute the same
    text = caplog.text
    assert "tuning tiny kernels for this CPU (beam 1, 1 shape(s)) in the background" in text
    assert "tiny: tuned kernels took over on lane(s) t" in text
    # the next start loads the tuned kernels at once: nothing left to tune
    assert to_tune(cfg, TunedRecord(cfg.supervisor.state_dir)) == []
    async with trio.open_nursery() as nursery:
        daemon = await nursery.start(run_daemon, cfg)
        await daemon.sup.wait_started()
        assert daemon.tuner is None
        assert daemon.sup.lane_status(daemon.sup.lanes["t"])["kernels"] == {"tiny": "tuned"}
        nursery.cancel_scope.cancel()


async def test_a_failed_tuner_is_logged_and_the_lanes_keep_serving_untuned(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A model tuned on a device this machine lacks: the tuner's real worker cannot start there. The daemon logs
    it, the lane (a scripted worker) keeps serving on its untuned settings, and nothing is recorded."""
    caplog.set_level(logging.INFO, logger="trio_gpuworker.daemon")
    cfg = daemon_config(tmp_path, fake_command())
    sc = cfg.supervisor
    cfg = dataclasses.replace(cfg, supervisor=dataclasses.replace(
        sc, models=tuple(dataclasses.replace(m, beam=1) for m in sc.models),
        lanes=tuple(dataclasses.replace(ln, device="CUDA") for ln in sc.lanes)))
    async with trio.open_nursery() as nursery:
        daemon = await nursery.start(run_daemon, cfg)
        assert daemon.tuner is not None and daemon.sup.untuned == {MODEL}
        with trio.fail_after(120):
            await daemon.tuner.finished.wait()
        progress = dict(daemon.tuner.progress[MODEL])
        rs = rows(2, 3)
        out = await daemon.sup.embed_ids(rs, model=MODEL, pooling="mean", normalize=True)
        status = daemon.sup.lane_status(daemon.sup.lanes["lane0"])
        nursery.cancel_scope.cancel()
    assert progress["phase"] == "failed" and progress["error"]
    np.testing.assert_array_equal(out[:, :3], expected_fake_rows(rs))
    assert status["kernels"] == {MODEL: "untuned"} and status["rollovers"] == 0
    assert f"tuning {MODEL} failed after" in caplog.text and "keep the untuned kernels" in caplog.text
    assert to_tune(cfg, TunedRecord(sc.state_dir)) == [MODEL]  # tried again at the next start
