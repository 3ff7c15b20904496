"""What a lane's state, its LOAD specs and its queued jobs are made of."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

import trio

from .._proto import Message

RELOAD = "__RELOAD__"  # lane-internal job: end this generation (ordered, no strike) and start a fresh one
SERVING = frozenset({"EMBED_BATCH", "RERANK", "GENERATE", "EXECUTE_STEP"})


class LaneState(StrEnum):
    STARTING = "starting"
    READY = "ready"
    BUSY = "busy"
    RESTARTING = "restarting"
    QUARANTINED = "quarantined"
    STOPPING = "stopping"
    STOPPED = "stopped"


@dataclass(frozen=True)
class LoadSpec:
    """What LOAD needs for one model; the supervisor resolves digests before lanes start."""

    model_ref: str
    artifact_path: Path
    digest: str
    format: str
    runtime_config: dict[str, Any]

    def load_fields(self) -> dict[str, Any]:
        """The LOAD request's fields (without req_id)."""
        return {"artifact_path": os.fspath(self.artifact_path), "artifact_digest": self.digest,
                "format": self.format, "runtime_config": self.runtime_config, "model_ref": self.model_ref}


@dataclass(eq=False)
class Job:
    t: str
    fields: dict[str, Any]
    raw: bytes | None
    on_progress: Callable[[Message], None] | None = None
    done: trio.Event = field(default_factory=trio.Event)
    result: Message | None = None
    error: BaseException | None = None
    abandoned: bool = False
    on_settled: Callable[[], None] | None = None  # the lane is done with it: answered, failed or skipped

    def finish(self, result: Message | None = None, error: BaseException | None = None) -> None:
        if not self.done.is_set():
            self.result, self.error = result, error
            self.done.set()
            if self.on_settled is not None:
                self.on_settled()
