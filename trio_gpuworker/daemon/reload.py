"""SIGHUP planning: what a new configuration changes in a running daemon, as frozen data.

`plan_reload` is pure: it compares two configurations and what runs now, and returns a ReloadPlan that the
Daemon (main.py) carries out. The rules:
- Lanes whose settings or models changed (including a model whose artifact changed on disk, seen as a new
  LoadSpec) get an ordered reload: requests queued before it finish on the old worker, later ones are
  served by the new one. The Daemon drains a lane while it reloads when other lanes serve all its models.
- Lanes new to the configuration start; lanes gone from it finish what is queued and stop.
- HTTP limits, admission, batching, logging and `daemon.max_batch_items` apply at once.
- Listeners, directories, windows, quarantine, restart, arena and frame settings need a restart: they keep
  their old values and the plan names them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING

from .._config import LaneConfig, ModelConfig, SupervisorConfig

if TYPE_CHECKING:
    from ..supervisor import LoadSpec
    from .config import DaemonConfig, HttpConfig

# SupervisorConfig fields a running daemon cannot change; lanes, models and max_batch_items it can.
RESTART_FIELDS = ("state_dir", "runtime_dir", "max_frame", "windows", "quarantine", "restart", "log_ring_bytes",
                  "log_tail_bytes", "arena_bytes", "health_interval_s")
HTTP_RESTART_FIELDS = ("listen", "unix_socket")


@dataclass(frozen=True)
class Running:
    """What the daemon runs when the reload starts."""

    lanes: frozenset[str]  # lane ids the supervisor runs
    specs: Mapping[str, LoadSpec]  # model id -> the LoadSpec its lanes loaded


@dataclass
class ReloadReport:
    """What a reload did; the Daemon fills in the lanes as it carries out the plan."""

    reloaded: list[str] = field(default_factory=list)  # lanes restarted in order
    changes: list[str] = field(default_factory=list)  # "lane: what changed", for each lane reloaded
    added: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    models_changed: list[str] = field(default_factory=list)
    applied: list[str] = field(default_factory=list)  # settings applied without a restart
    restart_required: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, list[str]]:
        return {f.name: list(getattr(self, f.name)) for f in dataclasses.fields(self)}

    def summary(self) -> str:
        parts = [f"{k.replace('_', ' ')}: {', '.join(v)}" for k, v in self.as_dict().items() if v]
        return "; ".join(parts) or "no changes"


@dataclass(frozen=True)
class ReloadPlan:
    config: DaemonConfig  # what the daemon runs once the plan is carried out (restart-only keys kept)
    specs: Mapping[str, LoadSpec]  # model id -> LoadSpec, for every configured model
    remove: tuple[str, ...]  # lane ids, stopped first
    add: tuple[LaneConfig, ...]  # then started
    reload: tuple[LaneConfig, ...]  # then restarted in order, with these settings
    forget_tokenizers: tuple[str, ...]  # models whose settings changed
    logging_changed: bool
    models_changed: tuple[str, ...]
    applied: tuple[str, ...]
    restart_required: tuple[str, ...]

    @property
    def http(self) -> HttpConfig:
        return self.config.http

    @property
    def lanes(self) -> tuple[LaneConfig, ...]:
        return self.config.supervisor.lanes

    @property
    def models(self) -> tuple[ModelConfig, ...]:
        return self.config.supervisor.models

    def loads(self, lane: LaneConfig) -> list[LoadSpec]:
        return [self.specs[m] for m in lane.models]

    def report(self) -> ReloadReport:
        return ReloadReport(models_changed=list(self.models_changed), applied=list(self.applied),
                            restart_required=list(self.restart_required))


def restart_fields(old: SupervisorConfig, new: SupervisorConfig) -> list[str]:
    return [f for f in RESTART_FIELDS if getattr(old, f) != getattr(new, f)]


def plan_reload(old: DaemonConfig, new: DaemonConfig, running: Running, *,
                specs: Mapping[str, LoadSpec]) -> ReloadPlan:
    """Plan the move from `old` to `new`. `specs`: the LoadSpecs of `new`'s models, digests resolved."""
    restart = [f"supervisor.{f}" for f in restart_fields(old.supervisor, new.supervisor)]
    restart += [f"http.{f}" for f in HTTP_RESTART_FIELDS if getattr(old.http, f) != getattr(new.http, f)]
    http = dataclasses.replace(new.http, **{f: getattr(old.http, f) for f in HTTP_RESTART_FIELDS})
    logging_changed = (new.log_format, new.log_level) != (old.log_format, old.log_level)
    applied = [name for name, changed in (
        ("http", http != old.http), ("admission", new.admission != old.admission),
        ("batching", new.batching != old.batching), ("logging", logging_changed),
        ("daemon.max_batch_items", new.supervisor.max_batch_items != old.supervisor.max_batch_items)) if changed]

    old_models = {m.id: m for m in old.supervisor.models}
    changed = {mid for mid, spec in specs.items() if running.specs.get(mid) != spec}
    old_lanes = {ln.id: ln for ln in old.supervisor.lanes}
    new_lanes = {ln.id: ln for ln in new.supervisor.lanes}
    reload = tuple(ln for lid, ln in new_lanes.items() if lid in running.lanes and lid in old_lanes
                   and (old_lanes[lid] != ln or any(m in changed for m in ln.models)))
    add = tuple(ln for lid, ln in new_lanes.items() if lid not in running.lanes)
    remove = tuple(lid for lid in old_lanes if lid not in new_lanes and lid in running.lanes)
    supervisor = dataclasses.replace(new.supervisor, **{f: getattr(old.supervisor, f) for f in RESTART_FIELDS},
                                     lanes=tuple(new_lanes.values()))
    return ReloadPlan(
        config=dataclasses.replace(new, http=http, supervisor=supervisor),
        specs=MappingProxyType(dict(specs)),
        remove=remove,
        add=add,
        reload=reload,
        forget_tokenizers=tuple(m.id for m in new.supervisor.models if old_models.get(m.id) != m),
        logging_changed=logging_changed,
        models_changed=tuple(sorted(changed & set(old_models))),
        applied=tuple(applied),
        restart_required=tuple(restart),
    )
