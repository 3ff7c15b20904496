"""The node's core ledger (_cores.py): a fused decoder step takes the cores of its CPU set divided among the workers
busy now, itself included; a worker's claim and busy flag end with its process, however it ends."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.support.config import supervisor_config
from tests.support.engine_example import example
from tests.support.supervision import restarted
from trio_gpuworker import LaneConfig, ModelConfig, RestartPolicy, Supervisor
from trio_gpuworker._compute import ComputeThread
from trio_gpuworker._cores import _BUSY_AT, _FLOCK, LINE, SLOTS, CoreLedger, step_threads
from trio_gpuworker._kinds import AUTO_THREADS, MAX_THREADS


@pytest.fixture
def path(tmp_path: Path) -> Path:
    return tmp_path / "cores"


def test_a_lone_busy_worker_takes_every_core_and_busy_ones_share_them(path: Path) -> None:
    a, b, c = (CoreLedger(path, 4) for _ in range(3))
    try:
        assert len({a.slot, b.slot, c.slot}) == 3
        a.busy(True)
        assert a.share() == 4  # the others are idle
        b.busy(True)
        assert a.share() == b.share() == 2
        c.busy(True)
        assert a.share() == 1  # 4 // 3: never more threads than cores between them
        b.busy(False)
        c.busy(False)
        assert a.share() == 4  # within one step of the others going idle
    finally:
        for cl in (a, b, c):
            cl.close()


def test_the_share_is_at_least_one_and_at_most_a_kernel_team(path: Path) -> None:
    many = CoreLedger(path, 64)
    one = CoreLedger(path, 1)
    try:
        many.busy(True)
        assert many.share() == MAX_THREADS
        one.busy(True)
        assert one.share() == 1 and many.share() == MAX_THREADS  # 64 // 2, as many as a kernel's team takes
    finally:
        many.close()
        one.close()


async def test_a_compute_thread_counts_its_worker_busy_exactly_while_a_job_runs(path: Path) -> None:
    """The worker's hook (worker/__main__.py): seen from another worker, this one is busy during a job (the cores
    are shared) and idle before and after it (they are not)."""
    mine, other = CoreLedger(path, 2), CoreLedger(path, 2)
    compute = ComputeThread("test-cores", on_busy=mine.busy)
    try:
        other.busy(True)
        assert other.share() == 2
        assert await compute.run(other.share) == 1
        assert other.share() == 2 and not mine._flags[mine.slot]
    finally:
        compute.close()
        mine.close()
        other.close()


def test_a_slot_given_back_is_claimed_again_and_cleared(path: Path) -> None:
    a = CoreLedger(path, 2)
    a.busy(True)
    slot = a.slot
    del a._flags  # its process "ends" without lowering its flag: only the kernel drops the lock
    a._map.close()
    a._fd, fd = -1, a._fd
    os.close(fd)
    b = CoreLedger(path, 2)
    try:
        assert b.slot == slot and not b._flags[slot]
    finally:
        b.close()


def test_a_worker_killed_mid_job_leaves_no_phantom_load(path: Path) -> None:
    """Its busy flag stays raised in the file, but its claim lock died with it: nobody counts it."""
    code = ("import sys, time; from pathlib import Path; from trio_gpuworker._cores import CoreLedger; "
            "cl = CoreLedger(Path(sys.argv[1]), 2); cl.busy(True); print(cl.slot, flush=True); time.sleep(60)")
    child = subprocess.Popen([sys.executable, "-c", code, str(path)], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        theirs = int(child.stdout.readline())
        me = CoreLedger(path, 2)
        try:
            me.busy(True)
            assert me.slot != theirs and me.share() == 1  # it is alive and busy
            child.send_signal(signal.SIGKILL)
            child.wait(10)
            assert me._flags[theirs] == 1  # still raised in the file
            assert me.share() == 2
        finally:
            me.close()
    finally:
        child.kill()
        child.wait(10)
        if child.stdout is not None:
            child.stdout.close()


def test_the_ledger_has_room_for_every_slot_and_refuses_the_next(path: Path) -> None:
    claims = [CoreLedger(path, 2) for _ in range(SLOTS)]
    try:
        assert sorted(c.slot for c in claims) == list(range(SLOTS))
        with pytest.raises(OSError, match="no free slot"):
            CoreLedger(path, 2)
    finally:
        for c in claims:
            c.close()


def test_a_configured_thread_count_is_kept_and_auto_outside_a_worker_is_one(monkeypatch: pytest.MonkeyPatch) -> None:
    from trio_gpuworker import _cores

    monkeypatch.setattr(_cores, "_LEDGER", [None])  # this process: no daemon's ledger
    assert step_threads(3) == 3
    assert step_threads(AUTO_THREADS) == 1


def claimed(path: Path) -> list[int]:
    """The slots whose claim lock a live process holds, seen from outside."""
    fd = os.open(path, os.O_RDWR)
    try:
        out = []
        for slot in range(SLOTS):
            arg = struct.pack(_FLOCK, fcntl.F_WRLCK, os.SEEK_SET, slot, 1, 0)
            if struct.unpack(_FLOCK, fcntl.fcntl(fd, fcntl.F_OFD_GETLK, arg))[0] != fcntl.F_UNLCK:
                out.append(slot)
        return out
    finally:
        os.close(fd)


async def test_every_worker_a_daemon_starts_claims_a_slot_and_its_end_gives_it_back(tmp_path: Path) -> None:
    """Two lanes of docs/engines.md's example engine (built on trio_gpuworker.engine, as the tinygrad worker is):
    each worker holds a slot of the state directory's ledger while it lives; a killed one's slot is free again and
    its successor claims one; between requests none is busy."""
    engine, artifact = tmp_path / "bow_engine.py", tmp_path / "bow.json"
    engine.write_text(example())
    artifact.write_text(json.dumps({"dims": 8}))
    lanes = tuple(LaneConfig(f"bow-{i}", ("bow",), worker_command=(sys.executable, str(engine))) for i in range(2))
    cfg = supervisor_config(tmp_path, lanes=lanes, models=(ModelConfig("bow", artifact),), restart=RestartPolicy())
    ledger = tmp_path / "state" / "cache" / "cores"
    async with Supervisor(cfg) as sup:
        await sup.embed_ids([np.array([1, 2, 3], np.int32)], model="bow", pooling="mean", normalize=True)
        assert len(claimed(ledger)) == 2
        lane = sup.lanes["bow-0"]
        assert lane.pid is not None
        os.kill(lane.pid, signal.SIGKILL)
        await restarted(lane, after=1)
        assert len(claimed(ledger)) == 2
        flags = np.frombuffer(ledger.read_bytes(), np.uint8)[_BUSY_AT::LINE]
        assert not flags.any()
    assert claimed(ledger) == []
