"""A newcomer's `make run`, timed black box: `bin/gpuworkerd` on its embedded default (the CPU models, one embed
lane per core and the SmolLM2 lane), first on a fresh state directory (nothing compiled, nothing cached), then
started again on the same one (warm). For each start: spawn -> listening (the first HTTP answer of any kind),
-> the first successful one-sentence embedding, -> the first successful chat completion (max_tokens 8), -> /readyz
200 (every lane serves); how many `503 model_loading` answers the polling clients got meanwhile; and how many log
lines the daemon wrote before it was ready (a first start is never minutes of silence).

    .venv/bin/python bench/startup.py [--warm-rounds 2]

The targets (issue 18): listening at once, first embedding <= 20 s and first chat <= 60 s on a fresh state
directory, ready <= 5 s on a warm one.
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


def fmt(v: float | None) -> str:
    return f"{v:8.1f} s" if v is not None else "       - "


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--warm-rounds", type=int, default=2)
    args = ap.parse_args()
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
