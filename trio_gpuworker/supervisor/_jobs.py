"""What a lane's LOAD specs and the jobs its callers wait on are made of."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import trio

from .._config import LaneConfig
from .._proto import Load, WireMessage


@dataclass(frozen=True)
class LoadSpec:
    """What LOAD needs for one model; the supervisor resolves digests before lanes start."""

    model_ref: str
    artifact_path: Path
    digest: str
    format: str
    runtime_config: dict[str, Any]

    def request(self) -> Load:
        """The LOAD request (its req_id is the lane's to number)."""
        return Load(artifact_path=os.fspath(self.artifact_path), artifact_digest=self.digest, format=self.format,
                    runtime_config=self.runtime_config, model_ref=self.model_ref)


@dataclass(frozen=True)
class LaneSettings:
    """Everything a lane starts a worker generation with, as one value: its configuration (command, environment,
    device, standby) and each model's LOAD. The lane's lifecycle machine holds the current value and stamps each
    generation with the one it was spawned with, so a worker, its LOADs and /v1/lanes always agree (see
    docs/architecture.md, "Reload")."""

    cfg: LaneConfig
    loads: Mapping[str, LoadSpec]  # model id -> its LOAD, in the lane's order

    @classmethod
    def of(cls, cfg: LaneConfig, loads: list[LoadSpec]) -> LaneSettings:
        return cls(cfg, {spec.model_ref: spec for spec in loads})

    @property
    def models(self) -> tuple[str, ...]:
        return tuple(self.loads)

    @property
    def standby(self) -> bool:
        return self.cfg.standby

    def with_loads(self, loads: Mapping[str, LoadSpec]) -> LaneSettings:
        return LaneSettings(self.cfg, dict(loads))

    def changes(self, new: LaneSettings) -> list[str]:
        """What moving to `new` changes, by name: the lane's fields, then each model whose LOAD differs."""
        changed = [f.name for f in fields(LaneConfig) if f.name != "models"
                   and getattr(self.cfg, f.name) != getattr(new.cfg, f.name)]
        if tuple(self.loads) != tuple(new.loads):
            changed.append("models")
        return changed + [f"model {m}" for m, spec in new.loads.items() if m in self.loads and self.loads[m] != spec]


Reply = WireMessage  # a request's terminal reply, as its class (never ERR: that is raised as WorkerError)


@dataclass(eq=False)
class Job:
    t: str  # the request's wire name, or RELOAD (the lane's own, which sends nothing by itself)
    request: WireMessage | None  # None for RELOAD
    on_progress: Callable[[WireMessage], None] | None = None  # PROGRESS, TEXT_DELTA
    done: trio.Event = field(default_factory=trio.Event)
    result: Reply | None = None
    extras: tuple[WireMessage, ...] = ()  # the intermediate replies before `result` (OBJECT_PRODUCED)
    error: BaseException | None = None
    abandoned: bool = False
    on_settled: Callable[[], None] | None = None  # the lane is done with it: answered, failed or skipped
    # its answer, even once its caller has left (an install whose caller gave up must still be undone)
    on_result: Callable[[Reply | None, BaseException | None], None] | None = None
    on_abandon: Callable[[], None] | None = None  # set while it runs where a caller's leaving can stop it
    on_started: Callable[[], None] | None = None  # written to a worker: its queue wait is over

    def abandon(self) -> None:
        """Its caller gave up (deadline or cancellation): the lane drains it, or stops it where it can."""
        self.abandoned = True
        if self.on_abandon is not None:
            self.on_abandon()

    def finish(self, result: Reply | None = None, error: BaseException | None = None,
               extras: tuple[WireMessage, ...] = ()) -> None:
        if not self.done.is_set():
            self.result, self.error, self.extras = result, error, extras
            self.done.set()
            if self.on_settled is not None:
                self.on_settled()
            if self.on_result is not None:
                self.on_result(result, error)
