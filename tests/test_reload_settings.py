"""A reload's settings reach the worker it starts, and only that one: a lane's configuration is one value held by
its lifecycle machine (docs/architecture.md, "Reload"). Requests queued before a reload are served with the old
settings; a model's request never starts while that model's settings change."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import trio
import trio.testing

from tests.support.config import lane, write_config
from tests.support.fakes import fake_command
from tests.support.helpers import wait_until
from tests.support.lifecycle_world import World
from trio_gpuworker._errors import DeadlineExceeded
from trio_gpuworker._proto import Outcome, PlainSettings
from trio_gpuworker.daemon.config import load_config
from trio_gpuworker.daemon.main import run_daemon
from trio_gpuworker.supervisor import LaneState, ModelGate


def cmdline(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")


def environ(pid: int) -> dict[str, str]:
    pairs = (item.split("=", 1) for item in Path(f"/proc/{pid}/environ").read_bytes().decode().split("\0") if item)
    return dict(pairs)


async def test_a_reload_starts_the_worker_with_the_new_env_command_and_standby(tmp_path: Path) -> None:
    path = write_config(tmp_path, lanes=[lane("lane0", ["m1"], COLOUR="red")])
    async with trio.open_nursery() as nursery:
        daemon = await nursery.start(lambda task_status: run_daemon(
            load_config(path, {}), config_path=path, task_status=task_status))
        sup = daemon.sup
        lane0 = sup.lanes["lane0"]
        first = lane0.pid
        assert first is not None and environ(first)["COLOUR"] == "red"
        new_command = fake_command("slow", delay=0.01, on_request=99)
        write_config(tmp_path, lanes=[{**lane("lane0", ["m1"], new_command, COLOUR="blue"), "standby": True}])
        report = await daemon.reload_config()
        assert report["reloaded"] == ["lane0"]
        [line] = report["changes"]
        assert line.startswith("lane0: ") and {"worker_command", "env", "standby"} <= set(line[7:].split(", "))
        await wait_until(lambda: lane0.state is LaneState.READY and lane0.standby is not None
                         and lane0.standby.ready)
        assert lane0.pid not in (None, first)
        assert environ(lane0.pid)["COLOUR"] == "blue"
        assert "99" in cmdline(lane0.pid) and "slow" in cmdline(lane0.pid)
        standby = lane0.standby.gen
        assert standby is not None and standby.wp.pid is not None
        assert environ(standby.wp.pid)["COLOUR"] == "blue"  # the standby is spawned with them too
        status = {s["lane_id"]: s for s in sup.status()}["lane0"]
        assert status["standby_enabled"] is True and status["generation"] == lane0.generation
        nursery.cancel_scope.cancel()


async def test_sighup_moves_a_lane_to_new_env_while_its_other_lane_serves(tmp_path: Path) -> None:
    path = write_config(tmp_path, lanes=[lane("lane0", ["m1"], COLOUR="red"), lane("lane1", ["m1"])])
    async with trio.open_nursery() as nursery:
        daemon = await nursery.start(lambda task_status: run_daemon(
            load_config(path, {}), config_path=path, task_status=task_status))
        lane0 = daemon.sup.lanes["lane0"]
        write_config(tmp_path, lanes=[lane("lane0", ["m1"], COLOUR="green"), lane("lane1", ["m1"])])
        before = lane0.generation
        os.kill(os.getpid(), signal.SIGHUP)
        await wait_until(lambda: lane0.generation != before and lane0.state is LaneState.READY)
        assert lane0.pid is not None and environ(lane0.pid)["COLOUR"] == "green"
        async with httpx.AsyncClient(base_url=daemon.binds[0], timeout=30) as http:
            lanes = (await http.get("/v1/lanes")).json()["data"]
        [row] = [x for x in lanes if x["lane_id"] == "lane0"]
        assert row["generation"] == lane0.generation and row["pid"] == lane0.pid
        nursery.cancel_scope.cancel()


def run_until(w: World, done: Callable[[], bool], limit: int = 300) -> None:
    """Answer the machine's effects as a well-behaved world would until `done()`."""
    for _ in range(limit):
        if done():
            return
        for name, args in w.choices():
            if name in ("end", "hello", "said_stopped") or (name == "fault" and args[1] == "ordered") \
                    or (name == "reply" and args[1]):
                w.do(name, args)
                break
        else:
            w.do("tick", (1.0,))
    raise AssertionError(f"not reached: {w.machine.state}")


def test_the_machine_adopts_a_reloads_settings_when_it_reaches_the_head_of_the_queue() -> None:
    """A request queued before the reload is sent with the old settings' generation; a crash restart before the
    reload's turn keeps the old settings, and the reload still restarts with the new ones (it is not taken as
    done because a fresher generation serves)."""
    w = World(standby=False, strikes=3, models=("m",))
    m = w.machine
    run_until(w, lambda: m.state is LaneState.READY)
    old, new = m.settings, PlainSettings(("m", "n"), standby=True)
    w.do("submit", ("EMBED_BATCH",))
    reload_ticket, effects = m.reload(w.now, new)
    w.tickets[reload_ticket.id] = reload_ticket
    w.apply(effects)
    first = m.active
    assert first is not None and first.open is not None and first.settings is old and m.settings is old
    w.do("fault", (first.number, "crash"))
    run_until(w, lambda: m.active is not None and m.active.number != first.number)
    assert m.active is not None and m.active.settings is old  # the reload has not had its turn yet
    run_until(w, lambda: reload_ticket.id in w.answers)
    assert w.answers[reload_ticket.id][0][0] is Outcome.RELOADED
    assert m.settings is new and m.active is not None and m.active.settings is new
    assert m.models == ["m", "n"]
    run_until(w, lambda: m.standby is not None)  # the new settings keep a standby: it is spawned with them
    assert m.standby is not None and m.standby.settings is new
    w.check()


async def test_the_gate_holds_new_requests_until_the_change_is_made_and_waits_for_those_admitted(
        autojump_clock: trio.testing.MockClock) -> None:
    gate, log = ModelGate(), []

    async def request(name: str, hold: float) -> None:
        async with gate.serving("m"):
            log.append(f"{name} in")
            await trio.sleep(hold)
        log.append(f"{name} out")

    async def change() -> None:
        async with gate.changing(["m"]):
            log.append("change")
            await trio.sleep(1)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(request, "old", 5.0)
        await trio.sleep(0.1)
        nursery.start_soon(change)
        await trio.sleep(0.1)
        nursery.start_soon(request, "new", 0.0)
    assert log == ["old in", "old out", "change", "new in", "new out"]
    assert gate.serving_now("m") == 0


async def test_two_changes_of_one_model_go_one_after_the_other_after_the_requests_admitted(
        autojump_clock: trio.testing.MockClock) -> None:
    """A second change while the first still waits for a request admitted before both: it waits too, then for
    the first to end, and never runs beside the request (make sim, seed 97922: two reloads of one model's settings
    at once, the second served the request admitted before them by a worker with the newest settings)."""
    gate, log = ModelGate(), []

    async def request() -> None:
        async with gate.serving("m"):
            log.append("old in")
            await trio.sleep(5)
        log.append("old out")

    async def change(name: str) -> None:
        async with gate.changing(["m"]):
            log.append(f"{name} in")
            await trio.sleep(1)
        log.append(f"{name} out")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(request)
        await trio.sleep(0.1)
        nursery.start_soon(change, "first")
        await trio.sleep(0.1)
        nursery.start_soon(change, "second")
    assert log == ["old in", "old out", "first in", "first out", "second in", "second out"]


async def test_a_request_waiting_at_the_gate_honours_its_deadline(autojump_clock: trio.testing.MockClock) -> None:
    gate = ModelGate()
    async with gate.changing(["m"]):
        with pytest.raises(DeadlineExceeded):
            async with gate.serving("m", deadline=trio.current_time() + 2.0):
                pass
        assert trio.current_time() == pytest.approx(2.0)
        async with gate.serving("other"):  # another model's requests are not held
            pass
