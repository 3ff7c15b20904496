"""A real `gpuworkerd` process serving a tiny random-weight llama GGUF (tests/support/tiny_gguf.py), for sync tests
that drive it with the real client libraries over HTTP: one daemon per test module (a module-scoped fixture)."""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from tests.support.state import SESSION_STATE, short_dir
from tests.support.tiny_gguf import CHATML, DEFAULT_VOCAB, Dims, write_llama

ROOT = Path(__file__).resolve().parents[2]
TINY_LM = "tiny-lm"
# ChatML, with the tools described in a system turn first, as tool-calling models' templates do
TOOLS_TEMPLATE = ("{% if tools %}{{ '<|im_start|>system\\nTools: ' + (tools | tojson) + '<|im_end|>\\n' }}{% endif %}"
                  + CHATML)
CONTEXT = 2048  # room for a prompt with tools (a byte-level vocabulary: a token a byte) and constrained tokens
START_S = 300.0  # a loaded 2-vCPU machine compiles the tiny model's kernels (or loads a bench's model) within this


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def tiny_daemon(folder: Path) -> Iterator[str]:
    """The base URL of a `gpuworkerd` serving TINY_LM (random weights, byte-level vocabulary) from one lane, once
    /readyz answers 200; on exit SIGTERM, and the daemon (which stops its worker) is waited for."""
    path = write_llama(folder / "tiny.gguf", {}, Dims(context=CONTEXT), seed=3,
                       vocab=dataclasses.replace(DEFAULT_VOCAB, template=TOOLS_TEMPLATE))
    port = _free_port()
    config = folder / "gpuworkerd.toml"
    config.write_text(f'[http]\nlisten = "127.0.0.1:{port}"\n'
                      f'[models."{TINY_LM}"]\nkind = "generate"\npath = "{path}"\n'
                      f'runtime_config = {{ max_context = {CONTEXT} }}\n'
                      f'[[lanes]]\nid = "gen0"\nmodels = ["{TINY_LM}"]\n')
    env = {**os.environ, "GPUWORKER_STATE_DIR": str(SESSION_STATE),
           "GPUWORKER_RUNTIME_DIR": str(short_dir("gw-structured-")), "PYTHONPATH": str(ROOT)}
    argv = [sys.executable, str(ROOT / "bin" / "gpuworkerd"), "--config", str(config)]
    with running(argv, env, f"http://127.0.0.1:{port}", "/readyz", folder / "gpuworkerd.log", cwd=folder) as base:
        yield base


@contextmanager
def running(argv: list[str], env: dict[str, str], base: str, ready: str, log: Path,
            cwd: Path | None = None) -> Iterator[str]:
    """Start the server `argv` (its output in `log`) and yield `base` once GET `ready` answers 200; on exit SIGTERM,
    and the process is waited for (killed after a minute). Shared by the tests and bench/threads_server.py."""
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd)
        try:
            deadline = time.monotonic() + START_S
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"{argv[:3]} exited {proc.returncode}: {log.read_text()[-4000:]}")
                try:
                    if httpx.get(base + ready, timeout=5).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{argv[:3]} not ready in {START_S} s")
                time.sleep(0.2)
            yield base
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


__all__ = ["CONTEXT", "TINY_LM", "TOOLS_TEMPLATE", "running", "tiny_daemon"]
