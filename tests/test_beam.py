"""BEAM-tuned kernels at LOAD (worker/_beam.py): a real worker searches once for its warm-up shapes, stores the
results in the state directory's kernel cache and the captured shapes in its JIT cache; a later worker restores them,
and one without the JIT cache finds every kernel in the kernel cache and searches nothing. A tiny random BERT keeps
the search short; MiniLM's cost is in the README."""

from __future__ import annotations

import io
import shutil
from pathlib import Path

import numpy as np
import pytest
import trio

from tests.support.tiny_bert import IDS, tiny_daemon_config
from trio_gpuworker import ConfigError, Supervisor, SupervisorConfig
from trio_gpuworker.daemon import ctl
from trio_gpuworker.daemon.config import load_config, parse_config
from trio_gpuworker.daemon.tuned import TunedRecord
from trio_gpuworker.worker._beam import BeamStats, check_beam


async def embed_on_fresh_worker(cfg: SupervisorConfig) -> tuple[np.ndarray, str]:
    async with Supervisor(cfg) as sup:
        vecs = await sup.embed_ids(IDS, model="tiny", pooling="mean", normalize=True)
        return vecs, sup.lanes[sup.config.lanes[0].id].log.tail(8192)


def tune(conf: Path, *extra: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    rc = ctl.main(["tune", "tiny", "--config", str(conf), *extra], out=out, err=err)
    return rc, out.getvalue(), err.getvalue()


@pytest.mark.slow
async def test_tune_then_workers_search_nothing(tmp_path: Path) -> None:
    conf = tiny_daemon_config(tmp_path, 1)
    # gpuworkerctl tune: a real search, with a progress bar by warm-up shape
    rc, out, err = await trio.to_thread.run_sync(tune, conf)
    assert rc == 0, err
    assert "shape 1/1" in err and "done" in err and "beam 1 on CPU" in out, (out, err)
    searched = int(out.split("beam 1 on CPU, beam 1: ")[1].split(" kernel(s)")[0])
    assert searched > 0
    cfg = load_config(conf).supervisor
    assert TunedRecord(cfg.state_dir).has(cfg.model("tiny"), "CPU")  # a daemon started now tunes nothing again
    # the daemon's next worker restores the tuned shape from the JIT cache (and compiles the other shapes, untuned)
    tuned, log = await embed_on_fresh_worker(cfg)
    assert "jit cache hit, 1 shape(s) restored, 10 compiled" in log and "kernel(s) searched" not in log, log
    # one that must compile the tuned shape again finds every BEAM result in CACHEDB: no search
    shutil.rmtree(tmp_path / "state" / "cache" / "jit")
    rebuilt, log = await embed_on_fresh_worker(cfg)
    assert "beam 1: every kernel from the cache" in log and "jit cache miss" in log, log
    np.testing.assert_array_equal(rebuilt, tuned)  # the same tuned kernels, restored or compiled
    # tuned kernels compute what tinygrad's hand-coded ones do
    plain, _ = await embed_on_fresh_worker(load_config(tiny_daemon_config(tmp_path, 0)).supervisor)
    np.testing.assert_allclose(tuned, plain, rtol=0, atol=1e-5)
    rc, out, _ = await trio.to_thread.run_sync(tune, conf)
    assert rc == 0 and "already tuned" in out, out


def test_tune_refuses_beam_zero_and_unknown_models(tmp_path: Path) -> None:
    conf = tiny_daemon_config(tmp_path, 0)
    rc, _, err = tune(conf)
    assert rc == 1 and "models.tiny.beam is 0: nothing to tune" in err, err
    out, err_io = io.StringIO(), io.StringIO()
    assert ctl.main(["tune", "nope", "--config", str(conf)], out=out, err=err_io) == 1
    assert "nope" in err_io.getvalue()


def test_beam_values() -> None:
    assert [check_beam(v) for v in (0, 1, 8)] == [0, 1, 8]
    for bad in (-1, 9, True, 1.5, "2"):
        with pytest.raises(ValueError, match=r"beam must be an int within 0\.\.8"):
            check_beam(bad)
    assert "2 kernel(s) searched" in BeamStats(1, 2, 3.0).describe()
    assert "every kernel from the cache" in BeamStats(1, 0, 0.1).describe()


@pytest.mark.parametrize("value", ["-1", "9", "'2'", "true"])
def test_beam_config_key(value: str) -> None:
    text = f'[models.m]\npath = "/etc/hostname"\nbeam = {value}\n[[lanes]]\nid = "a"\nmodels = ["m"]\n'
    with pytest.raises(ConfigError, match=r"models\.m\.beam"):
        parse_config(text, Path.cwd(), {})


def test_beam_config_default_and_value() -> None:
    text = '[models.m]\npath = "/etc/hostname"\n{}[[lanes]]\nid = "a"\nmodels = ["m"]\n'
    assert parse_config(text.format(""), Path.cwd(), {}).supervisor.models[0].beam == 0
    assert parse_config(text.format("beam = 2\n"), Path.cwd(), {}).supervisor.models[0].beam == 2
