"""Restored buffers get fresh identities (worker/_jitcache.py): a tinygrad BUFFER's identity includes a slot from a
process-local counter, so a restored model must not depend on what else the restoring process allocated, before the
restore or after it. Each model is built and stored in one process and restored in others
(tests/support/jit_restore_child.py), which allocate tensors with every restored buffer's exact (slot, dtype, size)
and fill them with garbage; every captured shape must then compute bit for bit what the freshly built model computed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent


def child(*args: str) -> str:
    proc = subprocess.run([sys.executable, "-m", "tests.support.jit_restore_child", *args], cwd=REPO,
                          env={**os.environ, "DEV": "CPU"}, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    if args[0] == "restore" and args[1].startswith("minilm"):  # restored, not built again
        assert "jit cache hit" in proc.stderr, proc.stderr[-4000:]
    return proc.stdout


def check(kind: str, folder: Path, mode: str) -> None:
    got: dict[str, Any] = json.loads(child("restore", kind, str(folder), mode))
    if mode != "none":  # every restored buffer's (slot, dtype, size) was taken by a tensor full of garbage
        assert got["reachable"] == got["keys"] > 0 and got["restored_behind_counter"], got
    assert got["bitwise"], got


@pytest.mark.parametrize("kind", ["toy", "toy-parts"])
def test_restored_toy_is_exact_whatever_the_process_allocated(tmp_path: Path, kind: str) -> None:
    child("build", kind, str(tmp_path))
    for mode in ("none", "before", "after"):
        check(kind, tmp_path, mode)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["minilm", "minilm-fused"])
def test_restored_minilm_is_exact_whatever_the_process_allocated(tmp_path: Path, kind: str) -> None:
    """Through the worker's loader. The graph encoder: the builder compiles the warm-up shapes at LOAD and the other
    four as requests need them, storing each as a part; every restore then has all six. The fused encoder (the
    CPU default): one entry, its packed weights and captured kernel, serving every batch of the same six."""
    child("build", kind, str(tmp_path))
    for mode in ("none", "before", "after"):
        check(kind, tmp_path, mode)
