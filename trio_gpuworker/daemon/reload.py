"""SIGHUP: re-read the configuration and apply what can change while requests are in flight.

Lanes whose settings or models changed (including a model whose artifact changed on disk) get an ordered
reload: requests queued before it finish on the old worker, later ones are served by the new one. A lane
whose every model another lane also serves is drained while it reloads, so its requests go there meanwhile.
HTTP limits, admission, batching and logging apply at once; listeners, directories, windows, quarantine,
restart, arena and frame settings need a restart and are reported so.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .._config import LaneConfig, SupervisorConfig
from ..supervisor import LaneState, LoadSpec
from ..supervisor._models import DigestCache, load_spec

if TYPE_CHECKING:
    from .main import Daemon

log = logging.getLogger("trio_gpuworker.reload")

# SupervisorConfig fields a running daemon cannot change; lanes, models and max_batch_items it can.
_RESTART_FIELDS = ("state_dir", "runtime_dir", "max_frame", "windows", "quarantine", "restart", "log_ring_bytes",
                   "log_tail_bytes", "arena_bytes", "health_interval_s")


@dataclass
class ReloadReport:
    reloaded: list[str] = field(default_factory=list)  # lanes restarted in order
    added: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    models_changed: list[str] = field(default_factory=list)
    applied: list[str] = field(default_factory=list)  # settings applied without a restart
    restart_required: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def summary(self) -> str:
        parts = [f"{k.replace('_', ' ')}: {', '.join(v)}" for k, v in self.as_dict().items() if v]
        return "; ".join(parts) or "no changes"


def restart_fields(old: SupervisorConfig, new: SupervisorConfig) -> list[str]:
    return [f for f in _RESTART_FIELDS if getattr(old, f, None) != getattr(new, f, None)]


async def specs_for(sup_cfg: SupervisorConfig) -> dict[str, LoadSpec]:
    cache = DigestCache(sup_cfg.state_dir / "digests.json")
    return {m.id: await load_spec(m, cache) for m in sup_cfg.models}


async def apply_config(daemon: Daemon, new: Any) -> ReloadReport:
    """Apply DaemonConfig `new` to the running daemon (see the module docstring)."""
    from .logs import setup_logging

    sup, old = daemon.sup, daemon.cfg
    report = ReloadReport()
    new_specs = await specs_for(new.supervisor)  # ConfigError here leaves everything as it was

    # --- settings that need a restart keep their old values ----------------------------------------
    report.restart_required += [f"supervisor.{f}" for f in restart_fields(old.supervisor, new.supervisor)]
    for key in ("listen", "unix_socket"):
        if getattr(old.http, key) != getattr(new.http, key):
            report.restart_required.append(f"http.{key}")
    http = dataclasses.replace(new.http, listen=old.http.listen, unix_socket=old.http.unix_socket)
    if http != old.http:
        report.applied.append("http")
    daemon.api.http = http
    if new.admission != old.admission:
        report.applied.append("admission")
    daemon.scheduler.policy = new.admission
    if new.batching != old.batching:
        report.applied.append("batching")
    daemon.batcher.policy = new.batching
    if (new.log_format, new.log_level) != (old.log_format, old.log_level):
        setup_logging(new.log_format, new.log_level)
        report.applied.append("logging")

    # --- models and lanes --------------------------------------------------------------------------
    old_models = {m.id: m for m in old.supervisor.models}
    changed = {mid for mid, spec in new_specs.items() if daemon.specs.get(mid) != spec}
    report.models_changed = sorted(changed & set(old_models))
    for m in new.supervisor.models:
        if old_models.get(m.id) != m:
            sup.forget_tokenizer(m.id)  # cached per model: drop those whose settings changed
    old_lanes = {ln.id: ln for ln in old.supervisor.lanes}
    new_lanes = {ln.id: ln for ln in new.supervisor.lanes}
    to_reload = [lid for lid, ln in new_lanes.items() if lid in sup.lanes and lid in old_lanes
                 and (old_lanes[lid] != ln or any(m in changed for m in ln.models))]
    to_add = [ln for lid, ln in new_lanes.items() if lid not in sup.lanes]
    to_remove = [lid for lid in old_lanes if lid not in new_lanes and lid in sup.lanes]

    running = [ln for lid, ln in new_lanes.items() if lid in sup.lanes or lid in {x.id for x in to_add}]
    sup.config = dataclasses.replace(sup.config, models=new.supervisor.models, lanes=tuple(running),
                                     max_batch_items=new.supervisor.max_batch_items)
    daemon.specs = dict(new_specs)
    if new.supervisor.max_batch_items != old.supervisor.max_batch_items:
        report.applied.append("daemon.max_batch_items")

    for lane_id in to_remove:
        await daemon.remove_lane(lane_id)
        report.removed.append(lane_id)
    for lane_cfg in to_add:
        if await daemon.add_lane(lane_cfg, [new_specs[m] for m in lane_cfg.models]):
            report.added.append(lane_cfg.id)
        else:
            report.restart_required.append(f"lanes: new lane {lane_cfg.id!r}")
    for lane_id in to_reload:
        try:
            await reload_lane(daemon, new_lanes[lane_id], new_specs)
            report.reloaded.append(lane_id)
        except Exception as exc:  # one lane failing to reload must not stop the others
            log.warning("reload of lane %s failed: %s", lane_id, exc, extra={"lane_id": lane_id})
            report.errors.append(f"{lane_id}: {exc}")

    daemon.cfg = dataclasses.replace(
        new, http=http, supervisor=dataclasses.replace(
            new.supervisor, **{f: getattr(old.supervisor, f) for f in _RESTART_FIELDS
                               if hasattr(old.supervisor, f)}, lanes=sup.config.lanes))
    return report


async def reload_lane(daemon: Daemon, cfg: LaneConfig, specs: dict[str, LoadSpec]) -> None:
    """Point the lane at its new settings and restart its worker in order, drained meanwhile when other
    lanes serve all of its models."""
    sup, sched = daemon.sup, daemon.scheduler
    lane = sup.lanes[cfg.id]
    others = [ln for ln in sup.lanes.values() if ln.id != cfg.id and ln.id not in sched.drained
              and ln.state not in (LaneState.STOPPING, LaneState.STOPPED)]
    covered = all(any(m in ln.loads for ln in others) for m in cfg.models)
    drain = covered and cfg.id not in sched.drained
    lane.cfg = cfg
    lane.loads = {m: specs[m] for m in cfg.models}
    if drain:
        sched.drained.add(cfg.id)
    try:
        await sup.reload_lane(cfg.id)
    finally:
        if drain:
            sched.drained.discard(cfg.id)
    log.info("lane %s reloaded: generation %d, models %s", cfg.id, lane.generation, ", ".join(lane.models_loaded),
             extra={"lane_id": cfg.id, "generation": lane.generation})
