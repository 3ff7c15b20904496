"""gpuworkerd as systemd runs it: the unit file verifies, and the real process speaks sd_notify on a datagram
socket, serves on its Unix socket, and on SIGTERM drains within its bound and exits 0."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from functools import partial
from pathlib import Path

import httpx
import pytest
import trio

from tests.support.config import lane, write_config
from tests.support.fake_systemd import FakeSystemd
from tests.support.fakes import fake_command
from tests.support.helpers import wait_until

ROOT = Path(__file__).resolve().parent.parent
UNIT = ROOT / "conf" / "gpuworkerd.service"


def unit_settings() -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in UNIT.read_text().splitlines():
        if "=" in line and not line.lstrip().startswith(("#", "[")):
            key, _, value = line.partition("=")
            out.setdefault(key.strip(), []).append(value.strip())
    return out


def test_unit_has_what_a_notify_service_needs() -> None:
    u = unit_settings()
    assert u["Type"] == ["notify"] and u["Restart"] == ["on-failure"] and int(u["WatchdogSec"][0]) > 0
    assert u["RuntimeDirectory"] == ["gpuworkerd"] and u["StateDirectory"] == ["gpuworkerd"]
    assert u["ExecReload"] == ["/bin/kill -HUP $MAINPID"] and u["KillMode"] == ["mixed"]
    for key in ("NoNewPrivileges", "ProtectHome", "PrivateTmp", "ProtectKernelTunables", "RestrictSUIDSGID"):
        assert u[key] == ["yes"], key
    assert u["ProtectSystem"] == ["strict"] and u["DevicePolicy"] == ["closed"]
    assert "PrivateDevices" not in u and "MemoryDenyWriteExecute" not in u  # GPUs, and JIT-compiled kernels
    # stopping has room for the drain, the workers' SHUTDOWN and the kill grace of the default config
    assert int(u["TimeoutStopSec"][0]) >= 30 + 10 + 5


def test_systemd_analyze_verify(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:  # the Makefile's system step installs it (Debian package `systemd`)
        pytest.skip("systemd-analyze is not installed (apt-get install systemd)")
    unit = tmp_path / "gpuworkerd.service"
    unit.write_text(UNIT.read_text().replace("/opt/trio-gpuworker", str(ROOT)))  # the paths as installed here
    r = subprocess.run([analyze, "verify", unit], capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 0 and not r.stderr.strip(), r.stderr


async def test_the_process_under_a_fake_systemd(tmp_path: Path) -> None:
    slow = fake_command("slow", delay=0.8, on_request=1)
    path = write_config(tmp_path, lanes=[lane("lane0", ["m1"], slow)])
    path.write_text(path.read_text().replace('listen = "127.0.0.1:0"', 'listen = ""'))
    sd = FakeSystemd(str(tmp_path / "notify"))
    env = {**os.environ, "NOTIFY_SOCKET": sd.address, "WATCHDOG_USEC": "400000", "JOURNAL_STREAM": ""}
    async with trio.open_nursery() as nursery:
        await nursery.start(sd.run)
        log = (tmp_path / "stderr").open("wb")
        proc = await nursery.start(partial(
            trio.run_process, [sys.executable, ROOT / "bin" / "gpuworkerd", "--config", path, "--log-format", "json"],
            env=env, cwd=ROOT, stderr=log, check=False))
        await sd.wait_for(lambda: "READY=1" in sd.lines())
        await sd.wait_for(lambda: sd.count("WATCHDOG=1") >= 2)
        sock = str(tmp_path / "api.sock")
        async with httpx.AsyncClient(base_url="http://gpuworkerd", timeout=30,
                                     transport=httpx.AsyncHTTPTransport(uds=sock)) as http:
            worker_pid = (await http.get("/v1/lanes")).json()["data"][0]["pid"]
            results: list[int] = []

            async def in_flight() -> None:
                results.append((await http.post("/v1/embeddings", json={"model": "m1", "input": "x"})).status_code)

            async with trio.open_nursery() as requests:
                requests.start_soon(in_flight)
                await trio.sleep(0.2)
                proc.send_signal(signal.SIGTERM)
                await sd.wait_for(lambda: "STOPPING=1" in sd.lines())
        assert results == [200]  # finished while draining
        with trio.fail_after(10):
            rc = await proc.wait()
        assert rc == 0
        assert "STATUS=stopped" in sd.lines()
        await wait_until(lambda: not os.path.exists(f"/proc/{worker_pid}"))
        nursery.cancel_scope.cancel()
    log.close()
    records = [json.loads(line) for line in (tmp_path / "stderr").read_text().splitlines()]
    assert any(r["msg"].startswith("gpuworkerd ready") for r in records)
    assert records[-1]["msg"] == "gpuworkerd stopped"


async def test_drain_is_bounded(tmp_path: Path) -> None:
    """A request that outlives daemon.drain_s does not hold the stop up: after the drain bound the workers get
    windows.shutdown_s, then the kill path; the process still exits 0."""
    path = write_config(tmp_path, lanes=[lane("lane0", ["m1"], fake_command("hang_silent", on_request=1))])
    text = path.read_text().replace('listen = "127.0.0.1:0"', 'listen = ""')
    text = text.replace("[daemon]\n", "[daemon]\ndrain_s = 0.3\n").replace("shutdown_s = 2.0", "shutdown_s = 0.5")
    path.write_text(text)
    sd = FakeSystemd(str(tmp_path / "notify"))
    async with trio.open_nursery() as nursery:
        await nursery.start(sd.run)
        proc = await nursery.start(partial(
            trio.run_process, [sys.executable, ROOT / "bin" / "gpuworkerd", "--config", path],
            env={**os.environ, "NOTIFY_SOCKET": sd.address}, cwd=ROOT, capture_stderr=True, check=False))
        await sd.wait_for(lambda: "READY=1" in sd.lines())
        async with httpx.AsyncClient(base_url="http://gpuworkerd", timeout=30, transport=httpx.AsyncHTTPTransport(
                uds=str(tmp_path / "api.sock"))) as http:
            results: list[int] = []

            async def stuck() -> None:
                try:
                    results.append((await http.post("/v1/embeddings", json={"model": "m1", "input": "x"})).status_code)
                except httpx.RemoteProtocolError:  # the process ended with the request still unanswered
                    results.append(0)

            async with trio.open_nursery() as requests:
                requests.start_soon(stuck)
                await trio.sleep(0.2)
                t0 = trio.current_time()
                proc.send_signal(signal.SIGTERM)
                with trio.fail_after(5):
                    rc = await proc.wait()
                stopped_in = trio.current_time() - t0
        assert rc == 0 and stopped_in < 0.3 + 0.5 + 0.5 + 1.5, stopped_in
        assert results and results[0] != 200
        nursery.cancel_scope.cancel()
