"""plan_reload alone: two configurations and what runs in, a frozen ReloadPlan out; no trio, no Daemon."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from trio_gpuworker import AdmissionPolicy, BatchPolicy
from trio_gpuworker._config import LaneConfig, ModelConfig, SupervisorConfig, Windows
from trio_gpuworker.daemon import reload
from trio_gpuworker.daemon.config import DaemonConfig, HttpConfig
from trio_gpuworker.daemon.reload import ReloadPlan, Running, plan_reload
from trio_gpuworker.supervisor import LoadSpec

M1, M2 = ModelConfig("m1", Path("/m/m1.bin")), ModelConfig("m2", Path("/m/m2.bin"))
LANE0, LANE1 = LaneConfig("lane0", ("m1",)), LaneConfig("lane1", ("m1", "m2"))


def spec(model: str, digest: str = "d0") -> LoadSpec:
    return LoadSpec(model, Path(f"/m/{model}.bin"), digest, "safetensors", {})


SPECS = {"m1": spec("m1"), "m2": spec("m2")}


def config(lanes: tuple[LaneConfig, ...] = (LANE0, LANE1), models: tuple[ModelConfig, ...] = (M1, M2),
           **changes: object) -> DaemonConfig:
    sup = SupervisorConfig(lanes=lanes, models=models, state_dir=Path("/state"))
    return dataclasses.replace(DaemonConfig(supervisor=sup, http=HttpConfig(listen="127.0.0.1:1")), **changes)


def plan(old: DaemonConfig, new: DaemonConfig, running: tuple[str, ...] = ("lane0", "lane1"),
         specs: dict[str, LoadSpec] | None = None) -> ReloadPlan:
    return plan_reload(old, new, Running(frozenset(running), dict(SPECS)), specs=specs or dict(SPECS))


def test_nothing_changed() -> None:
    p = plan(config(), config())
    assert (p.remove, p.add, p.reload, p.forget_tokenizers) == ((), (), (), ())
    assert p.report().as_dict() == {k: [] for k in ("reloaded", "changes", "added", "removed", "models_changed",
                                                    "applied", "restart_required", "errors")}
    assert p.report().summary() == "no changes" and p.config == config() and not p.logging_changed


def test_lanes_added_removed_and_reloaded_in_that_plan() -> None:
    changed0 = dataclasses.replace(LANE0, env={"BEAM": "1"})
    lane2 = LaneConfig("lane2", ("m2",))
    p = plan(config(), config(lanes=(changed0, lane2)))
    assert p.remove == ("lane1",) and p.add == (lane2,) and p.reload == (changed0,)
    assert p.lanes == (changed0, lane2) and p.loads(lane2) == [SPECS["m2"]]


def test_a_configured_lane_that_does_not_run_is_added_not_reloaded() -> None:
    p = plan(config(), config(), running=("lane0",))
    assert p.add == (LANE1,) and p.reload == ()


def test_a_changed_artifact_reloads_only_the_lanes_that_serve_it() -> None:
    p = plan(config(), config(), specs={**SPECS, "m2": spec("m2", "d1")})
    assert p.reload == (LANE1,) and p.models_changed == ("m2",) and p.specs["m2"].digest == "d1"
    assert p.forget_tokenizers == ()  # the model's settings are the same


def test_changed_model_settings_drop_its_tokenizer() -> None:
    p = plan(config(), config(models=(dataclasses.replace(M1, max_tokens=8), M2)))
    assert p.forget_tokenizers == ("m1",)


def test_restart_only_settings_keep_their_old_values() -> None:
    old = config()
    new = config(http=HttpConfig(listen="127.0.0.1:2", max_body_bytes=1024),
                 supervisor=dataclasses.replace(old.supervisor, windows=Windows(inference_s=7.0), max_frame=1 << 20))
    p = plan(old, new)
    assert p.restart_required == ("supervisor.max_frame", "supervisor.windows", "http.listen")
    assert p.config.supervisor.windows == Windows() and p.config.supervisor.max_frame == old.supervisor.max_frame
    assert p.http == HttpConfig(listen="127.0.0.1:1", max_body_bytes=1024)
    assert p.applied == ("http",)


def test_settings_that_apply_at_once() -> None:
    old = config()
    new = config(admission=AdmissionPolicy(queue_bytes=4096), batching=BatchPolicy(max_delay_s=0.0),
                 log_format="json", supervisor=dataclasses.replace(old.supervisor, max_batch_items=8))
    p = plan(old, new)
    assert p.applied == ("admission", "batching", "logging", "daemon.max_batch_items")
    assert p.logging_changed and p.config.admission.queue_bytes == 4096
    assert p.config.supervisor.max_batch_items == 8 and p.reload == ()


def test_the_plan_is_frozen_data() -> None:
    p = plan(config(), config())
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.reload = (LANE0,)  # type: ignore[misc]
    with pytest.raises(TypeError):
        p.specs["m1"] = spec("m1", "x")  # type: ignore[index]


def test_the_planner_imports_neither_trio_nor_the_daemon() -> None:
    tree = ast.parse(Path(reload.__file__).read_text())
    names = {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    names |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert not {n for n in names if n.split(".")[0] == "trio" or n.endswith("main")}
