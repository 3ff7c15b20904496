"""Typed configuration the supervisor runs on. The TOML loader in daemon/ builds these."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import encoder_folder
from ._kinds import DEFAULT_MAX_TOKENS, EMBEDDING, KINDS, MODEL_KINDS, POOLINGS, RuntimeConfig, runtime_config

MiB = 1 << 20


@dataclass(frozen=True)
class ModelConfig:
    """One servable model: an artifact file plus how to use it."""

    id: str
    path: Path  # the artifact (.safetensors or .gguf); config.json / tokenizer.json sit beside it
    kind: str = EMBEDDING  # one of _kinds.KINDS
    format: str = "safetensors"
    digest: str | None = None  # sha256 hex; computed once at startup when absent
    pooling: str | None = None  # the default of requests; None: the folder's (encoder_folder.py), else mean
    normalize: bool | None = None  # the default of requests; None: the folder's, else unit length
    max_tokens: int = DEFAULT_MAX_TOKENS
    tokenizer_path: Path | None = None  # default: tokenizer.json beside the artifact
    # The kind's RuntimeConfig; a table given here is checked and converted (ConfigError naming the key).
    runtime_config: RuntimeConfig = field(default_factory=RuntimeConfig)
    beam: int = 0  # BEAM search width for the warm-up shapes at LOAD (0: tinygrad's hand-coded kernels)
    # Leading sizes an embedding model was trained to be cut to (Matryoshka); what `dimensions` may ask for
    matryoshka_dims: tuple[int, ...] = ()
    # a generate model's cap on the new tokens of a request that names no max_tokens (None: the context's room)
    default_max_tokens: int | None = None
    # (pooling, normalize) of requests that name neither: these keys where set, else the folder's
    defaults: tuple[str, bool] = field(init=False, repr=False, compare=False)

    def tunes_on(self, device: str) -> bool:
        """Whether a BEAM search changes this model's kernels on `device`: a `beam` and tinygrad-generated kernels
        (the fused C encoder and decoder are not searched)."""
        return self.beam > 0 and self.runtime_config.backend(device) == "graph"

    def __post_init__(self) -> None:
        # Checked here, once, so that every way of building a ModelConfig (the TOML loader, the Python API, tests)
        # hands the supervisor and the worker a valid, typed runtime_config.
        from ._errors import ConfigError

        key = f"models.{self.id}"
        if self.kind not in MODEL_KINDS:
            raise ConfigError(f"{key}.kind: {self.kind!r} is not one of {', '.join(MODEL_KINDS)}")
        rc: Any = self.runtime_config
        if type(rc) is RuntimeConfig:  # the default: no keys set
            rc = {}
        if not isinstance(rc, Mapping | RuntimeConfig):
            raise ConfigError(f"{key}.runtime_config: expected a table, got {rc!r}")
        try:
            object.__setattr__(self, "runtime_config", runtime_config(self.kind, rc))
        except ValueError as exc:
            raise ConfigError(f"{key}.runtime_config: {exc}") from exc
        if self.pooling is not None and self.pooling not in POOLINGS:
            raise ConfigError(f"{key}.pooling: {self.pooling!r} is not one of {', '.join(POOLINGS)}")
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ConfigError(f"{key}.normalize: expected bool, got {self.normalize!r}")
        folder = self.path if self.kind == EMBEDDING else None
        object.__setattr__(self, "defaults", encoder_folder.defaults(folder, self.pooling, self.normalize))

    @property
    def encoder(self) -> bool:
        """Token-id inputs cut at max_tokens (embedding, rerank), not a decoder."""
        return KINDS[self.kind].encoder


MAX_BEAM = 8  # the widest `beam` the daemon accepts and a worker runs


@dataclass(frozen=True)
class Windows:
    """Watchdog silence windows and kill grace, in seconds (reference defaults)."""

    inference_s: float = 120.0
    setup_s: float = 600.0  # spawn, connect, HELLO
    control_s: float = 600.0  # UNLOAD, PING, SHUTDOWN, ring control
    load_s: float = 600.0  # LOAD and compilation
    kill_grace_s: float = 5.0
    shutdown_s: float = 10.0  # SHUTDOWN answer + exit before we kill
    exit_status_s: float = 0.5  # after an EOF, wait this long for the worker's own exit status before killing


@dataclass(frozen=True)
class QuarantinePolicy:
    """`strikes` consecutive faults (crash, hang, protocol) quarantine a lane for `cooldown_s` (docs/architecture.md,
    'Strikes and quarantine')."""

    strikes: int = 2
    cooldown_s: float = 600.0


@dataclass(frozen=True)
class RestartPolicy:
    """The backoff before a faulted lane's next worker: `backoff_initial_s`, times `backoff_factor` per fault in a
    row, at most `backoff_max_s` (docs/architecture.md, 'Restart')."""

    backoff_initial_s: float = 0.1
    backoff_max_s: float = 30.0
    backoff_factor: float = 2.0


@dataclass(frozen=True)
class LaneConfig:
    """One lane: the models its worker serves, its device, and the command that starts the worker (any engine that
    speaks protocol v3; docs/engines.md)."""

    id: str
    models: tuple[str, ...]
    device: str = "CPU"
    worker_command: tuple[str, ...] | None = None  # default: python -m trio_gpuworker.worker
    env: dict[str, str] = field(default_factory=dict)
    standby: bool = False  # keep a second worker loaded and idle, promoted at once when the active one fails


@dataclass(frozen=True)
class AdmissionPolicy:
    """How many token-id bytes a model may have queued and in flight before requests are refused over_capacity."""

    queue_bytes: int = 64 << 20  # per model: token-id bytes queued + in flight
    retry_after_s: float = 1.0  # Retry-After of an over_capacity answer


@dataclass(frozen=True)
class BatchPolicy:
    """How embedding requests of one model are batched into one EMBED_BATCH: rows per batch, and how long a batch
    waits for company."""

    max_items: int = 256  # rows per EMBED_BATCH
    max_delay_s: float = 0.002  # how long a batch waits for company; 0 = batching off

    @property
    def enabled(self) -> bool:
        """Batching is on (a batch may wait for company)."""
        return self.max_delay_s > 0


@dataclass(frozen=True)
class SupervisorConfig:
    """Everything a Supervisor runs: its lanes and models, where it keeps state and sockets, and the supervision
    rules (watchdog windows, quarantine, restarts, frame and log sizes)."""

    lanes: tuple[LaneConfig, ...]
    models: tuple[ModelConfig, ...]
    state_dir: Path
    runtime_dir: Path | None = None  # default: $RUNTIME_DIRECTORY, else $XDG_RUNTIME_DIR, else state_dir/run
    max_frame: int = 64 * MiB
    windows: Windows = field(default_factory=Windows)
    quarantine: QuarantinePolicy = field(default_factory=QuarantinePolicy)
    restart: RestartPolicy = field(default_factory=RestartPolicy)
    log_ring_bytes: int = 64 * 1024
    log_tail_bytes: int = 8 * 1024
    max_batch_items: int = 256
    arena_bytes: int = 1 << 30  # sparse memfd ceiling shared with workers for rings; 0 disables the data plane
    health_interval_s: float = 15.0  # background PING of idle workers (rss_mb, models_loaded)

    def __post_init__(self) -> None:
        # A full EMBED_BATCH (max_batch_items rows of max_tokens int32 ids) must fit one raw frame, else a
        # valid request could only fail at the lane.
        from ._errors import ConfigError

        for m in self.models:
            if m.encoder and self.max_batch_items * m.max_tokens * 4 > self.max_frame:
                raise ConfigError(
                    f"daemon.max_batch_items ({self.max_batch_items}) x models.{m.id}.max_tokens ({m.max_tokens}) "
                    f"x 4 bytes exceeds daemon.max_frame_mib ({self.max_frame} bytes): such a batch cannot be sent")

    def model(self, model_id: str) -> ModelConfig:
        """The model `model_id`; ModelNotFound when there is none."""
        for m in self.models:
            if m.id == model_id:
                return m
        from ._errors import ModelNotFound

        raise ModelNotFound(f"unknown model {model_id!r}; configured: {[m.id for m in self.models]}")
