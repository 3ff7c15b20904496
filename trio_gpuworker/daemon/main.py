"""gpuworkerd entry point: config, logging, supervisor, admission and batching, HTTP listeners, sd_notify, signals.

Life of the process:
  start    listeners bind at once, lanes spawn and load (STATUS=, the log and /healthz say how far; a model none
           of whose lanes serves yet gets 503 model_loading), READY=1 once every lane's first start settled
  serve    WATCHDOG=1 every WATCHDOG_USEC/2 while the event loop and every lane task are alive; SIGHUP
           reloads lanes and models (RELOADING=1 ... READY=1)
  SIGTERM  STOPPING=1 and /readyz 503 at once; after daemon.shutdown_delay_s (default 0) stop admitting
           (503 shutting_down); requests in flight finish within daemon.drain_s while the listeners stay
           open; then the listeners close, workers get SHUTDOWN, then the kill path; exit 0
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import signal
import sys
from collections.abc import AsyncIterator, Collection, MutableMapping
from functools import partial
from pathlib import Path

import trio
from hypercorn.trio import serve

from .._config import SupervisorConfig
from .._errors import ConfigError
from ..supervisor import (
    SERVING_STATES,
    DigestCache,
    LaneSettings,
    LaneState,
    LoadSpec,
    Supervisor,
    describe_progress,
    load_spec,
)
from .config import DaemonConfig, load_config
from .http import Api
from .listeners import API_SOCKET_MODE, hypercorn_config, prepare_unix_socket
from .logs import setup_logging
from .metrics import Metrics
from .notify import Notifier
from .reload import ReloadPlan, ReloadReport, Running, plan_reload
from .startup import StartupReport
from .tuned import TunedRecord
from .tuner import BackgroundTuner, to_tune

log = logging.getLogger("trio_gpuworker.daemon")

STATUS_INTERVAL_S = 5.0  # how often STATUS= is refreshed (more often when the watchdog asks for it)


class Daemon:
    """Everything the daemon runs around one Supervisor; `run_daemon` drives its life."""

    def __init__(self, cfg: DaemonConfig, sup: Supervisor, *, config_path: Path | None = None,
                 env: MutableMapping[str, str] | None = None, notifier: Notifier | None = None) -> None:
        self.cfg = cfg
        self.sup = sup
        self.config_path = config_path
        self.env = os.environ if env is None else env
        self.notifier = notifier or Notifier(None)
        self.metrics = Metrics(sup)
        self.api = Api(sup, cfg.http, metrics=self.metrics, reload_config=self.reload_config, liveness=self.health)
        self.binds: list[str] = []
        self.specs: dict[str, LoadSpec] = {s.model_ref: s for ln in sup.lanes.values() for s in ln.loads.values()}
        self.stopping = False
        self.stop_requested = trio.Event()
        self.stop_listeners = trio.Event()
        self.listeners_down: list[str] = []
        self.removing: set[str] = set()
        self.nursery: trio.Nursery | None = None
        self._reload_lock = trio.Lock()
        self._socket_ino: int | None = None
        self.tuner: BackgroundTuner | None = None  # models tuned in the background, if any

    def tuned(self, model: str) -> None:
        """The tuner rolled `model`'s lanes over: what they run now is what a reload compares against."""
        for lane in self.sup.lanes.values():
            if model in lane.loads:
                self.specs[model] = lane.loads[model]

    # --- listeners -----------------------------------------------------------------------------

    async def start_listeners(self, nursery: trio.Nursery) -> list[str]:
        """TCP first (admin routes only with http.admin_on_tcp), then the Unix socket (admin routes)."""
        binds: list[str] = []
        http = self.cfg.http
        if http.listen:
            binds += await nursery.start(partial(self._serve, http.listen, admin=False))
        if http.unix_socket:
            path = Path(http.unix_socket)
            prepare_unix_socket(path)
            binds += await nursery.start(partial(self._serve, f"unix:{path}", admin=True))
            os.chmod(path, API_SOCKET_MODE)
            self._socket_ino = os.stat(path).st_ino
        self.binds = binds
        return binds

    async def _serve(self, bind: str, *, admin: bool, task_status: trio.TaskStatus[list[str]]) -> None:
        try:
            await serve(self.api.listener(admin=admin), hypercorn_config(bind, self.cfg.drain_s, self.cfg.http),
                        shutdown_trigger=self.stop_listeners.wait, task_status=task_status)
        finally:
            if not self.stopping:
                self.listeners_down.append(bind)
            if bind.startswith("unix:"):
                self._remove_socket(Path(bind[len("unix:"):]))

    def _remove_socket(self, path: Path) -> None:
        """Our socket file goes with our listener; one another daemon bound there since is left alone."""
        with contextlib.suppress(OSError):
            if self._socket_ino is not None and path.lstat().st_ino == self._socket_ino:
                path.unlink()

    # --- health and sd_notify ------------------------------------------------------------------

    def health(self) -> tuple[bool, str]:
        """The supervisor side of the watchdog: every lane task alive, every listener serving."""
        if self.stopping:
            return True, "stopping"
        dead = [ln.id for ln in self.sup.lanes.values() if ln.state == LaneState.STOPPED and ln.id not in self.removing]
        if dead:
            return False, f"lane task ended: {', '.join(dead)}"
        if self.listeners_down:
            return False, f"listener stopped: {', '.join(self.listeners_down)}"
        return True, "ok"

    def status_line(self) -> str:
        lanes = self.sup.status()
        ready = sum(s["state"] in SERVING_STATES and not s["load_errors"] for s in lanes)
        notes = []
        for s in lanes:
            if s["cooldown_remaining_s"] is not None:
                notes.append(f"{s['lane_id']} quarantined ({s['cooldown_remaining_s']:.0f} s left)")
            elif s["state"] not in SERVING_STATES:
                notes.append(f"{s['lane_id']} {s['state']}")
            elif s["load_errors"]:
                notes.append(f"{s['lane_id']} failed to load {', '.join(s['load_errors'])}")
            if s["drained"]:
                notes.append(f"{s['lane_id']} drained")
        starting = [describe_progress(s["lane_id"], s["starting"]) for s in lanes if s["starting"] is not None]
        head = "draining" if self.stopping else "serving" if ready == len(lanes) else \
            "starting" if starting else "degraded"
        if starting and not self.stopping:
            return f"{head}: {ready}/{len(lanes)} lanes ready; {'; '.join(starting)}"
        text = f"{head}: {ready}/{len(lanes)} lanes ready, {self.api.inflight} in flight, {self.api.served} served"
        if self.tuner is not None and (tuning := self.tuner.describe()):
            notes.append(tuning)
        return text + (f"; {'; '.join(notes)}" if notes else "")

    async def notify_loop(self) -> None:
        """WATCHDOG=1 only while healthy (a stalled event loop sends nothing at all); STATUS= on change."""
        if not self.notifier.enabled:
            return
        wd = self.notifier.watchdog_interval_s
        period = min(wd, STATUS_INTERVAL_S) if wd else STATUS_INTERVAL_S
        last_status, last_why = "", "ok"
        while True:
            before = trio.current_time()
            await trio.sleep(period)
            lag = trio.current_time() - before - period
            ok, why = self.health()
            if ok and wd and lag > wd:
                ok, why = False, f"event loop stalled for {lag:.1f} s"
            if ok and wd:
                self.notifier.watchdog()
            if why != last_why and not ok:
                log.error("unhealthy, withholding WATCHDOG=1: %s", why)
            last_why = why
            status = self.status_line() if ok else f"unhealthy: {why}"
            if status != last_status:
                self.notifier.status(status)
                last_status = status

    # --- signals, reload, drain ----------------------------------------------------------------

    async def serve_signals(self, signals: AsyncIterator[int]) -> None:
        async for signum in signals:
            if signum == signal.SIGHUP:
                assert self.nursery is not None
                self.nursery.start_soon(self._reload_on_signal)
                continue
            log.info("received %s: draining", signal.Signals(signum).name)
            self.stop_requested.set()

    async def _reload_on_signal(self) -> None:
        try:
            await self.reload_config()
        except Exception as exc:  # logged in reload_config; a bad config file must not stop the daemon
            log.debug("reload failed: %s", exc)

    async def reload_config(self) -> dict[str, list[str]]:
        """Re-read the configuration file and carry out its reload plan (reload.py); a bad file changes nothing."""
        async with self._reload_lock:
            self.notifier.reloading("reloading configuration")
            log.info("reloading configuration from %s", self.config_path or "the embedded default")
            try:
                new = load_config(self.config_path, dict(self.env))
                # a ConfigError here leaves everything as it was
                specs = await resolve_specs(new.supervisor, self.sup.untuned)
                plan = plan_reload(self.cfg, new, Running(frozenset(self.sup.lanes), self.specs), specs=specs)
                report = await self.carry_out(plan)
            except Exception as exc:
                log.error("configuration reload failed, the running configuration stays: %s", exc)
                self.metrics.reloads.labels("error").inc()
                self.notifier.ready(f"reload failed: {exc}; {self.status_line()}")
                raise
            self.metrics.reloads.labels("ok").inc()
            log.info("configuration reloaded: %s", report.summary())
            self.notifier.ready(self.status_line())
            return report.as_dict()

    async def carry_out(self, plan: ReloadPlan) -> ReloadReport:
        """Apply the settings at once; then, while no new request of a changed model starts (those admitted before
        finish first, with the old settings), remove and add lanes and queue the reloads of every lane that serves
        a changed model, so each request is tokenized and served with one model's settings; the other lanes
        reload one after the other, each drained while others serve its models."""
        report = plan.report()
        self.api.http = plan.http
        if plan.logging_changed:
            setup_logging(plan.config.log_format, plan.config.log_level)
        async with trio.open_nursery() as reloads:
            async with self.sup.gate.changing(plan.forget_tokenizers):
                for model in plan.forget_tokenizers:
                    self.sup.forget_tokenizer(model)  # cached per model
                self.sup.reconfigure(dataclasses.replace(self.sup.config, models=plan.models, lanes=plan.lanes,
                                                         max_batch_items=plan.config.supervisor.max_batch_items),
                                     admission=plan.config.admission, batching=plan.config.batching)
                self.specs = dict(plan.specs)
                for lane_id in plan.remove:
                    await self.remove_lane(lane_id)
                    report.removed.append(lane_id)
                for lane_cfg in plan.add:
                    await self.sup.add_lane(lane_cfg, plan.loads(lane_cfg))
                    report.added.append(lane_cfg.id)
                changed = set(plan.forget_tokenizers) | set(plan.models_changed)
                together = [ln for ln in plan.reload if changed & set(ln.models)]
                for lane_cfg in together:
                    await reloads.start(self._reload_lane, LaneSettings.of(lane_cfg, plan.loads(lane_cfg)), report)
            for lane_cfg in plan.reload:
                if lane_cfg not in together:
                    await self._reload_lane(LaneSettings.of(lane_cfg, plan.loads(lane_cfg)), report)
        order = [ln.id for ln in plan.reload]
        report.reloaded.sort(key=order.index)
        report.changes.sort(key=lambda line: order.index(line.split(":", 1)[0]))
        self.cfg = plan.config
        return report

    async def _reload_lane(self, settings: LaneSettings, report: ReloadReport, *,
                           task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Restart the lane's worker in order with its new settings (reported started once the reload is queued);
        drained meanwhile when other lanes serve all of its models. A lane that fails to reload is reported, and
        the others go on."""
        lane_id = settings.cfg.id
        lane = self.sup.lanes[lane_id]
        changes = lane.settings.changes(settings)
        drained = self.sup.router.drained
        others = [ln for ln in self.sup.lanes.values() if ln.id != lane_id and ln.id not in drained
                  and ln.state not in (LaneState.STOPPING, LaneState.STOPPED)]
        drain = lane_id not in drained and all(any(m in ln.loads for ln in others) for m in settings.models)
        if drain:
            self.sup.router.drain(lane_id)
        try:
            await self.sup.reload_lane(lane_id, settings=settings, task_status=task_status)
        except Exception as exc:
            log.warning("reload of lane %s failed: %s", lane_id, exc, extra={"lane_id": lane_id})
            report.errors.append(f"{lane_id}: {exc}")
            return
        finally:
            if drain:
                self.sup.router.resume(lane_id)
        report.reloaded.append(lane_id)
        report.changes.append(f"{lane_id}: {', '.join(changes) or 'nothing (a restart)'}")
        log.info("lane %s reloaded (%s): generation %d, models %s", lane_id, ", ".join(changes), lane.generation,
                 ", ".join(lane.models_loaded), extra={"lane_id": lane_id, "generation": lane.generation})

    async def remove_lane(self, lane_id: str) -> None:
        """A lane gone from the configuration: routed no more, finishes what is queued, stops its worker."""
        self.removing.add(lane_id)
        try:
            await self.sup.remove_lane(lane_id)
        finally:
            self.removing.discard(lane_id)

    async def drain(self) -> None:
        """Readiness fails first, so load balancers stop sending work; after shutdown_delay_s no new request is
        admitted; the listeners stay open (probes answer, late requests get a typed 503) until the requests in
        flight are done, bounded by drain_s; then they close."""
        self.stopping = True
        self.api.draining = True
        self.notifier.stopping(f"draining: {self.api.inflight} requests in flight")
        if self.cfg.shutdown_delay_s:
            log.info("not ready; admitting requests for %g s more (daemon.shutdown_delay_s)", self.cfg.shutdown_delay_s)
            await trio.sleep(self.cfg.shutdown_delay_s)
        self.api.admitting = False
        log.info("draining: %d requests in flight (at most %g s)", self.api.inflight, self.cfg.drain_s)
        with trio.move_on_after(self.cfg.drain_s) as scope:
            await self.api.wait_idle()
        if scope.cancelled_caught:
            log.warning("drain bound of %g s passed with %d requests in flight; aborting them",
                        self.cfg.drain_s, self.api.inflight)
            for lane in list(self.sup.lanes.values()):
                if lane.state in (LaneState.BUSY, LaneState.DRAINING):  # abort_in_flight passes what is running
                    lane.abort_in_flight()
        self.stop_listeners.set()  # hypercorn lets the answers being written finish (graceful_timeout)
        self.notifier.status("stopping workers")


async def resolve_specs(sup_cfg: SupervisorConfig, untuned: Collection[str] = ()) -> dict[str, LoadSpec]:
    """Each configured model's LoadSpec, its digest read from the cache or computed; those `untuned` (a
    background tuner has not brought their kernels in yet) with beam 0, as their lanes run them."""
    cache = DigestCache(sup_cfg.state_dir / "digests.json")
    return {m.id: await load_spec(dataclasses.replace(m, beam=0) if m.id in untuned else m, cache)
            for m in sup_cfg.models}


async def run_daemon(cfg: DaemonConfig, *, config_path: Path | None = None,
                     env: MutableMapping[str, str] | None = None, notifier: Notifier | None = None,
                     task_status: trio.TaskStatus[Daemon] = trio.TASK_STATUS_IGNORED) -> None:
    """Serve until SIGTERM/SIGINT: then stop admitting, finish what is in flight, stop workers, return.

    Started value: the Daemon; `daemon.sup` is its Supervisor, `daemon.binds` the listener URLs (TCP first)."""
    env = os.environ if env is None else env
    notifier = notifier if notifier is not None else Notifier.from_env(env)
    try:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
            async with trio.open_nursery() as outer:  # listeners and the notify loop: alive until the very end
                notifier.status("starting: spawning workers and loading models")
                windows = cfg.supervisor.windows
                with trio.CancelScope() as workers_stop:  # bounds the workers' shutdown after the drain
                    # the listeners come up while the lanes start: a first start is never minutes of silence
                    record = TunedRecord(cfg.supervisor.state_dir)
                    untuned = to_tune(cfg, record)  # serve first on untuned kernels; tune them in the background
                    async with Supervisor(cfg.supervisor, admission=cfg.admission, batching=cfg.batching,
                                          wait_for_lanes=False, untuned=frozenset(untuned)) as sup:
                        daemon = Daemon(cfg, sup, config_path=config_path, env=env, notifier=notifier)
                        if untuned:
                            daemon.tuner = BackgroundTuner(cfg, untuned, record, on_tuned=daemon.tuned)
                        async with trio.open_nursery() as inner:
                            daemon.nursery = inner
                            await inner.start(daemon.metrics.watch_events)
                            binds = await daemon.start_listeners(outer)
                            outer.start_soon(daemon.notify_loop)
                            inner.start_soon(daemon.serve_signals, signals)
                            report = StartupReport(sup, cfg.supervisor.state_dir)
                            report.listening(binds)
                            if await report.run(until=daemon.stop_requested):  # READY=1 once every lane settled
                                notifier.ready(daemon.status_line())
                                report.settled(binds)
                            if daemon.tuner is not None:
                                inner.start_soon(daemon.tuner.run, sup)
                            task_status.started(daemon)
                            await daemon.stop_requested.wait()
                            await daemon.drain()
                            inner.cancel_scope.cancel()
                        # SHUTDOWN after what is queued; past the bound the kill path (which is shielded)
                        workers_stop.deadline = trio.current_time() + windows.shutdown_s + windows.kill_grace_s
                        sup.close()
                if workers_stop.cancelled_caught:
                    log.warning("workers did not stop within %g s: killed", windows.shutdown_s + windows.kill_grace_s)
                notifier.status("stopped")
                outer.cancel_scope.cancel()
    finally:
        notifier.close()
    log.info("gpuworkerd stopped")


def _find(exc: BaseException, kind: type[BaseException]) -> BaseException | None:
    if isinstance(exc, kind):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for sub in exc.exceptions:
            if (found := _find(sub, kind)) is not None:
                return found
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gpuworkerd", description="trio-gpuworker node daemon")
    p.add_argument("--config", type=Path, default=None, help="TOML config (default: the embedded default)")
    p.add_argument("--check-config", action="store_true", help="validate the configuration and exit")
    p.add_argument("--log-format", choices=("plain", "json"), help="override daemon.log_format")
    args = p.parse_args(argv)
    try:
        cfg = load_config(args.config)
    except ConfigError as exc:
        print(f"gpuworkerd: configuration error: {exc}", file=sys.stderr)
        return 2
    if args.check_config:
        print(f"configuration OK: {len(cfg.supervisor.lanes)} lane(s), {len(cfg.supervisor.models)} model(s)")
        return 0
    setup_logging(args.log_format or cfg.log_format, cfg.log_level)
    notifier = Notifier.from_env(os.environ, unset=True)  # workers must not talk to systemd
    os.umask(0o077)
    try:
        trio.run(partial(run_daemon, cfg, config_path=args.config, notifier=notifier))
    except BaseException as exc:
        err = _find(exc, ConfigError)
        if err is None:
            if _find(exc, KeyboardInterrupt) is not None:
                return 130
            notifier.notify(f"STATUS=failed: {type(exc).__name__}: {exc}")
            raise
        log.error("configuration error: %s", err)
        notifier.notify(f"STATUS=configuration error: {err}")
        return 2
    return 0
