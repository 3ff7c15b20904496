"""A configured model that fails to LOAD is visible as such: a real daemon and worker, a GGUF with a tensor type
the worker does not read. Its requests get 503 model_load_failed carrying the load error (not 400
model_not_loaded), /healthz calls the lane degraded and names the error, and the start log never calls the daemon
ready."""

from __future__ import annotations

import logging
from pathlib import Path

import httpx
import pytest
import trio

pytest.importorskip("gguf")

from gguf import GGMLQuantizationType as T

from tests.support.config import REAL_WORKER, daemon_config
from tests.support.state import SESSION_STATE, short_dir
from tests.support.tiny_gguf import write_llama
from trio_gpuworker import LaneConfig, ModelConfig, WorkerError
from trio_gpuworker._proto import Generate
from trio_gpuworker.daemon.config import DaemonConfig
from trio_gpuworker.daemon.main import run_daemon

pytestmark = pytest.mark.slow
MODEL = "tiny-q2k"
WHY = "blk.0.attn_k.weight: tensor type Q2_K (GGML type 10) is not supported"


def _config(tmp_path: Path) -> DaemonConfig:
    path = write_llama(tmp_path / "tiny-q2k.gguf", lambda name: T.Q2_K if name == "blk.0.attn_k.weight" else T.Q8_0)
    return daemon_config(tmp_path, lanes=(LaneConfig("gen0", (MODEL,)),),
                         models=(ModelConfig(MODEL, path, kind="generate", format="gguf"),),
                         state_dir=SESSION_STATE, runtime_dir=short_dir("gw-loadfail-"), **REAL_WORKER)


async def test_a_model_that_failed_to_load_is_refused_with_its_error(tmp_path: Path,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="trio_gpuworker.daemon")
    async with trio.open_nursery() as nursery:
        daemon = await nursery.start(run_daemon, _config(tmp_path))  # started: every lane's first start settled
        async with httpx.AsyncClient(base_url=daemon.binds[0], timeout=30) as http:
            for path, body in (("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2}),
                               ("/v1/chat/completions", {"model": MODEL, "max_tokens": 2,
                                                         "messages": [{"role": "user", "content": "hi"}]})):
                r = await http.post(path, json=body)
                assert r.status_code == 503, r.text
                err = r.json()["error"]
                assert err["code"] == "model_load_failed" and WHY in err["message"], err
                assert WHY in err["detail"]["lanes"]["gen0"] and "config_invalid" in err["detail"]["lanes"]["gen0"]

            r = await http.get("/healthz")
            assert r.status_code == 200 and r.json()["status"] == "degraded", r.text
            [lane] = r.json()["lanes"]
            assert lane["state"] == "ready" and WHY in lane["load_errors"][MODEL]
            r = await http.get("/readyz")
            assert r.status_code == 503 and r.json()["models"][MODEL]["ready"] is False

            # the worker itself answers a request for the model with why its LOAD failed
            with pytest.raises(WorkerError) as info:
                await daemon.sup.lanes["gen0"].call(Generate(model_ref=MODEL, max_tokens=2,
                                                             raw=b"\x01\x00\x00\x00"))
            assert info.value.code == "model_load_failed" and WHY in info.value.message
            assert info.value.http_status == 503
        nursery.cancel_scope.cancel()

    messages = [r.getMessage() for r in caplog.records if r.name == "trio_gpuworker.daemon"]
    assert not any(m.startswith("gpuworkerd ready") for m in messages), messages
    assert any(m.startswith("gpuworkerd degraded") and MODEL in m and WHY in m for m in messages), messages
    assert any(m.startswith("0 of 1 lane(s) ready after ") and WHY in m for m in messages), messages
    assert any(m.startswith("lane gen0 started after ") and "models failed to load" in m for m in messages), messages
