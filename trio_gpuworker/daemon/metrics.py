"""GET /metrics: Prometheus text format from a private registry per daemon.

Request counters and latency histograms are updated by the HTTP layer; lane and queue figures are read
from the supervisor's cached state at scrape time (a scrape never waits on a worker).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import trio
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from ..supervisor import LaneState

if TYPE_CHECKING:
    from ..supervisor import Supervisor

CONTENT_TYPE = CONTENT_TYPE_LATEST
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)
RING_DIRECTIONS = ("ingress", "egress")


class Metrics:
    def __init__(self, sup: Supervisor) -> None:
        self.sup = sup
        self.registry = r = CollectorRegistry(auto_describe=True)
        self.requests = Counter("gpuworker_http_requests", "HTTP requests by route, model and outcome "
                                "(ok or the error code)", ["route", "model", "outcome"], registry=r)
        self.latency = Histogram("gpuworker_http_request_duration_seconds", "HTTP request latency",
                                 ["route", "model"], buckets=LATENCY_BUCKETS, registry=r)
        self.batch_rows = Histogram("gpuworker_embed_batch_rows", "rows per EMBED_BATCH sent by the batcher",
                                    ["model"], buckets=BATCH_BUCKETS, registry=r)
        self.batch_callers = Histogram("gpuworker_embed_batch_requests", "caller requests merged per EMBED_BATCH",
                                       ["model"], buckets=BATCH_BUCKETS, registry=r)
        self.dropped = Counter("gpuworker_requests_dropped", "queued requests dropped before reaching a worker "
                               "because their caller went away", ["model"], registry=r)
        self.crashes = Counter("gpuworker_worker_crashes", "worker generations that ended in a fault",
                               ["lane", "cause"], registry=r)
        self.quarantines = Counter("gpuworker_lane_quarantines", "times a lane entered quarantine", ["lane"],
                                   registry=r)
        self.reloads = Counter("gpuworker_config_reloads", "configuration reloads (SIGHUP)", ["outcome"], registry=r)
        # per model, from admission (Ticket.timing): what routers and autoscalers read for generation
        self.timings = {
            what: Histogram(f"gpuworker_{what}_seconds", help_, ["model"], buckets=buckets, registry=r)
            for what, help_, buckets in (
                ("queue_wait", "from admission to the request's write to a worker (tokenization and queues)",
                 LATENCY_BUCKETS),
                ("time_to_first_token", "from admission to the first generated token", LATENCY_BUCKETS),
                ("inter_token", "between generated tokens of one request", TOKEN_BUCKETS))}
        r.register(_StateCollector(self))
        sup.batcher.subscribe(on_batch=self.on_batch, on_drop=self.on_drop)
        if sup.scheduler is not None:
            sup.scheduler.observe = self.on_timing

    # --- updates ---------------------------------------------------------------------------------

    def observe(self, route: str, model: str, outcome: str, seconds: float) -> None:
        self.requests.labels(route, model, outcome).inc()
        self.latency.labels(route, model).observe(seconds)

    def on_batch(self, model: str, rows: int, callers: int) -> None:
        self.batch_rows.labels(model).observe(rows)
        self.batch_callers.labels(model).observe(callers)

    def on_timing(self, what: str, model: str, seconds: float) -> None:
        self.timings[what].labels(model).observe(seconds)

    def on_drop(self, model: str, n: int) -> None:
        self.dropped.labels(model).inc(n)

    async def watch_events(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Count crashes and quarantines from the supervisor's event bus."""
        events = self.sup.subscribe()
        task_status.started()
        async with events:
            async for ev in events:
                if ev.get("t") != "WORKER_CRASHED":
                    continue
                lane_id = str(ev.get("lane_id"))
                self.crashes.labels(lane_id, str(ev.get("cause", "crash"))).inc()
                lane = self.sup.lanes.get(lane_id)
                if lane is not None and lane.cooldown_remaining() is not None:
                    self.quarantines.labels(lane_id).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _StateCollector(Collector):
    """Lane and queue state, read at scrape time."""

    def __init__(self, metrics: Metrics) -> None:
        self.m = metrics

    def describe(self) -> list[Metric]:
        return []  # families depend on the lanes configured at scrape time

    def collect(self) -> Iterator[Metric]:
        sup, sched = self.m.sup, self.m.sup.scheduler
        lanes = sup.status()
        g: dict[str, Any] = {
            "state": GaugeMetricFamily("gpuworker_lane_state", "1 for the lane's current state",
                                       labels=["lane", "state"]),
            "generation": GaugeMetricFamily("gpuworker_lane_generation", "worker generation (spawn count)",
                                            labels=["lane"]),
            "strikes": GaugeMetricFamily("gpuworker_lane_strikes", "consecutive faults counted toward quarantine",
                                         labels=["lane"]),
            "quarantined": GaugeMetricFamily("gpuworker_lane_quarantined", "1 while the lane is quarantined",
                                             labels=["lane"]),
            "cooldown": GaugeMetricFamily("gpuworker_lane_cooldown_remaining_seconds",
                                          "seconds of quarantine left", labels=["lane"]),
            "rss": GaugeMetricFamily("gpuworker_worker_rss_bytes", "worker resident set size (last PING)",
                                     labels=["lane"]),
            "queued": GaugeMetricFamily("gpuworker_lane_queue_depth", "requests queued on the lane",
                                        labels=["lane"]),
            "drained": GaugeMetricFamily("gpuworker_lane_drained", "1 while no new requests are routed to the lane",
                                         labels=["lane"]),
            "models": GaugeMetricFamily("gpuworker_lane_models_loaded", "models loaded by the lane's worker",
                                        labels=["lane"]),
            "standby": GaugeMetricFamily("gpuworker_lane_standby_ready",
                                         "1 while a warm standby worker is loaded and idle", labels=["lane"]),
        }
        restarts = CounterMetricFamily("gpuworker_lane_restarts", "worker restarts after a fault", labels=["lane"])
        drained = sup.router.drained
        for s in lanes:
            lane = s["lane_id"]
            for state in LaneState:
                g["state"].add_metric([lane, state.value], 1.0 if s["state"] == state.value else 0.0)
            g["generation"].add_metric([lane], s["generation"])
            g["strikes"].add_metric([lane], s["strikes"])
            g["quarantined"].add_metric([lane], 1.0 if s["cooldown_remaining_s"] is not None else 0.0)
            g["cooldown"].add_metric([lane], s["cooldown_remaining_s"] or 0.0)
            if s["rss_mb"] is not None:
                g["rss"].add_metric([lane], s["rss_mb"] * (1 << 20))
            g["queued"].add_metric([lane], s["queued"])
            g["drained"].add_metric([lane], 1.0 if lane in drained else 0.0)
            g["models"].add_metric([lane], len(s["models"]))
            if s.get("standby") is not None or s.get("standby_enabled"):
                g["standby"].add_metric([lane], 1.0 if (s["standby"] or {}).get("state") == "ready" else 0.0)
            restarts.add_metric([lane], s["restarts"])
        yield from g.values()
        yield restarts

        qbytes = GaugeMetricFamily("gpuworker_model_queue_bytes", "token-id bytes queued or in flight",
                                   labels=["model"])
        qreqs = GaugeMetricFamily("gpuworker_model_queue_depth", "requests admitted and not yet answered",
                                  labels=["model"])
        budget = GaugeMetricFamily("gpuworker_model_queue_budget_bytes", "admission byte budget per model",
                                   labels=["model"])
        rejected = CounterMetricFamily("gpuworker_admission_rejected", "requests refused over the byte budget",
                                       labels=["model"])
        pending = GaugeMetricFamily("gpuworker_batcher_pending_rows", "rows waiting in open batches",
                                    labels=["model"])
        waiting = GaugeMetricFamily("gpuworker_model_requests_queued", "worker requests waiting in the queues of "
                                    "the lanes that serve the model", labels=["model"])
        running = GaugeMetricFamily("gpuworker_model_requests_running", "worker requests running on the lanes "
                                    "that serve the model (one per busy lane)", labels=["model"])
        prompt = CounterMetricFamily("gpuworker_prompt_tokens", "tokens of the inputs sent to the model's "
                                     "workers (prompts, texts, queries and documents)", labels=["model"])
        generated = CounterMetricFamily("gpuworker_generation_tokens", "tokens the model generated",
                                        labels=["model"])
        for mc in sup.config.models:
            if sched is not None:
                qbytes.add_metric([mc.id], sched.queued_bytes.get(mc.id, 0))
                qreqs.add_metric([mc.id], sched.queued.get(mc.id, 0))
                budget.add_metric([mc.id], sched.policy.queue_bytes)
                rejected.add_metric([mc.id], sched.rejected.get(mc.id, 0))
                prompt.add_metric([mc.id], sched.prompt_tokens.get(mc.id, 0))
                if not mc.encoder:
                    generated.add_metric([mc.id], sched.generated_tokens.get(mc.id, 0))
            pending.add_metric([mc.id], self.m.sup.batcher.pending_rows(mc.id))
            n_waiting, n_running = sup.router.load(mc.id)
            waiting.add_metric([mc.id], n_waiting)
            running.add_metric([mc.id], n_running)
        yield from (qbytes, qreqs, budget, rejected, pending, waiting, running, prompt, generated)

        moved = sup.dataplane.bytes_moved if sup.dataplane is not None else {}
        ring = CounterMetricFamily("gpuworker_ring_bytes", "bytes moved through shared-memory rings",
                                   labels=["direction"])
        for direction in RING_DIRECTIONS:
            ring.add_metric([direction], float(moved.get(direction, 0)))
        yield ring
