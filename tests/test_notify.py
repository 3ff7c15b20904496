"""sd_notify on a real datagram socket standing in for systemd's NOTIFY_SOCKET."""

from __future__ import annotations

import os
import secrets
import signal
from pathlib import Path

import httpx
import trio

from tests.support.config import MODEL, daemon_config
from tests.support.fake_systemd import FakeSystemd
from tests.support.fakes import fake_command
from trio_gpuworker.daemon.main import run_daemon
from trio_gpuworker.daemon.notify import Notifier


async def test_notifier_path_and_abstract_sockets(tmp_path: Path) -> None:
    for address in (str(tmp_path / "notify"), f"@gpuworker-test-{secrets.token_hex(4)}"):
        sd = FakeSystemd(address)
        async with trio.open_nursery() as nursery:
            await nursery.start(sd.run)
            n = Notifier(address)
            assert n.ready("serving") and n.watchdog() and n.stopping("bye")
            await sd.wait_for(lambda sd=sd: len(sd.messages) == 3)
            assert sd.messages == [["READY=1", "STATUS=serving"], ["WATCHDOG=1"], ["STOPPING=1", "STATUS=bye"]]
            n.close()
            nursery.cancel_scope.cancel()
    assert not Notifier(None).notify("READY=1")  # no systemd: a no-op
    lost = Notifier(str(tmp_path / "nobody"))
    assert not lost.notify("READY=1")  # nobody listening: logged, never raised
    lost.close()


def test_from_env_reads_and_unsets() -> None:
    env = {"NOTIFY_SOCKET": "/run/systemd/notify", "WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(os.getpid())}
    n = Notifier.from_env(env, unset=True)
    assert n.address == "/run/systemd/notify" and n.watchdog_interval_s == 15.0 and env == {}
    other = Notifier.from_env({"NOTIFY_SOCKET": "x", "WATCHDOG_USEC": "1000", "WATCHDOG_PID": "1"})
    assert other.watchdog_interval_s is None  # the watchdog is meant for another process


async def test_daemon_lifecycle_notifications(tmp_path: Path) -> None:
    """STATUS while starting, READY=1 once lanes are up, WATCHDOG=1 while healthy and none once a lane task
    has died, STOPPING=1 on SIGTERM."""
    sd = FakeSystemd(str(tmp_path / "notify"))
    env = {"NOTIFY_SOCKET": sd.address, "WATCHDOG_USEC": "200000"}  # a ping every 0.1 s
    async with trio.open_nursery() as nursery:
        await nursery.start(sd.run)
        daemon = await nursery.start(lambda task_status: run_daemon(
            daemon_config(tmp_path, fake_command(), fake_command()), env=env, task_status=task_status))
        sup, binds = daemon.sup, daemon.binds
        await sd.wait_for(lambda: "READY=1" in sd.lines())
        lines = sd.lines()
        assert lines[0].startswith("STATUS=starting")
        assert "READY=1" in lines
        status = lines[lines.index("READY=1") + 1]
        assert status.startswith("STATUS=serving: 2/2 lanes ready"), status
        await sd.wait_for(lambda: sd.count("WATCHDOG=1") >= 3)
        async with httpx.AsyncClient(base_url=binds[0]) as http:
            assert (await http.post("/v1/embeddings", json={"model": MODEL, "input": "x"})).status_code == 200

        sup.lanes["lane1"].close()  # its task ends: the supervisor is no longer whole
        await sd.wait_for(lambda: any(x.startswith("STATUS=unhealthy: lane task ended: lane1") for x in sd.lines()))
        pings = sd.count("WATCHDOG=1")
        await trio.sleep(0.5)
        assert sd.count("WATCHDOG=1") == pings  # systemd's watchdog would now restart the service

        os.kill(os.getpid(), signal.SIGTERM)
        await sd.wait_for(lambda: "STOPPING=1" in sd.lines())
        await sd.wait_for(lambda: "STATUS=stopped" in sd.lines())
        nursery.cancel_scope.cancel()
