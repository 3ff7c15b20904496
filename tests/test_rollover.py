"""Roll-over (docs/architecture.md, 'Roll-over'): a lane's worker replaced by one with new settings (a tuner's kernels)
without failing or
delaying a request, against scripted fake workers that record what each LOAD asked for. The lifecycle's own
rules for it are in test_proto_lifecycle.py."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import trio

from tests.support.config import MODEL, supervisor_config
from tests.support.fakes import fake_command
from tests.support.supervision import expected_fake_rows, pid_alive, rows
from trio_gpuworker import Supervisor, SupervisorConfig
from trio_gpuworker._kinds import EncoderRuntime

BEAM = 2


def graph_model(cfg: SupervisorConfig, *, standby: bool) -> SupervisorConfig:
    """The fake model as a tinygrad-generated encoder with a beam: what a tuner changes."""
    models = tuple(dataclasses.replace(m, beam=BEAM, runtime_config=EncoderRuntime(encoder="graph"))
                   for m in cfg.models)
    lanes = tuple(dataclasses.replace(ln, standby=standby) for ln in cfg.lanes)
    return dataclasses.replace(cfg, models=models, lanes=lanes)


def loads(path: Path) -> dict[int, int]:
    """pid -> the beam its LOAD asked for."""
    out = {}
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        out[rec["pid"]] = rec["runtime_config"]["beam"]
    return out


@pytest.mark.parametrize("standby", [False, True])
async def test_an_untuned_lane_rolls_over_under_steady_load_and_fails_no_request(tmp_path: Path,
                                                                                  standby: bool) -> None:
    record = tmp_path / "loads.jsonl"
    load_s = 1.2  # each LOAD; a request that waited for one would take at least this long
    cmd = fake_command(record_loads=record, delay=0.005, load_delay=load_s)
    cfg = graph_model(supervisor_config(tmp_path, cmd, cmd), standby=standby)
    served, failed, took = 0, [], []
    async with Supervisor(cfg, untuned=frozenset({MODEL})) as sup:
        old = {ln.id: (ln.generation, ln.pid) for ln in sup.lanes.values()}
        assert {s["lane_id"]: s["kernels"] for s in sup.status()} == {"lane0": {MODEL: "untuned"},
                                                                      "lane1": {MODEL: "untuned"}}

        async def client(k: int) -> None:
            nonlocal served
            while True:
                rs = rows(1 + k, 3)
                t0 = trio.current_time()
                try:
                    out = await sup.embed_ids(rs, model=MODEL, pooling="mean", normalize=True)
                except Exception as exc:  # every failure is the finding
                    failed.append(exc)
                    continue
                took.append(trio.current_time() - t0)
                np.testing.assert_array_equal(out[:, :3], expected_fake_rows(rs))
                served += 1

        async with trio.open_nursery() as nursery:
            for k in range(4):
                nursery.start_soon(client, k)
            await trio.sleep(0.3)
            before = served
            with trio.fail_after(20):
                rolled = await sup.roll_over(MODEL, timeout=15)
            await trio.sleep(0.3)
            nursery.cancel_scope.cancel()
        assert rolled == ["lane0", "lane1"]
        assert failed == [] and served > before  # served throughout, nothing failed
        # and nothing waited for a successor's LOAD: the old worker served until the successor was ready
        assert max(took) < load_s, f"a request took {max(took):.2f} s, as long as a LOAD ({load_s} s)"
        for ln in sup.lanes.values():
            gen, pid = old[ln.id]
            assert ln.generation > gen and ln.pid != pid and ln.status()["rollovers"] == 1
            assert sup.lane_status(ln)["kernels"] == {MODEL: "tuned"} and ln.policy.strikes == 0
            assert pid is not None and not pid_alive(pid)  # stopped in order and reaped
        asked = loads(record)
        assert sorted(asked[ln.pid] for ln in sup.lanes.values() if ln.pid) == [BEAM, BEAM]
        assert [asked[pid] for _, pid in old.values() if pid] == [0, 0]
        assert MODEL not in sup.untuned


async def test_a_lane_without_the_model_is_left_alone_and_a_closing_lane_rolls_nothing(tmp_path: Path) -> None:
    cfg = graph_model(supervisor_config(tmp_path, fake_command()), standby=False)
    async with Supervisor(cfg, untuned=frozenset({MODEL})) as sup:
        lane = sup.lanes["lane0"]
        gen = lane.generation
        lane.close()
        assert await sup.roll_over(MODEL) == []
        assert lane.generation == gen and lane.status()["rollovers"] == 0
