"""Admission (byte budgets per model queue, 429 over_capacity) and the choice of lane."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from tests.support.config import MODEL, daemon_config
from tests.support.fakes import fake_command
from tests.support.helpers import wait_until
from trio_gpuworker import (
    AdmissionPolicy,
    EngineCrashed,
    InvalidRequest,
    LaneState,
    ModelLoadFailed,
    ModelLoading,
    NoLaneAvailable,
    OverCapacity,
)
from trio_gpuworker.daemon.main import run_daemon
from trio_gpuworker.supervisor import Scheduler
from trio_gpuworker.supervisor._admission import choose_lane


def test_budget_counts_queued_and_in_flight_bytes() -> None:
    s = Scheduler(AdmissionPolicy(queue_bytes=100, retry_after_s=2.5))
    with s.admit("m", 60):
        assert s.queued_bytes["m"] == 60 and s.queued["m"] == 1
        with s.admit("other", 100):  # budgets are per model
            pass
        with pytest.raises(OverCapacity) as info:
            with s.admit("m", 41):
                pass
        wire = info.value.to_wire()
        assert wire["code"] == "over_capacity"
        assert wire["detail"] == {"model": "m", "queued_bytes": 60, "budget_bytes": 100, "retry_after_s": 2.5}
        with s.admit("m", 40):
            assert s.queued_bytes["m"] == 100
    assert s.queued_bytes["m"] == 0 and s.queued["m"] == 0 and s.rejected["m"] == 1
    with pytest.raises(InvalidRequest, match=r"admission\.queue_bytes"):
        with s.admit("m", 101):  # could never fit: not a retryable 429
            pass
    with pytest.raises(RuntimeError), s.admit("m", 50):
        raise RuntimeError("released on any exit")
    assert s.queued_bytes["m"] == 0


@dataclass
class FakeLane:
    id: str
    state: LaneState = LaneState.READY
    queued: int = 0
    loads: dict[str, Any] = field(default_factory=lambda: {"m": None})
    load_errors: dict[str, str] = field(default_factory=dict)
    cooldown: float | None = None
    first: dict[str, Any] | None = None  # its first start's progress; None once settled

    def cooldown_remaining(self) -> float | None:
        return self.cooldown

    def starting_first(self) -> dict[str, Any] | None:
        return self.first

    def quarantine_error(self, remaining: float) -> EngineCrashed:
        return EngineCrashed("quarantined", lane_id=self.id, quarantined=True, cooldown_remaining_s=remaining)


def test_least_loaded_ready_lane() -> None:
    a, b, c = FakeLane("a", queued=3), FakeLane("b", state=LaneState.BUSY, queued=1), FakeLane("c", queued=0)
    assert choose_lane("m", [a, b, c]).id == "c"
    assert choose_lane("m", [a, b]).id == "b"  # 1 queued + 1 running < 3 queued
    starting = FakeLane("s", state=LaneState.RESTARTING)
    assert choose_lane("m", [a, starting]).id == "a"  # a ready lane before an idle one that is not up
    assert choose_lane("m", [starting]).id == "s"  # requests wait for a lane coming up
    failed = FakeLane("f", load_errors={"m": "artifact_invalid: bad"})
    assert choose_lane("m", [failed, a]).id == "a"
    assert choose_lane("m", [a, c], drained={"c"}).id == "a"
    with pytest.raises(NoLaneAvailable, match="drained"):
        choose_lane("m", [a], drained={"a"})
    with pytest.raises(NoLaneAvailable, match="configured"):
        choose_lane("x", [a])
    loading = {"phase": "load", "model": "m", "steps": 2, "elapsed_s": 3.0}
    first = FakeLane("n", state=LaneState.LOADING, first=loading)
    with pytest.raises(ModelLoading) as loading_info:  # refused, not queued behind a first LOAD
        choose_lane("m", [first, FakeLane("n2", state=LaneState.STARTING, first={**loading, "phase": "spawn"})])
    assert loading_info.value.code == "model_loading" and loading_info.value.retry_after_s > 0
    assert set(loading_info.value.to_wire()["detail"]["lanes"]) == {"n", "n2"}
    assert "n loading m (2 steps, 3 s)" in str(loading_info.value)
    assert choose_lane("m", [first, a]).id == "a"  # another lane serves it already
    assert choose_lane("m", [first, starting]).id == "s"  # a restart (past its first start) queues as before
    q1, q2 = FakeLane("q1", cooldown=30.0), FakeLane("q2", cooldown=10.0)
    assert choose_lane("m", [q1, a]).id == "a"
    with pytest.raises(EngineCrashed) as info:
        choose_lane("m", [q1, q2])
    assert info.value.lane_id == "q2" and info.value.cooldown_remaining_s == 10.0


def test_a_model_whose_load_failed_on_every_lane_is_refused_with_the_errors() -> None:
    failed = FakeLane("f", load_errors={"m": "config_invalid: blk.0.attn_k.weight: tensor type Q2_K"})
    failed2 = FakeLane("g", state=LaneState.BUSY, load_errors={"m": "artifact_invalid: sha256 mismatch"})
    with pytest.raises(ModelLoadFailed) as info:
        choose_lane("m", [failed, failed2])
    assert info.value.code == "model_load_failed" and info.value.http_status == 503
    assert info.value.to_wire()["detail"] == {"model": "m", "lanes": {"f": failed.load_errors["m"],
                                                                      "g": failed2.load_errors["m"]}}
    assert "lane f: config_invalid: blk.0.attn_k.weight: tensor type Q2_K" in str(info.value)
    assert choose_lane("m", [failed, FakeLane("a")]).id == "a"  # another lane loaded it
    # a lane whose fresh worker may load it yet: not refused here (the failed lane's worker answers with its error)
    restarting = FakeLane("r", state=LaneState.RESTARTING)
    assert choose_lane("m", [failed, restarting]).id == "f"
    first = FakeLane("n", state=LaneState.LOADING, first={"phase": "load", "model": "m", "steps": 1, "elapsed_s": 1})
    assert choose_lane("m", [failed, first]).id == "f"
    assert choose_lane("n", [FakeLane("h", loads={"n": None}, load_errors={"m": "bad"})]).id == "h"  # another model


async def test_over_budget_is_429_with_retry_after(tmp_path: Path) -> None:
    """A slow request holds most of a 200-byte budget; a request that does not fit beside it gets a typed
    429, one that can never fit a 400; once the slow one is done the same request is admitted. Admission comes
    before tokenization, so it counts an upper bound: 4 bytes per (UTF-8 byte + 2 specials) of each input."""
    cfg = daemon_config(tmp_path, fake_command("slow", delay=0.5, on_request=1),
                        daemon={"admission": AdmissionPolicy(queue_bytes=200, retry_after_s=2)})
    async with trio.open_nursery() as nursery:
        daemon = await nursery.start(run_daemon, cfg)
        sup, binds = daemon.sup, daemon.binds
        async with httpx.AsyncClient(base_url=binds[0], timeout=30) as http:
            done: list[int] = []

            async def slow() -> None:
                r = await http.post("/v1/embeddings", json={"model": MODEL, "input": ["hello world"] * 3})
                done.append(r.status_code)  # 3 x (11 + 2) x 4 = 156 bytes

            nursery.start_soon(slow)
            await wait_until(lambda: sup.lanes["lane0"].state == LaneState.BUSY)
            r = await http.post("/v1/embeddings", json={"model": MODEL, "input": ["hello world", "x"]})  # 52 + 12 bytes
            assert r.status_code == 429 and r.headers["retry-after"] == "2"
            err = r.json()["error"]
            assert err["code"] == "over_capacity" and err["detail"]["budget_bytes"] == 200
            assert err["detail"]["queued_bytes"] == 156 and err["detail"]["model"] == MODEL
            r = await http.post("/v1/embeddings", json={"model": MODEL, "input": ["hello world"] * 5})  # 260 bytes
            assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request"
            await wait_until(lambda: bool(done))
            r = await http.post("/v1/embeddings", json={"model": MODEL, "input": ["hello world", "x"]})
            assert done == [200] and r.status_code == 200
        nursery.cancel_scope.cancel()
