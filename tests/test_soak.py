"""Bounded soak: several lanes x many concurrent callers x randomly injected worker faults."""

from __future__ import annotations

import json
import os
import random
import sys
from pathlib import Path

import numpy as np
import trio

from tests.support.config import MODEL, supervisor_config
from tests.support.fakes import fake_command
from trio_gpuworker import GpuWorkerError, Supervisor, Windows

LANES, CALLERS, REQUESTS, TIMEOUT_S = 3, 12, 20, 3.0
SOAK_HTTP_CALLERS, SOAK_HTTP_REQUESTS = 8, 40
SOAK_RSS_GROWTH_MB = 300  # the daemon's own growth while hostile inputs run (it was 2.9 GB for one 8 MB input)
SOAK_HEALTHZ_P99_S = 0.05


def children_of(pid: int) -> list[int]:
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                kids.append(int(entry))
    return kids


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def test_soak_with_random_faults(tmp_path: Path) -> None:
    windows = Windows(inference_s=0.5, setup_s=5, control_s=5, load_s=5, kill_grace_s=0.2, shutdown_s=2)
    commands = [fake_command(fault_rate=0.1, seed=lane) for lane in range(LANES)]
    cfg = supervisor_config(tmp_path, *commands, windows=windows, cooldown_s=0.5, backoff_s=0.02)
    fds_before, kids_before = open_fds(), children_of(os.getpid())
    outcomes: dict[str, int] = {}
    worst = 0.0

    async with Supervisor(cfg) as sup:
        async def caller(c: int) -> None:
            nonlocal worst
            rng = random.Random(c)
            for r in range(REQUESTS):
                # content unique to (caller, request): a reply that reaches the wrong caller cannot match
                rows = [np.full(rng.randint(1, 9), 1000 * c + r + i, dtype=np.int32) for i in range(rng.randint(1, 4))]
                t0 = trio.current_time()
                try:
                    out = await sup.embed_ids(rows, model=MODEL, pooling="mean", normalize=True, timeout=TIMEOUT_S)
                except GpuWorkerError as exc:
                    outcomes[exc.code] = outcomes.get(exc.code, 0) + 1
                else:
                    want = np.array([[row.sum(), len(row), i] for i, row in enumerate(rows)], dtype=np.float32)
                    np.testing.assert_array_equal(out[:, :3], want)
                    outcomes["ok"] = outcomes.get("ok", 0) + 1
                worst = max(worst, trio.current_time() - t0)

        async with trio.open_nursery() as nursery:
            for c in range(CALLERS):
                nursery.start_soon(caller, c)
        crashed = sum(lane.generation - 1 for lane in sup.lanes.values())

    print(outcomes, "restarts:", crashed, "worst:", round(worst, 2))
    assert sum(outcomes.values()) == CALLERS * REQUESTS
    assert outcomes.get("ok", 0) > CALLERS * REQUESTS // 3, outcomes
    assert crashed > 0 and outcomes.get("engine_crashed", 0) > 0, outcomes  # faults really happened
    assert set(outcomes) <= {"ok", "engine_crashed", "deadline_exceeded"}, outcomes
    assert worst <= TIMEOUT_S + 1.0
    assert children_of(os.getpid()) == kids_before
    assert open_fds() <= fds_before  # none left behind (fewer: an earlier test's fds were collected meanwhile)
    assert list((tmp_path / "run" / "gpuworker" / "workers").iterdir()) == []


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


async def test_soak_http_with_hostile_inputs(tmp_path: Path) -> None:
    """Normal embeddings and reranks with hostile requests mixed in (tests/support/hostile_traffic.py, from its own
    process), over real HTTP: no untyped error, no 500, no strike, bounded daemon RSS, and /healthz answering
    fast throughout."""
    from tests.support.config import daemon_config
    from tests.support.helpers import client_for

    cfg = daemon_config(tmp_path, fake_command(), fake_command(),
                        http={"max_body_bytes": 4 << 20, "body_timeout_s": 5.0})
    health: list[float] = []
    rss_before = rss_mb()
    rss_peak = rss_before
    async with trio.open_nursery() as nursery:
        http, daemon = await client_for(nursery, cfg)
        sup = daemon.sup
        first = [(0, s["generation"]) for s in sup.status()]
        async with http:
            done = trio.Event()

            async def poll_health() -> None:
                nonlocal rss_peak
                while not done.is_set():
                    t0 = trio.current_time()
                    assert (await http.get("/healthz")).status_code == 200
                    health.append(trio.current_time() - t0)
                    rss_peak = max(rss_peak, rss_mb())
                    await trio.sleep(0.005)

            async with trio.open_nursery() as polling:  # the poller ends before its client closes
                polling.start_soon(poll_health)
                proc = await trio.run_process([sys.executable, "-m", "tests.support.hostile_traffic",
                                               str(http.base_url), str(SOAK_HTTP_CALLERS), str(SOAK_HTTP_REQUESTS)],
                                              capture_stdout=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
                done.set()
            codes = json.loads(proc.stdout)
            strikes = [(s["strikes"], s["generation"]) for s in sup.status()]
        nursery.cancel_scope.cancel()

    ordered = sorted(health)
    p99 = ordered[int(len(ordered) * 0.99)]
    print(codes, f"healthz n={len(health)} p50={ordered[len(ordered) // 2] * 1000:.1f} ms "
                 f"p99={p99 * 1000:.1f} ms max={ordered[-1] * 1000:.1f} ms",
          f"rss {rss_before:.0f} -> peak {rss_peak:.0f} MiB")
    assert sum(codes.values()) == SOAK_HTTP_CALLERS * SOAK_HTTP_REQUESTS
    assert codes.get("ok", 0) > SOAK_HTTP_CALLERS * SOAK_HTTP_REQUESTS // 2, codes
    assert set(codes) <= {"ok", "invalid_request", "invalid_json", "request_too_large", "not_found"}, codes
    assert strikes == first  # typed, all the client's own fault, and never a worker's: no strike, no restart
    assert rss_peak - rss_before < SOAK_RSS_GROWTH_MB
    assert p99 < SOAK_HEALTHZ_P99_S, p99
